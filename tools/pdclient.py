"""The P/D test client both the e2e tier (tests/e2e) and the vLLM GPU check use: deterministic token
prompts, the greedy request body, the two legs of a pair sent straight to P and D with the contract's
`kvferry` params, top-2 logprob gaps, and the greedy comparison that accepts a parting at a numeric tie.

Pure: no HTTP here; each caller sends the bodies with its own client (the e2e tests assert, the GPU
check records failures per case)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvferry.contracts.params import ConsumerParams, ProducerParams

SERVED_NAME = "tiny"  # --served-model-name of every test server
HOST = "127.0.0.1"  # P's side channel host in a decode leg: every test server is local
DEADLINE_S = 60.0
MAX_TOKENS = 16

# Greedy outputs of two numerically different but correct paths (e.g. decode attention over 64-token
# blocks after a prefill over 128-token blocks) may part where the reference's two best tokens are
# within float noise: the random tiny model's logits are nearly flat (logprobs ~ -7.3). Measured
# (2026-11-30): P/D and single logprobs of the same token differ by up to 6e-4; the two divergences
# seen were at top-2 gaps of 4e-5 and 5e-4, while the transferred KV was bit-identical. vLLM's own
# tests accept such partings the same way (check_logprobs_close).
TIE_LOGPROB = 2e-3

Body = dict[str, Any]


def token_prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly `length` token ids above the special tokens; `salt` gives
    another prompt of the same length (salt 0 is the e2e tier's prompt)."""
    return [10 + (i * 7919 + length + salt * 104729) % 2000 for i in range(length)]


def prompt_body(
    prompt: Sequence[int], max_tokens: int = MAX_TOKENS, *, stream: bool = False, logprobs: int | None = None
) -> Body:
    """A greedy completion request for token ids that never stops early and returns its token ids."""
    body: Body = {
        "model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream, "return_token_ids": True,
    }  # fmt: skip
    if logprobs:
        body["logprobs"] = logprobs
    return body


def completion_body(length: int, stream: bool = False) -> Body:
    """The greedy completion request of `token_prompt(length)`."""
    return prompt_body(token_prompt(length), stream=stream)


def chat_body(text: str) -> Body:
    return {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip


def pd_legs(
    body: Body,
    rid: str,
    *,
    prefill_engine: str,
    prefill_side_port: int,
    decode_engine: str,
    attempt: int = 0,
    deadline_s: float = DEADLINE_S,
) -> tuple[Body, Body]:
    """(prefill leg, decode leg) of request `rid`, with the router's contract types
    (kvferry.contracts.params): prefill computes one token, decode streams or not as `body` says."""
    p = ProducerParams(rid, attempt, decode_engine, deadline_s)
    d = ConsumerParams(rid, attempt, prefill_engine, HOST, prefill_side_port, 1, deadline_s)
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": p.kv_transfer_params()}
    decode = {**body, "kv_transfer_params": d.kv_transfer_params()}
    return prefill, decode


def kvferry_legs(
    body: Body, *, prefill_engine: str, prefill_side_port: int, decode_engine: str, attempt: int = 0
) -> tuple[Body, Body, str]:
    """(prefill leg, decode leg, request id) of a new request: `pd_legs` with a fresh id."""
    rid = uuid.uuid4().hex
    prefill, decode = pd_legs(
        body,
        rid,
        prefill_engine=prefill_engine,
        prefill_side_port=prefill_side_port,
        decode_engine=decode_engine,
        attempt=attempt,
    )
    return prefill, decode, rid


def with_logprobs(path: str, body: Body) -> Body:
    """The same request, not streamed, asking for the top-2 logprobs of every generated token."""
    extra = {"logprobs": True, "top_logprobs": 2} if path.endswith("/chat/completions") else {"logprobs": 2}
    return {**body, "stream": False, **extra}


def _gap(values: list[float]) -> float:
    values = sorted(values, reverse=True)
    return values[0] - values[1] if len(values) > 1 else math.inf


def top2_gaps(choice: Mapping[str, Any]) -> list[float]:
    """Per generated position of a completions or chat choice: the best token's logprob minus the
    second best's (inf where only one was returned; [] without logprobs)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:  # chat: {"content": [{"top_logprobs": [{"logprob": x}, ...]}, ...]}
        return [_gap([t["logprob"] for t in c.get("top_logprobs") or []]) for c in logprobs["content"] or []]
    # completions: {"top_logprobs": [{token: logprob, ...}, ...]}
    return [_gap(list((t or {}).values())) for t in logprobs.get("top_logprobs") or []]


def compare(
    want: Sequence[int], got: Sequence[int] | None, gaps: Sequence[float], tie: float = 0.0
) -> tuple[str, str]:
    """('equal' | 'tie' | 'differs', detail) of two greedy token-id outputs of the same length. 'tie':
    they part where the reference's top-2 logprobs are within `tie` (nothing after the parting is
    compared; 0 = strict: any difference differs)."""
    got = list(got or [])
    if got == list(want):
        return "equal", ""
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if at is None or len(got) != len(want):  # every request ignores EOS: a length never differs
        return "differs", f"{len(got)} tokens, reference {len(want)}"
    gap = gaps[at] if at < len(gaps) else math.inf
    if tie > 0 and gap <= tie:
        return "tie", f"parted at token {at} (reference top-2 gap {gap:.1e})"
    return "differs", f"token {at} is {got[at]}, reference {want[at]} (top-2 gap {gap:.1e})"


def compare_greedy(
    want: Mapping[str, Mapping[str, Any]],
    got: Mapping[str, Mapping[str, Any]],
    gaps: Mapping[str, Sequence[float]],
    tie: float = TIE_LOGPROB,
) -> tuple[list[str], list[str]]:
    """(mismatches, tie partings) of outputs by key ({"token_ids", "text"}): equal token for token and
    text for text, except that they may part at a tie of the reference (`compare`)."""
    mismatches: list[str] = []
    ties: list[str] = []
    for key, w in want.items():
        g = got[key]
        if g == w:
            continue
        verdict, detail = compare(w.get("token_ids") or [], g.get("token_ids"), gaps[key], tie)
        if verdict == "tie":
            ties.append(f"{key}: {detail}")
        else:  # "equal" token ids with other text is a mismatch too
            mismatches.append(f"{key}: {detail or f'{g!r} != {w!r}'}")
    return mismatches, ties
