"""Traffic step: a steady stream of greedy completions through the router, counted as it goes.

Prompts mix short and long (hundreds of tokens, several KV blocks) so every request needs a real
transfer. Each request has a deadline; a failure is counted with its reason, never retried here (the
router owns retries), so the numbers say what a client saw.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 60.0
WORDS = (
    "ferry",
    "harbor",
    "tide",
    "cargo",
    "engine",
    "signal",
    "decode",
    "prefill",
    "block",
    "cache",
    "river",
    "lantern",
    "quiet",
    "morning",
    "north",
    "bridge",
    "copper",
    "window",
    "garden",
    "number",
    "simple",
    "vector",
    "lattice",
    "kernel",
    "pulse",
)


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def fixed_prompts(n: int = 6, seed: int = 7) -> list[str]:
    """Deterministic prompts of growing length, for comparing outputs between setups."""
    rng = random.Random(seed)
    return [prompt(rng, 8 + 60 * i) for i in range(n)]


def complete(client: httpx.Client, url: str, text: str, max_tokens: int = 16) -> dict[str, Any]:
    """One greedy completion; raises httpx errors and HTTP status errors to the caller."""
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    resp = client.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    resp.raise_for_status()
    return resp.json()


def greedy_texts(url: str, prompts: list[str], max_tokens: int = 16) -> list[str]:
    with httpx.Client() as client:
        return [complete(client, url, p, max_tokens)["choices"][0]["text"] for p in prompts]


@dataclass
class Counters:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    last_error: str = ""
    latencies_s: list[float] = field(default_factory=list)

    def p50_ms(self) -> float | None:
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s[-200:])
        return 1000 * ordered[len(ordered) // 2]


class RequestStream:
    """Sends requests back to back (with `gap_s` between) until stopped; `url` may change live."""

    def __init__(self, url: str, gap_s: float = 0.5, max_tokens: int = 16, seed: int = 1) -> None:
        self.url, self.gap_s, self.max_tokens = url, gap_s, max_tokens
        self.counters = Counters()
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S + 5)

    def snapshot(self) -> Counters:
        with self._lock:
            c = self.counters
            return Counters(c.sent, c.ok, c.failed, c.last_error, list(c.latencies_s))

    def _run(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                text = prompt(self._rng, self._rng.choice((10, 80, 300)))
                t0 = time.monotonic()
                with self._lock:
                    self.counters.sent += 1
                try:
                    complete(client, self.url, text, self.max_tokens)
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.counters.failed += 1
                        self.counters.last_error = f"{type(exc).__name__}: {exc}"[:160]
                else:
                    with self._lock:
                        self.counters.ok += 1
                        self.counters.latencies_s.append(time.monotonic() - t0)
                self._stop.wait(self.gap_s)
