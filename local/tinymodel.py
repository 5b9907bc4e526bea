"""Tiny model step: build a random-weight Llama/Qwen model and a locally trained tokenizer for tests.

Nothing comes from a model hub: the tokenizer is a byte-level BPE trained with `tokenizers` on
generated sentences, the weights are seeded random normals. A build is keyed by the hash of its
recipe, so a second build of the same recipe returns at once.

A `Shape` overrides the attention geometry (heads, KV heads for GQA, head_dim), the dtype and the
layer count; `SHAPES` is the matrix tests run the connector against. The dtype goes into the HF
config (`dtype`, which vLLM's `--dtype auto` reads) and the weights are saved in it.

    kvferry model build [DIR] [--arch llama|qwen|qwen3|mistral] [--heads N] [--kv-heads N] [--head-dim N]
                        [--dtype float32|bfloat16|float16] [--layers N]
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
from dataclasses import dataclass
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
    # Qwen3: Qwen2 plus per-head RMSNorm on q and k (q_norm/k_norm) and an explicit head_dim.
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False},
    # Mistral: Llama with a sliding window (Shape.window; HF's own default of 4096 is turned off).
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
}
# Archs whose vLLM model ignores config.head_dim and uses hidden_size // num_attention_heads.
HEAD_DIM_FROM_HIDDEN = ("qwen",)
DTYPES: dict[str, str] = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # dtype -> dir tag
# vLLM-CPU's attention kernels (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
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


@dataclass(frozen=True)
class Shape:
    """Attention geometry, dtype and depth of a tiny model; the defaults are BASE_CONFIG's.

    hidden_size stays 128 for every shape (small and fast); head_dim is written to the config, so
    heads * head_dim need not equal hidden_size (except for archs in HEAD_DIM_FROM_HIDDEN)."""

    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    layers: int = 2
    # Sliding-window attention: `window` tokens (0: none). full_every=0 windows every layer (vLLM's
    # model-level window); n > 0 makes every n-th layer full attention and the rest windowed, as
    # Gemma-3 interleaves them (per-layer `layer_types`, two KV-cache groups in vLLM).
    window: int = 0
    full_every: int = 0

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Shape.{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"Shape.kv_heads={self.kv_heads} must divide Shape.heads={self.heads} "
                "(each KV head serves a whole group of query heads)"
            )
        if self.head_dim not in CPU_HEAD_SIZES:
            raise ValueError(
                f"Shape.head_dim={self.head_dim} is not a vLLM-CPU attention head size {CPU_HEAD_SIZES}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"Shape.dtype={self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.window < 0 or self.full_every < 0 or (self.full_every and not self.window):
            raise ValueError(
                f"Shape.window={self.window} and full_every={self.full_every}: both >= 0, and "
                "full_every only with a window"
            )

    @property
    def tag(self) -> str:
        """Folder-name form, e.g. h8kv2d32l3-bf16 (w64 / w64f2 with a window)."""
        window = f"w{self.window}" + (f"f{self.full_every}" if self.full_every else "") if self.window else ""
        return f"h{self.heads}kv{self.kv_heads}d{self.head_dim}l{self.layers}{window}-{DTYPES[self.dtype]}"

    def config(self) -> dict[str, Any]:
        """The HF config fields this shape sets."""
        out: dict[str, Any] = {
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "num_hidden_layers": self.layers,
        }
        if self.window:
            out["sliding_window"] = self.window
        if self.full_every:
            out["layer_types"] = [
                "full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
                for i in range(self.layers)
            ]
        return out


DEFAULT_SHAPE = Shape()

# The shape matrix tests run against: name -> (arch, shape). The first is the default build.
SHAPES: dict[str, tuple[str, Shape]] = {
    f"{arch}-{shape.tag}": (arch, shape)
    for arch, shape in [
        ("llama", DEFAULT_SHAPE),
        ("llama", Shape(heads=8, kv_heads=2, head_dim=64, dtype="bfloat16", layers=3)),
        ("qwen3", Shape(heads=8, kv_heads=2, head_dim=32, dtype="float32", layers=3)),
        ("qwen3", Shape(heads=4, kv_heads=1, head_dim=128, dtype="bfloat16", layers=3)),
        ("llama", Shape(heads=4, kv_heads=1, head_dim=128, dtype="float32", layers=3)),
        ("qwen3", Shape(heads=2, kv_heads=2, head_dim=64, dtype="bfloat16", layers=3)),
        ("llama", Shape(heads=8, kv_heads=2, head_dim=32, dtype="bfloat16", layers=3)),
        # sliding windows: every layer (Mistral), and interleaved with full layers (Gemma-3's way)
        ("mistral", Shape(heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", layers=4, window=64)),
        (
            "llama",
            Shape(heads=4, kv_heads=2, head_dim=64, dtype="float32", layers=4, window=64, full_every=2),
        ),
        ("mistral", Shape(heads=4, kv_heads=1, head_dim=64, dtype="float32", layers=3, window=48)),
    ]
}


def recipe(arch: str, shape: Shape | None = None) -> dict[str, Any]:
    """Everything that determines the build output; its hash names the build.

    The shape's fields land in the config, so every override changes the hash, and the default
    shape gives exactly the recipe (and hash) of builds made before shapes existed."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    shape = DEFAULT_SHAPE if shape is None else shape
    config = {**BASE_CONFIG, **ARCHS[arch], **shape.config()}
    if arch in HEAD_DIM_FROM_HIDDEN and shape.heads * shape.head_dim != config["hidden_size"]:
        raise ValueError(
            f"Shape.head_dim={shape.head_dim}: arch {arch!r} in vLLM uses hidden_size // heads as head_dim, "
            f"so heads * head_dim must be {config['hidden_size']} (got {shape.heads * shape.head_dim})"
        )
    return {"builder": BUILDER_VERSION, "arch": arch, "config": config, "seed": 0}


def recipe_hash(arch: str, shape: Shape | None = None) -> str:
    return hashlib.sha256(json.dumps(recipe(arch, shape), sort_keys=True).encode()).hexdigest()[:16]


def model_dir_name(arch: str, shape: Shape | None = None) -> str:
    """tiny-<arch>-<hash> for the default shape (as before shapes), tiny-<arch>-<shape tag>-<hash> else."""
    shape = DEFAULT_SHAPE if shape is None else shape
    middle = "" if shape == DEFAULT_SHAPE else f"{shape.tag}-"
    return f"tiny-{arch}-{middle}{recipe_hash(arch, shape)}"


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
    # Drawn in float32 whatever the target dtype, then cast: the same numbers for every dtype.
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            # Wide random weights give varied greedy tokens, so output equality is a real check.
            param.normal_(0.0, 0.1)
    model = model.to(getattr(torch, config["dtype"]))
    model.config.dtype = config["dtype"]  # what vLLM's --dtype auto reads
    model.save_pretrained(out, safe_serialization=True)


def build(out_dir: str | Path, arch: str = "llama", shape: Shape | None = None) -> Path:
    """Build the model into out_dir (or return at once if the same recipe is already there)."""
    out = Path(out_dir)
    want = recipe_hash(arch, shape)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == want:
        return out
    spec = recipe(arch, shape)
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


def ensure(arch: str = "llama", shape: Shape | None = None) -> Path:
    """The cached build for arch and shape under $KVFERRY_CACHE/models (what tests and benches use)."""
    return build(default_cache_dir() / model_dir_name(arch, shape), arch, shape)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the tiny model into DIR (cached by recipe)")
    b.add_argument("dir", nargs="?", help="output folder (default: the shared cache)")
    b.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    b.add_argument("--heads", type=int, default=DEFAULT_SHAPE.heads, help="attention (query) heads")
    b.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE.kv_heads, help="KV heads (GQA)")
    b.add_argument("--head-dim", type=int, default=DEFAULT_SHAPE.head_dim, help=f"one of {CPU_HEAD_SIZES}")
    b.add_argument("--dtype", choices=tuple(DTYPES), default=DEFAULT_SHAPE.dtype, help="config and weights")
    b.add_argument("--layers", type=int, default=DEFAULT_SHAPE.layers, help="hidden layers")
    b.add_argument("--window", type=int, default=0, help="sliding window in tokens (0: none)")
    b.add_argument("--full-every", type=int, default=0, help="with --window: every n-th layer full")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, str, Shape]:
    """The parsed arguments with arch and Shape checked; a bad field exits 2 naming it."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        shape = Shape(
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
            layers=args.layers,
            window=args.window,
            full_every=args.full_every,
        )
        recipe(args.arch, shape)  # arch-specific checks
    except ValueError as exc:
        p.error(str(exc))
    return args, args.arch, shape


def main(argv: list[str] | None = None) -> int:
    args, arch, shape = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = build(args.dir, arch, shape) if args.dir else ensure(arch, shape)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
