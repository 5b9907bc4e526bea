"""Operator-owned vLLM flags are refused in every spelling vLLM's own parser accepts, and nothing else is.

Checked against vLLM's serve parser (FlexibleArgumentParser: `_`/`-`, `=value`, dotted JSON keys,
argparse abbreviations, short forms); the CEL twin runs on the real API server through
tests/unit/operator/cases.py (tests/cluster/test_operator_validation.py).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
from kvferry.operator.spec.flags import OWNED_FLAGS, SHORT_ALIASES, owned_flag, owned_flags_in

from tests.unit.operator.cases import VALID


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    return cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser(prog="vllm serve"))


def _dests(parser: Any) -> dict[str, str]:
    """Option string -> dest, for every option of vLLM's serve parser."""
    return {opt: a.dest for a in parser._actions for opt in a.option_strings}


def _parsed(parser: Any, args: list[str]) -> dict[str, Any] | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return vars(parser.parse_args(["model", *args]))
    except (SystemExit, ValueError, AssertionError, OSError):
        return None  # vLLM refuses it: nothing to override


def _spellings(flag: str) -> list[list[str]]:
    """Ways to write `flag` with a value that vLLM might accept."""
    name = flag[2:] if flag.startswith("--") else flag[1:]
    out = []
    for cut in range(1, len(name) + 1):  # every abbreviation (2 ms per parse)
        head = ("--" if flag.startswith("--") else "-") + name[:cut]
        for spelled in {head, head.replace("-", "_").replace("__", "--", 1)}:
            out += [[spelled, "7"], [f"{spelled}=7"], [spelled], [f"{spelled}.engine_id", "7"]]
    return out


def test_every_spelling_vllm_maps_to_an_owned_flag_is_refused(vllm_parser) -> None:
    dests = _dests(vllm_parser)
    owned_dests = {dests[f] for f in OWNED_FLAGS if f in dests} | {dests[s] for s in SHORT_ALIASES}
    base = _parsed(vllm_parser, [])
    assert base is not None
    missed = []
    for flag in [*OWNED_FLAGS, *SHORT_ALIASES]:
        for args in _spellings(flag):
            got = _parsed(vllm_parser, args)
            if got is None:
                continue
            changed = {k for k in owned_dests if got.get(k) != base.get(k)}
            if changed and not owned_flags_in(args):
                missed.append((args, changed))
    assert missed == []


def test_short_forms_and_config_files_are_known_to_vllm(vllm_parser) -> None:
    dests = _dests(vllm_parser)
    for short, long in SHORT_ALIASES.items():
        assert dests[short] == dests[long]
    owned_dests = {dests[f] for f in OWNED_FLAGS if f in dests}
    shorts = {o for o, d in dests.items() if d in owned_dests and not o.startswith("--")}
    assert shorts <= set(SHORT_ALIASES), f"vLLM has more short forms of owned flags: {shorts}"


def test_no_real_vllm_flag_is_refused(vllm_parser) -> None:
    """Refusing prefixes is safe: no other vLLM flag is a prefix of an owned one."""
    wrongly = [o for o in _dests(vllm_parser) if owned_flag(o) and o not in (*OWNED_FLAGS, *SHORT_ALIASES)]
    assert wrongly == []


@pytest.mark.parametrize(
    "arg,flag",
    [
        ("--kv_transfer_config={}", "--kv-transfer-config"),
        ("--kv-transfer-config.engine_id", "--kv-transfer-config"),
        ("-tp", "--tensor-parallel-size"),
        ("-t=2", "--tensor-parallel-size"),
        ("--tensor", "--tensor-parallel-size"),
        ("--config", "--config"),
        ("--served_model=x", "--served-model-name"),
        ("--gpu-memory-utilization=0.9", None),
        ("--config-format=hf", None),
        ("-O3", None),
        ("value", None),
        ("--", None),
        ("-", None),
    ],
)
def test_owned_flag_names_the_flag_set(arg: str, flag: str | None) -> None:
    assert owned_flag(arg) == flag


def test_the_valid_unowned_args_case_sets_nothing_owned(vllm_parser) -> None:
    spec = VALID["unowned-extra-args"]["spec"]
    args = spec["vllm"]["extraArgs"] + spec["prefill"]["extraArgs"]
    assert not owned_flags_in(args)
    dests = _dests(vllm_parser)
    owned_dests = {dests[f] for f in OWNED_FLAGS if f in dests}
    base, got = _parsed(vllm_parser, []), _parsed(vllm_parser, args)
    assert got is not None and all(got[d] == base[d] for d in owned_dests)
