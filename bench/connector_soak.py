"""Connector hostile-input soak: the protocol cores under a seeded mix of honest and hostile messages.

    python bench/connector_soak.py --requests 20000 --hostile 200000 --seed 1 \
        --out bench/results/connector_soak

One producer engine and one consumer engine (TP 2 each, 8 KV heads), one ProducerCore and one
ConsumerCore a rank, wired as endpoint.py wires them: each round delivers every message queued for
a rank in one batch (as transport.notifs() hands a round what arrived), then ticks every core, and
a WRITE completes in the round after it starts (its Done rides on it). Honest requests: decode
expects, registers with the ranks it shares heads with, prefill finishes with the prompt's token
ids. Hostile messages, interleaved with them (--hostile in all), as an admitted agent could send
them: registrations with a TP that does not divide the heads, ranks outside the TP, ranks sharing no
heads, keys nobody asked for (num_tokens 0, past their deadline), other tokens or weights, made-up
engines for live keys; floods of Done and Failure notices for made-up keys, ranks and reasons;
cancels for unknown keys; replays of honest messages.

Figures: crashes (an exception from a core), stalls (a round over --stall-s: what a round may take
before the engine step waiting on it is late), the slowest round, leaked entries (anything left in
any map once every clock has run out), honest requests received, refusals by reason, and the peak of
every bounded map. tests/unit/connector/test_connector_hostile_soak.py runs the short form in CI.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvferry.connector.actions import Failed, Received, Register, Reject, SendCancel, SendFailure, StartWrite
from kvferry.connector.identity import model_digest, tokens_digest
from kvferry.connector.layout import overlapping_ranks
from kvferry.connector.protocol import ConsumerCore, Limits, ProducerCore
from kvferry.connector.wire import Cancel, Done, Failure, Registration

HEADS, TP, TOKENS = 8, 2, 64
P, D, X = "prefill-0", "decode-0", "rogue-0"
MODEL = model_digest({"model": "m", "dtype": "bfloat16"})
HOSTILE_KINDS = (
    "tp_not_dividing", "rank_outside", "no_shared_heads", "unknown_key", "other_tokens", "other_model",
    "made_up_engine", "notice_flood", "cancel_unknown", "replay",
)  # fmt: skip


@dataclass
class Figures:
    requests: int = 0
    hostile: int = 0
    rounds: int = 0
    crashes: int = 0
    stalls: int = 0
    slowest_round_ms: float = 0.0
    leaked: int = 0
    received: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    unverified_failures: int = 0  # Failures the endpoint would send only to an agent it knows
    peak: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class Soak:
    def __init__(self, seed: int, limits: Limits, stall_s: float) -> None:
        self.rng, self.limits, self.stall_s = random.Random(seed), limits, stall_s
        self.producers = [ProducerCore(total_heads=HEADS, rank=r, tp_size=TP, limits=limits, identity=MODEL)
                          for r in range(TP)]  # fmt: skip
        self.consumers = [
            ConsumerCore(total_heads=HEADS, rank=r, tp_size=TP, limits=limits) for r in range(TP)
        ]
        self.to_p: list[list[Registration | Cancel]] = [[] for _ in range(TP)]
        self.to_d: list[list[Done | Failure]] = [[] for _ in range(TP)]
        self.writes: list[tuple[int, StartWrite]] = []
        self.now, self.f = 0.0, Figures()
        self.waiting: set[tuple[int, tuple[str, int]]] = set()  # honest (consumer rank, key) not yet ended
        self.seen: list[Registration | Cancel | Done | Failure] = []  # for replays

    # ---- the two engines -------------------------------------------------------------------
    def request(self, i: int) -> None:
        key, prompt = (f"q{i}", 0), [self.rng.randrange(50_000) for _ in range(TOKENS)]
        self.waiting |= {(c, key) for c in range(TP)}
        self.f.requests += 1
        for c, core in enumerate(self.consumers):
            self.consumer_did(c, core.expect(key, P, TP, 30.0, self.now), prompt)
        for r, core in enumerate(self.producers):
            self.producer_did(r, core.prefill_finished(key, [[i % 997]], TOKENS, D, self.now, tuple(prompt)))

    def consumer_did(self, c: int, actions: list, prompt: list[int] | None = None) -> None:
        for a in actions:
            if isinstance(a, Register) and prompt is not None:
                for r in a.producer_ranks:
                    reg = Registration(*a.key, D, c, TP, "10.0.0.2", 5600 + c, "inc", TOKENS, [[1]], "", "",
                                       time.time() + 30, 0, tokens_digest(prompt, TOKENS), MODEL)  # fmt: skip
                    self.to_p[r].append(reg)
            elif isinstance(a, SendCancel):
                for r in a.producer_ranks:
                    self.to_p[r].append(Cancel(*a.key, D, c))
            elif isinstance(a, Received | Failed):
                if (c, a.key) not in self.waiting:
                    continue
                self.waiting.discard((c, a.key))
                if isinstance(a, Received):
                    self.f.received += 1
                else:
                    self.f.failed[a.reason] = self.f.failed.get(a.reason, 0) + 1
            elif isinstance(a, Reject):
                self.f.rejected[a.reason] = self.f.rejected.get(a.reason, 0) + 1

    def producer_did(self, r: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                self.writes.append((r, a))
            elif isinstance(a, SendFailure):
                if not a.verified:  # the endpoint sends it only to an agent already loaded: none here
                    self.f.unverified_failures += 1
                    continue
                reg = a.reg
                self.to_d[reg.consumer_rank % TP].append(Failure(reg.request_id, reg.attempt, P, r, a.reason))
            elif isinstance(a, Reject):
                self.f.rejected[a.reason] = self.f.rejected.get(a.reason, 0) + 1

    # ---- hostile messages --------------------------------------------------------------------
    def hostile(self, live: tuple[str, int]) -> None:
        self.f.hostile += 1
        kind, rng = self.rng.choice(HOSTILE_KINDS), self.rng
        r = rng.randrange(TP)

        def reg(key=live, engine=D, rank=0, tp=TP, tokens=TOKENS, digest="", model=MODEL, deadline=30.0):
            return Registration(*key, engine, rank, tp, f"10.9.{rng.randrange(256)}.{rng.randrange(256)}",
                                rng.randrange(65536), "inc", tokens, [[rng.randrange(1 << 20)]], "", "",
                                time.time() + deadline, 0, digest, model)  # fmt: skip

        unknown = (f"u{rng.randrange(1 << 30)}", rng.randrange(4))
        if kind == "tp_not_dividing":
            self.to_p[r].append(reg(tp=rng.choice([3, 5, 7, 12, 10_000])))
        elif kind == "rank_outside":
            self.to_p[r].append(reg(rank=TP + rng.randrange(1 << 20)))
        elif kind == "no_shared_heads":
            others = sorted(set(range(TP)) - set(overlapping_ranks(HEADS, r, TP, TP)))
            self.to_p[r].append(reg(rank=others[0] if others else 0))
        elif kind == "unknown_key":
            self.to_p[r].append(
                reg(key=unknown, tokens=rng.choice([0, TOKENS]), deadline=rng.choice([-1, 30]))
            )
        elif kind == "other_tokens":
            self.to_p[r].append(reg(key=unknown, digest="f" * 32))
        elif kind == "other_model":
            self.to_p[r].append(reg(key=unknown, model="0" * 32))
        elif kind == "made_up_engine":
            self.to_p[r].append(reg(engine=f"{X}-{rng.randrange(1 << 20)}"))
        elif kind == "notice_flood":
            for _ in range(64):
                key = (f"f{rng.randrange(1 << 30)}", 0) if rng.random() < 0.5 else unknown
                rank, why = rng.randrange(1 << 16), f"why-{rng.randrange(1 << 30)}"
                self.to_d[r].append(
                    Done(*key, P, rank) if rng.random() < 0.5 else Failure(*key, P, rank, why)
                )
        elif kind == "cancel_unknown":
            self.to_p[r].append(Cancel(*unknown, D, 0))
        elif self.seen:  # replay
            msg = rng.choice(self.seen)
            (self.to_p if isinstance(msg, Registration | Cancel) else self.to_d)[r].append(msg)  # type: ignore[arg-type]

    # ---- rounds ------------------------------------------------------------------------------
    def round(self) -> None:
        start = time.perf_counter()
        try:
            for r, core in enumerate(self.producers):
                batch, self.to_p[r] = self.to_p[r], []
                for m in batch:
                    if len(self.seen) < 256 and m.consumer_engine == D:
                        self.seen.append(m)
                    if isinstance(m, Registration):
                        out = core.registration(m, self.now, self.now + m.deadline_unix - time.time())
                    else:
                        key = (m.request_id, m.attempt)
                        out = core.cancel(key, m.consumer_engine, m.consumer_rank, self.now)
                    self.producer_did(r, out)
            writes, self.writes = self.writes, []
            for r, w in writes:  # each WRITE lands: its Done rides on it
                self.to_d[w.reg.consumer_rank].append(Done(*w.key, P, r))
                self.producer_did(
                    r, self.producers[r].write_finished(w.key, w.reg.consumer_rank, True, "", self.now)
                )
            for c, core in enumerate(self.consumers):
                batch, self.to_d[c] = self.to_d[c], []
                for n in batch:
                    self.consumer_did(c, core.notice(n, self.now))
            for r, core in enumerate(self.producers):
                self.producer_did(r, core.tick(self.now))
            for c, core in enumerate(self.consumers):
                self.consumer_did(c, core.tick(self.now))
        except Exception as exc:  # a crash: counted, and the soak goes on as the endpoint would
            self.f.crashes += 1
            print(f"crash in round {self.f.rounds}: {type(exc).__name__}: {exc}", file=sys.stderr)
        took = time.perf_counter() - start
        self.f.rounds += 1
        self.f.stalls += took > self.stall_s
        self.f.slowest_round_ms = max(self.f.slowest_round_ms, round(took * 1000, 2))
        for name, n in self.sizes().items():
            self.f.peak[name] = max(self.f.peak.get(name, 0), n)
        self.now += 0.01

    def sizes(self) -> dict[str, int]:
        p, c = self.producers, self.consumers
        return {
            "finished": max(len(x.finished) for x in p),
            "parked": max(len(x.parked) for x in p),
            "ended": max(len(x.ended) for x in p),
            "cancelled": max(len(x.cancelled) for x in p),
            "expected": max(len(x.expected) for x in c),
            "early_keys": max(len(x.early) for x in c),
            "early_notices": max(x.early_notices for x in c),
            "held": max(x.held for x in c),
        }


def soak(requests: int, hostile: int, seed: int = 1, per_round: int = 64, stall_s: float = 0.25,
         limits: Limits | None = None) -> Figures:  # fmt: skip
    """Run the soak; `per_round` messages (honest requests and hostile ones) enter each round."""
    s = Soak(seed, limits or Limits(max_entries=4096), stall_s)
    gc.collect()
    gc.freeze()  # as vLLM does once started: collections then scan only what the soak creates
    begin, live = time.perf_counter(), ("q0", 0)
    total = requests + hostile
    sent_r = sent_h = 0
    while sent_r + sent_h < total:
        for _ in range(per_round):
            if sent_r < requests and (sent_h >= hostile or s.rng.random() < requests / total):
                s.request(sent_r)
                live = (f"q{sent_r}", 0)
                sent_r += 1
            elif sent_h < hostile:
                s.hostile(live)
                sent_h += 1
        s.round()
    horizon = s.now + 2 * max(s.limits.lease_s, s.limits.registration_ttl_s, s.limits.early_notice_ttl_s) + 60
    while s.now < horizon:  # every clock runs out: whatever is left in a map has leaked
        s.round()
        s.now += 1.0
    s.f.leaked = sum(sum(x.pending().values()) for x in [*s.producers, *s.consumers])
    s.f.leaked += sum(x.early_notices for x in s.consumers)
    s.f.leaked += len(s.waiting)
    s.f.seconds = round(time.perf_counter() - begin, 2)
    return s.f


def report(f: Figures, args: argparse.Namespace) -> str:
    lines = [
        "# Connector hostile-input soak",
        "",
        f"`python bench/connector_soak.py --requests {args.requests} --hostile {args.hostile} "
        f"--seed {args.seed}` (pure cores, one process; stall bound {args.stall_s * 1000:g} ms a round)",
        "",
        "| requests | hostile | rounds | crashes | stalls | slowest round | leaked | received | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {f.requests} | {f.hostile} | {f.rounds} | {f.crashes} | {f.stalls} | {f.slowest_round_ms} ms | "
        f"{f.leaked} | {f.received} / {f.requests * TP} | {f.seconds} |",
        "",
        f"Refused by reason: {dict(sorted(f.rejected.items()))}",
        f"Failures not sent (unverified consumer): {f.unverified_failures}",
        f"Honest receives failed: {f.failed}",
        f"Peak map sizes: {f.peak}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--hostile", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stall-s", type=float, default=0.25)
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = parser.parse_args(argv)
    f = soak(args.requests, args.hostile, args.seed, stall_s=args.stall_s)
    text = report(f, args)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(asdict(f), indent=1) + "\n")
    return 0 if (f.crashes, f.stalls, f.leaked) == (0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
