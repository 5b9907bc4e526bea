"""A synthesised P/D service for the planner's trace tests: load in, the Window the engines would show out.

Each role is an M/M/1-like server per pod: latency = base / (1 - utilisation) below saturation; at or
above it the queue grows and latency is far over any target. Prefill's load is prompt tokens per
second, decode's is output tokens per second (concurrent sequences). New pods become ready after
`ready_after` evaluations, as pods loading a model do. Noise multiplies each latency reading.
Prefill's busy fraction is its utilisation per ready pod (at most 1), as vLLM's prefill-time sum shows it
(`export_busy=False`: an engine that does not export it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvferry.operator.autoscale.planner import History, Plan, plan
from kvferry.operator.autoscale.signals import Window
from kvferry.operator.spec.autoscaling import Autoscaling

SATURATED = 30.0  # latency multiple reported once a role is past its capacity


@dataclass
class Load:
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int


@dataclass
class Service:
    spec: Autoscaling
    prefill_tokens_per_s: float = 4000.0  # one prefill pod's prompt-token capacity
    decode_tokens_per_s: float = 400.0  # one decode pod's output-token capacity
    ttft_base: float = 0.2
    itl_base: float = 0.02
    ready_after: int = 2  # evaluations a new pod needs before it serves
    noise: float = 0.0
    interval: float = 15.0
    export_busy: bool = True
    replicas: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    starting: dict[str, list[int]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    history: History = field(default_factory=History)
    now: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    log: list[tuple[Window, Plan]] = field(default_factory=list)

    def ready(self) -> dict[str, int]:
        return {r: self.replicas[r] - len(self.starting[r]) for r in self.replicas}

    def _latency(self, base: float, load: float, capacity: float) -> tuple[float, float]:
        """(latency, waiting requests) of a role serving `load` with `capacity`."""
        u = load / capacity if capacity else float("inf")
        if u >= 1:
            return base * SATURATED, 10.0 * u
        return base / (1 - u) * (1 + self.rng.uniform(-self.noise, self.noise)), 0.0

    def window(self, load: Load) -> Window:
        ready = self.ready()
        ttft, p_wait = self._latency(
            self.ttft_base, load.rate * load.prompt_tokens, ready["prefill"] * self.prefill_tokens_per_s
        )
        itl, d_wait = self._latency(
            self.itl_base, load.rate * load.output_tokens, ready["decode"] * self.decode_tokens_per_s
        )
        requests = int(load.rate * self.interval)
        busy = requests > 0
        prefill_capacity = ready["prefill"] * self.prefill_tokens_per_s
        utilisation = load.rate * load.prompt_tokens / prefill_capacity if prefill_capacity else 1.0
        return Window(
            ttft=ttft if requests >= 3 else None,
            itl=itl if requests >= 3 else None,
            requests=requests,
            tokens=requests * load.output_tokens,
            prefill_waiting=p_wait,
            decode_waiting=d_wait,
            prefill_running=float(busy),
            decode_running=float(busy),
            compared=ready["decode"],
            prefill_busy=min(utilisation, 1.0) if self.export_busy else None,
        )

    def step(self, load: Load) -> Plan:
        for role in self.starting:  # pods started earlier finish loading
            self.starting[role] = [t - 1 for t in self.starting[role] if t > 1]
        w = self.window(load)
        result = plan(self.spec, w, dict(self.replicas), self.ready(), self.history, self.now)
        self.history = result.history
        for d in result.decisions():
            if d.desired > d.current:
                self.starting[d.role] += [self.ready_after] * (d.desired - d.current)
            elif d.desired < d.current:
                self.starting[d.role] = self.starting[d.role][: max(0, d.desired - self.ready()[d.role])]
            self.replicas[d.role] = d.desired
        self.log.append((w, result))
        self.now += self.interval
        return result

    def run(self, load: Load, steps: int) -> list[Plan]:
        return [self.step(load) for _ in range(steps)]
