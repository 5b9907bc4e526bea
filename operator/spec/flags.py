"""Flags step: the vLLM flags the operator sets itself, and every spelling vLLM accepts for them (pure).

extraArgs come last on the vLLM command line and win, so a role-level copy of an owned flag would
split P and D, change engine identity or the revision, or break the drain. vLLM's
FlexibleArgumentParser (vllm/utils/argparse_utils.py, argparse with allow_abbrev) accepts, for one
flag such as --tensor-parallel-size:
- `_` for `-` in the name (`--tensor_parallel_size`), `--flag=value`, dotted JSON keys
  (`--kv-transfer-config.engine_id X`);
- any unique prefix (`--tensor-parallel`, `--tensor`), including of short forms (`-tp`, `-t`);
- `--config FILE`, whose YAML can set any flag.
So an argument is refused when its name (before `=` or `.`, `_` read as `-`) is a non-empty prefix of
an owned long name, or a prefix of an owned short form. No real vLLM flag is a proper prefix of an
owned one (tests/unit/operator/test_flag_aliases.py checks that against vLLM's own parser), so
refusing prefixes refuses nothing else; a short prefix would be ambiguous in vLLM anyway.
`cel_no_owned_flags` is the same rule as CEL for the CRD, from the same lists.
"""

from __future__ import annotations

# Long names the operator renders (render.vllm_args) or that would override what it renders.
OWNED_FLAGS = (
    "--kv-transfer-config",
    "--tensor-parallel-size",
    "--port",
    "--block-size",
    "--served-model-name",
    "--dtype",
    "--max-model-len",
    "--model",  # vLLM moves it in front of the positional model the operator passes
    "--config",  # a YAML file of flags: could set any of the above
    "--shutdown-timeout",  # the drain the pod's grace period is computed from
    "--enable-prefix-caching",  # spec.vllm.enablePrefixCaching, part of the revision
    "--no-enable-prefix-caching",
)
# Short forms vLLM registers for owned flags (option_strings of its serve parser).
SHORT_ALIASES = {"-tp": "--tensor-parallel-size"}


def _name(arg: str) -> str:
    """The option name vLLM reads from one argument: before `=` and `.`, `_` as `-` (long names)."""
    head = arg.split("=", 1)[0]
    if head.startswith("--"):
        return "--" + head[2:].split(".", 1)[0].replace("_", "-")
    return head


def owned_flag(arg: str) -> str | None:
    """The owned flag `arg` would set in vLLM, or None."""
    name = _name(arg)
    if name.startswith("--") and len(name) > 2:
        return next((flag for flag in OWNED_FLAGS if flag.startswith(name)), None)
    if name.startswith("-") and not name.startswith("--") and len(name) > 1:
        return next((long for short, long in SHORT_ALIASES.items() if short.startswith(name)), None)
    return None


def owned_flags_in(args: list[str]) -> list[str]:
    """Arguments that set an owned flag, as written."""
    return [arg for arg in args if owned_flag(arg) is not None]


def cel_no_owned_flags(path: str) -> str:
    """CEL for `self.<path>` (a list of args) holding no owned flag: owned_flag() as CEL, step by step."""
    longs = ", ".join(f"'{flag}'" for flag in OWNED_FLAGS)
    shorts = ", ".join(f"'{short}'" for short in SHORT_ALIASES)
    name = "a.split('=')[0].split('.')[0].replace('_', '-')"  # CRD CEL has no cel.bind
    short = "a.split('=')[0]"
    return (
        f"self.{path}.all(a, a.startsWith('--') "
        f"? (size({name}) <= 2 || !([{longs}].exists(f, f.startsWith({name})))) "
        f": (!a.startsWith('-') || size({short}) <= 1 || !([{shorts}].exists(f, f.startsWith({short})))))"
    )
