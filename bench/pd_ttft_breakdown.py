"""Where P/D's first-token time goes at low load: the same greedy 1024-token requests, one at a time,
measured five ways on one kvferry stack (PdStack: P on core 0, D on core 1, the router in front),
interleaved round by round so that drift hits every way alike.

- `engine`: a plain streaming request straight to P: one engine on one core, no transfer (the
  single-instance reference; P's connector is loaded and idle).
- `prefill-alone`: the router's prefill leg straight to P, D's leg sent only after P answered: P's
  answer with no push running beside it.
- `prefill-with-push`: both legs straight to the engines at once, as the router sends them: P's answer
  while D registers and P pushes the KV on the same core.
- `router`: through the router, the client's TTFT; `router-internal`: the router's own TTFT histogram
  (arrival to first byte sent), the same requests.

The differences are the breakdown: push beside P's answer = with-push - alone; the router's own
share = router-internal - with-push; the client's hop to the router = router - router-internal.

    python bench/pd_ttft_breakdown.py --rounds 40 --first-token prefill
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.tinymodel import ensure
from kvferry.router import params as legs
from kvferry.router.config import Endpoint
from kvferry.tools.pdstack import LOAD_ON, PdStack, add_placement_arguments

WAYS = ("engine", "prefill-alone", "prefill-with-push", "router")
PATH = legs.COMPLETIONS
TTFT_SUM = "kvferry_router_ttft_seconds_sum"  # arrival to the first byte sent, router side


def client_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


def stream_ttft_ms(client: httpx.Client, url: str, body: dict[str, Any], rid: str | None = None) -> float:
    """Milliseconds to the first event carrying a choice; reads the stream to its end."""
    headers = {"X-Request-Id": rid} if rid else {}
    t0, first = time.perf_counter(), None
    with client.stream("POST", url + PATH, json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data:") and '"choices":[{' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return first * 1000


def answer_ms(client: httpx.Client, url: str, body: dict[str, Any], rid: str) -> float:
    t0 = time.perf_counter()
    client.post(url + PATH, json=body, headers={"X-Request-Id": rid}).raise_for_status()
    return (time.perf_counter() - t0) * 1000


def endpoint(role: str, proc: Any) -> Endpoint:
    spec = proc.spec
    return Endpoint(role, proc.url, spec.engine_id, spec.host, spec.side_port, 1, "r1")


def legs_ms(stack: PdStack, client: httpx.Client, body: dict[str, Any], push_beside: bool) -> float:
    """P's answer to the router's prefill leg; D's leg sent at once (push_beside) or after P answered.
    D's leg always runs, so that P's KV is taken and released as through the router."""
    p, d = endpoint("prefill", stack.prefill), endpoint("decode", stack.decode)
    rid = uuid.uuid4().hex
    transfer_s = 10.0
    p_body = legs.prefill_body(body, legs.prefill_params("kvferry", rid, 0, d, transfer_s))
    d_body = legs.decode_body(body, legs.decode_params("kvferry", PATH, rid, 0, p, transfer_s))
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            with httpx.Client(timeout=60) as c:
                stream_ttft_ms(c, d.url, d_body, rid)
        except BaseException as exc:  # reported below: a failed D leg must not pass unnoticed
            errors.append(exc)

    leg = threading.Thread(target=decode)
    if push_beside:
        leg.start()
    took = answer_ms(client, p.url, p_body, rid)
    if not push_beside:
        leg.start()
    leg.join(60)
    if leg.is_alive() or errors:
        raise RuntimeError(f"decode's leg failed: {errors or 'no end within 60 s'}")
    return took


def router_metric(url: str, name: str) -> float:
    return metric_sum(parse_metrics(httpx.get(url + "/metrics", timeout=10).text), name)


def prompts(seed: int) -> Callable[[], list[int]]:
    rng = random.Random(seed)
    return lambda: [rng.randrange(300, 2000) for _ in range(1024)]  # ids the tokenizer has


def warm_up(stack: PdStack, max_tokens: int, seed: int) -> None:
    """Connections and the side-channel handshake, before anything is counted."""
    prompt = prompts(seed + 1)
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            stream_ttft_ms(client, stack.url, client_body(prompt(), max_tokens))
            legs_ms(stack, client, client_body(prompt(), max_tokens), push_beside=True)


def measure(stack: PdStack, rounds: int, max_tokens: int, gap_s: float, seed: int) -> dict[str, list[float]]:
    prompt = prompts(seed)
    out: dict[str, list[float]] = {w: [] for w in (*WAYS, "router-internal")}
    with httpx.Client(timeout=60) as client:
        for _ in range(rounds):
            for way in WAYS:
                body = client_body(prompt(), max_tokens)
                if way == "engine":
                    out[way].append(stream_ttft_ms(client, stack.prefill.url, body))
                elif way == "router":
                    before = router_metric(stack.url, "kvferry_router_ttft_seconds_sum")
                    out[way].append(stream_ttft_ms(client, stack.url, body))
                    out["router-internal"].append(
                        (router_metric(stack.url, "kvferry_router_ttft_seconds_sum") - before) * 1000
                    )
                else:
                    out[way].append(legs_ms(stack, client, body, push_beside=way == "prefill-with-push"))
                time.sleep(gap_s)
    return out


def report(samples: dict[str, list[float]], early: float, command: str) -> str:
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    lines = [
        "# P/D first-token breakdown", "", f"Command: `{command}`", "",
        "| way | TTFT p50 ms | p10 | p90 |", "|---|---|---|---|",
    ]  # fmt: skip
    lines += [f"| {k} | {p50[k]:.1f} | {q(v, 0.1):.1f} | {q(v, 0.9):.1f} |" for k, v in samples.items()]
    d = lambda a, b: p50[a] - p50[b]  # noqa: E731
    parts = [
        ("P's answer: push beside it (with-push - alone)", d("prefill-with-push", "prefill-alone")),
        ("P's producer leg over a plain request (alone - engine)", d("prefill-alone", "engine")),
        ("the router's own share (router-internal - with-push)", d("router-internal", "prefill-with-push")),
        ("the client's hop to the router (router - router-internal)", d("router", "router-internal")),
        ("P/D overhead over one engine (router - engine)", d("router", "engine")),
    ]  # fmt: skip
    lines += ["", "| part (p50 differences) | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:+.1f} |" for name, ms in parts]
    lines += ["", f"Streams that started with prefill's token: {early:.0f} of {len(samples['router'])}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between requests (all idle)")
    parser.add_argument("--first-token", choices=("decode", "prefill"), default="prefill")
    parser.add_argument("--seed", type=int, default=0)
    add_placement_arguments(parser)
    parser.add_argument(
        "--connector", type=json.loads, default={}, help="JSON: kv_connector_extra_config overrides"
    )
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = parser.parse_args()
    router = {"streaming": {"first_token": args.first_token}}
    with tempfile.TemporaryDirectory(prefix="pd-breakdown-") as tmp:
        stack = PdStack(
            "kvferry",
            ensure("llama"),
            Path(tmp),
            router_extra=router,
            kvferry_extra=args.connector,
            pin_whole=args.pin == "whole",
            load_cores=LOAD_ON[args.load_on],
        ).start()
        try:
            name = "kvferry_router_first_token_from_prefill_total"
            warm_up(stack, args.max_tokens, args.seed)
            before = router_metric(stack.url, name)
            with stack.client_here():
                samples = measure(stack, args.rounds, args.max_tokens, args.gap, args.seed)
            early = router_metric(stack.url, name) - before
        finally:
            stack.stop()
    text = report(samples, early, "python " + " ".join(sys.argv))
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"samples": samples, "early": early}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
