"""Which `kv_load_failure_policy` should decode run with? Measured side by side in one run.

When the KV of a request never reaches decode (here: forced, with a router whose `transfer_s` is far
shorter than any prefill, so every receive passes its deadline), decode either
- `fail`: reports an error before the first token, and the router recomputes the request on the
  other engine of the pair (a new leg: prefill and decode there), or
- `recompute`: computes the prompt itself and answers; the router sees a normal answer.
For each policy the bench starts a kvferry P/D pair, runs the same requests through a healthy router
and through the failing one, checks every answer against the healthy answers token by token, and
prints latency percentiles and the failed/healthy ratio per policy, plus recompute-on-D vs
recompute-via-router.

    python bench/load_failure_policy.py --requests 12 --prompt 700 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.tinymodel import ensure
from kvferry.tools.pdstack import PdStack, RouterProcess
from kvferry.tools.stats import percentile

POLICIES = ("fail", "recompute")


def prompt(length: int, i: int) -> list[int]:
    return [10 + (j * 7919 + i * 31 + length) % 2000 for j in range(length)]


def run_requests(url: str, n: int, length: int, max_tokens: int, decode: Any = None) -> list[dict[str, Any]]:
    """Sequential completions: latency, status, recompute header, token ids, and (with `decode`)
    whether this request's receive failed on D (its kvferry failure counter moved)."""
    out = []
    failures = lambda: metric_sum(decode.metrics(), "kvferry_transfer_failures_total") if decode else 0  # noqa: E731
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            body = {"model": "tiny", "prompt": prompt(length, i), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            before, t0 = failures(), time.perf_counter()
            resp = client.post(url + "/v1/completions", json=body)
            took = time.perf_counter() - t0
            time.sleep(0.3)  # D's counter reaches /metrics with the next engine step
            ids = resp.json()["choices"][0].get("token_ids") if resp.status_code == 200 else None
            out.append({"s": took, "status": resp.status_code, "ids": ids, "load_failed": failures() > before,
                        "recomputed": resp.headers.get("X-Kvferry-Recomputed", "")})  # fmt: skip
    return out


def measure(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    stack = PdStack("kvferry", ensure("llama"), workdir / policy, load_failure_policy=policy)
    failing = None
    try:
        stack.start()
        healthy = run_requests(stack.url, args.requests, args.prompt, args.max_tokens)
        cfg = {**stack.router_config(), "deadlines": {"transfer_s": 0.01, "total_s": 120}}
        fail_dir = workdir / policy / "failing"
        fail_dir.mkdir(parents=True, exist_ok=True)
        failing = RouterProcess(cfg, fail_dir).start()
        assert stack.decode is not None
        before = metric_sum(stack.decode.metrics(), "kvferry_transfer_failures_total", role="consumer")
        failed = run_requests(failing.url, args.requests, args.prompt, args.max_tokens, stack.decode)
        load_failures = metric_sum(stack.decode.metrics(), "kvferry_transfer_failures_total", role="consumer")
        router = parse_metrics(httpx.get(failing.url + "/metrics", timeout=10).text)
    finally:
        if failing is not None:
            failing.stop()
        stack.stop()
    wrong = sum(f["ids"] != h["ids"] for f, h in zip(failed, healthy, strict=True))
    pairs = [(f["s"], h["s"]) for f, h in zip(failed, healthy, strict=True) if f["load_failed"]]
    return {
        "policy": policy,
        "healthy_p50_s": percentile([r["s"] for r in healthy], 50),
        # only the requests whose transfer failed, against the same prompts' healthy latency
        "failed_p50_s": percentile([f for f, _ in pairs], 50),
        "failed_p90_s": percentile([f for f, _ in pairs], 90),
        "failed_over_healthy_p50": percentile([f / h for f, h in pairs], 50),
        "client_errors": sum(r["status"] != 200 for r in failed),
        "wrong_answers": wrong,
        "router_recomputes": metric_sum(router, "kvferry_router_recomputes_total"),
        "decode_load_failures": load_failures - before,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=700, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench/results/load_failure_policy.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvferry-lfp-") as tmp:
        rows = [measure(policy, args, Path(tmp)) for policy in POLICIES]
    print(f"{'policy':<10} {'healthy p50':>12} {'failed p50':>11} {'failed p90':>11} {'ratio':>6} "
          f"{'errors':>6} {'wrong':>5} {'router recomputes':>17} {'D load failures':>15}")  # fmt: skip
    for r in rows:
        ratio = r["failed_over_healthy_p50"]
        print(f"{r['policy']:<10} {r['healthy_p50_s']:>11.3f}s {r['failed_p50_s']:>10.3f}s "
              f"{r['failed_p90_s']:>10.3f}s {ratio:>6.2f} {r['client_errors']:>6} {r['wrong_answers']:>5} "
              f"{r['router_recomputes']:>17g} {r['decode_load_failures']:>15g}")  # fmt: skip
    by = {r["policy"]: r for r in rows}
    ratio = by["recompute"]["failed_p50_s"] / by["fail"]["failed_p50_s"]
    print(f"failed-transfer p50, recompute / fail: {ratio:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    bad = any(r["client_errors"] or r["wrong_answers"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
