"""Endpoint step: the one thread that owns the transport and runs the protocol cores on it.

Callers (vLLM's worker main thread, the demo, tests) only enqueue commands and take results, both
non-blocking. The thread: drains commands, reads notifications, checks write handles, ticks the
cores, and carries out their actions. It waits on an event between rounds for as long as what is
pending allows (pacing.py: from 0.2 ms while a WRITE is in flight to `idle_tick_s` with nothing
pending, so an engine with no transfers shares its core with no one). While requests are pending,
the vLLM glue also `kick()`s a round at every engine step: without a UCX progress thread a WRITE and
its notification advance only when an agent is polled. A consumer's glue instead runs a round and
waits for it (`round_now`, config `consumer_rounds: step`): the step takes what the round found, and
the thread's own polls back off to a backstop while steps keep coming (pacing.py).

This module is the thread shell: commands and results, start and close, the round and its pacing.
What a round does with the transport lives in the side `_setup` creates for the role once the agent
exists (serving.py, with producing.py or consuming.py), where transport, notifier and core are
always there rather than Optional state of a thread that may not have started.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from kvferry.connector import actions as A
from kvferry.connector import protocol as P
from kvferry.connector import sideauth
from kvferry.connector.config import KvferryConfig
from kvferry.connector.consuming import ConsumerSide
from kvferry.connector.identity import tokens_digest
from kvferry.connector.layout import KVLayout
from kvferry.connector.metrics import Metrics
from kvferry.connector.notify import Notifier, Receive
from kvferry.connector.pacing import Load, Usage, next_wait
from kvferry.connector.peers import Peers
from kvferry.connector.preflight import backend_checks, efa_checks
from kvferry.connector.preflight import record as record_checks
from kvferry.connector.producing import ProducerSide
from kvferry.connector.results import Results
from kvferry.connector.serving import Live, Refusals, Serving
from kvferry.connector.sidechannel import SideChannelServer
from kvferry.connector.transport import NixlTransport
from kvferry.connector.wire import PeerInfo, encode, layout_to_wire
from kvferry.connector.writes import InFlight, StuckWrite

log = logging.getLogger(__name__)
Key = A.Key
__all__ = ["Endpoint", "Key", "Results"]  # Results: from results.py, where the sides fill them in
PRUNE_EVERY_S = 5.0
CONTACT_WINDOW_S = 5.0  # after a peer fetched our metadata, poll while it connects (UCX wire-up)
FULL_ROUND_S = 0.005  # a round with nothing new skips the core's timers if a full round ran this recently
DRIVEN_FOR_S = 0.05  # a consumer polls on its own again once no engine step ran a round for this long


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (`top -H`, /proc/<pid>/task/*/comm), so its CPU
    is told apart from vLLM's worker thread; Linux only, best effort."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class Endpoint:
    def __init__(
        self,
        cfg: KvferryConfig,
        *,
        role: str,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        layout: KVLayout,
        metrics: Metrics | None = None,
        model_digest: str = "",
    ) -> None:
        """`model_digest`: identity.model_digest of this engine's weights and tokenizer; a consumer
        sends it in every registration, a producer refuses registrations of another."""
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be producer or consumer, got {role!r}")
        self.cfg, self.role, self.engine_id = cfg, role, engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layout, self.metrics = layout, metrics or Metrics()
        self.incarnation = uuid.uuid4().hex[:8]
        self.agent_name = f"{engine_id}/{tp_rank}/{self.incarnation}"
        limits = P.Limits(
            lease_s=cfg.lease_s,
            registration_ttl_s=cfg.registration_ttl_s,
            early_notice_ttl_s=cfg.registration_ttl_s,
            max_entries=cfg.max_entries,
            grace_s=cfg.grace_s,
            max_early_notices=2 * cfg.max_entries,
        )
        self.model_digest = model_digest
        shape = {"total_heads": layout.total_heads, "rank": tp_rank, "tp_size": tp_size}
        self.producer: P.ProducerCore | None = None
        self.consumer: P.ConsumerCore | None = None
        if role == "producer":
            self.producer = P.ProducerCore(**shape, limits=limits, identity=model_digest)
        else:
            self.consumer = P.ConsumerCore(**shape, limits=limits)
        self._commands: queue.SimpleQueue[tuple[Callable[[float], list[A.Action]], Key]] = queue.SimpleQueue()
        self.dead: str = ""  # why the endpoint thread stopped serving ("" while it serves)
        self._wake, self._stop, self._ready = threading.Event(), threading.Event(), threading.Event()
        self._results, self._results_cv = Results(), threading.Condition()
        # round_now(): rounds begun and ended, and when an engine step last asked for one
        self._round_cv, self._rounds_begun, self._rounds_ended = threading.Condition(), 0, 0
        self._stepped_at = -DRIVEN_FOR_S
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvferry-{role}-{tp_rank}", daemon=True)
        self.auth = sideauth.load()  # the CR's transfer token (mode none without the operator)
        self.metrics.record("transfer_auth", 1, self.auth.mode)
        self.peers = Peers(cfg, self.metrics, self._wake.set, self.auth, self.agent_name)
        self.writes = InFlight()
        self._fenced = False  # a stuck WRITE: never drive this agent again (writes.py)
        self._contact_until = 0.0  # a peer is connecting until then (set by the side-channel thread)
        self._last_pending: dict[str, int] = {}
        self.recent = self.writes.recent  # completed WRITEs (benchmark, debugging)
        self._recv: dict[Key, Receive] = {}  # consumer: receives its core accepted (consuming.py)
        self.transport: NixlTransport | None = None  # created on the thread (`_setup`), kept for tools
        self.side: SideChannelServer | None = None
        self._next_prune = 0.0
        self._next_full_round = 0.0

    # ---- lifecycle (caller thread) ----
    def start(self, timeout_s: float = 60.0) -> Endpoint:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"kvferry endpoint {self.agent_name} did not start within {timeout_s}s")
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self.peers.close()

    @property
    def side_port(self) -> int:
        assert self.side is not None
        return int(self.side.address[1])

    # ---- producer API (any thread, non-blocking) ----
    def prefill_finished(
        self,
        request_id: str,
        attempt: int,
        block_ids: list[list[int]],
        num_tokens: int,
        consumer_engine: str,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """`token_ids`: the prompt's (at least num_tokens), which the consumer's digest must match."""
        key = (request_id, attempt)
        ids = tuple(token_ids) if token_ids is not None else None
        self._submit(
            lambda now: self._producer().prefill_finished(
                key, block_ids, num_tokens, consumer_engine, now, ids
            ),
            key,
        )

    def prefill_aborted(self, request_id: str, attempt: int) -> None:
        self._submit(
            lambda now: self._producer().prefill_aborted((request_id, attempt), now), (request_id, attempt)
        )

    # ---- consumer API ----
    def expect(
        self,
        request_id: str,
        attempt: int,
        *,
        producer_engine: str,
        producer_host: str,
        producer_port: int,
        producer_tp: int,
        block_ids: list[list[int]],
        num_tokens: int,
        deadline_s: float | None = None,
        first_token: int = 0,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Receive tokens [first_token, num_tokens) into `block_ids` (per group, the blocks from the
        one holding `first_token`, which starts a block: this rank already holds the tokens before it).
        `token_ids`: the prompt's (at least num_tokens); their digest goes in the registration."""
        key = (request_id, attempt)
        deadline = deadline_s if deadline_s is not None else self.cfg.deadline_s

        def run(now: float) -> list[A.Action]:
            if not 0 <= first_token < num_tokens or first_token % self.layout.block_size:
                raise ValueError(
                    f"tokens [{first_token}, {num_tokens}) do not start on a "
                    f"{self.layout.block_size}-token block of this rank"
                )
            digest_of = tokens_digest(token_ids, num_tokens)  # validated before any state changes
            out = self._consumer().expect(key, producer_engine, producer_tp, deadline, now)
            if any(isinstance(a, A.Register) for a in out):  # accepted: its actions need these
                self._recv[key] = (
                    producer_host, producer_port, block_ids, first_token, num_tokens, producer_tp, digest_of
                )  # fmt: skip
            return out

        self._submit(run, key)

    def abort(self, request_id: str, attempt: int) -> None:
        self._submit(lambda now: self._consumer().abort((request_id, attempt), now), (request_id, attempt))

    def kick(self) -> None:
        """Run a round now (non-blocking; several kicks before the round make one round)."""
        self._wake.set()

    @property
    def rounds_run(self) -> int:
        """Rounds this thread has run so far (exact, where the metric is flushed once a second)."""
        return self._rounds_ended

    def round_now(self, timeout_s: float) -> bool:
        """Run a round now and wait, at most `timeout_s`, until one that began after this call ended;
        False if none did in time (its results then come with a later take). The caller's step then
        takes what that round found, and while steps keep asking, the thread polls on its own only
        as a backstop (pacing.py, `driven`)."""
        with self._round_cv:
            self._stepped_at = time.monotonic()
            want = self._rounds_begun + 1
            self._wake.set()
            return self._round_cv.wait_for(lambda: self._rounds_ended >= want, timeout_s)

    # ---- results ----
    def take_results(self) -> Results:
        with self._results_cv:
            out, self._results = self._results, Results()
        return out

    def wait_results(self, timeout_s: float) -> Results:
        """Block until something finished or the timeout passed (demo and tests; vLLM polls instead)."""
        with self._results_cv:
            self._results_cv.wait_for(lambda: bool(self._results), timeout=timeout_s)
        return self.take_results()

    def _producer(self) -> P.ProducerCore:
        if self.producer is None:  # raised in the command: the request fails, the thread serves on
            raise ValueError(f"a {self.role} endpoint has no prefills")
        return self.producer

    def _consumer(self) -> P.ConsumerCore:
        if self.consumer is None:
            raise ValueError(f"a {self.role} endpoint receives nothing")
        return self.consumer

    def _submit(self, command: Callable[[float], list[A.Action]], key: Key) -> None:
        self._commands.put((command, key))
        self._wake.set()

    def _publish(self, fn: Callable[[Results], None]) -> None:
        with self._results_cv:
            fn(self._results)
            self._results_cv.notify_all()

    # ---- the endpoint thread ----
    def _run(self) -> None:
        _name_os_thread(self._thread.name)
        try:
            side = self._setup()
        except BaseException as exc:  # reported to start(), which raises it in the caller
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        interval = self.cfg.poll_min_s
        try:
            self._serve(side, interval)
        except StuckWrite as exc:  # the engine must fail and restart: only that ends the WRITE
            self._fenced = True
            self.dead = f"StuckWrite: {exc}"
            self.metrics.record("failures", 1, self.role, "write_stuck")
            log.error("kvferry endpoint %s fenced: %s", self.agent_name, exc)
        except BaseException as exc:  # a bug: say so loudly; the vLLM glue turns it into an engine error
            self.dead = f"{type(exc).__name__}: {exc}"
            log.exception("kvferry endpoint %s stopped serving", self.agent_name)
        finally:
            self._teardown()

    def _serve(self, side: Serving, interval: float) -> None:
        usage = Usage(self.metrics, self.role)
        while not self._stop.is_set():
            with self._round_cv:
                self._rounds_begun += 1
                begun = self._rounds_begun
            active = self._round(side)
            with self._round_cv:
                self._rounds_ended = begun
                self._round_cv.notify_all()
            usage.round()
            interval = next_wait(self.cfg, self._load(active), interval)
            self._wake.wait(interval)
            self._wake.clear()

    def _setup(self) -> Serving:
        if self.layout.memory == "VRAM":  # NIXL/UCX need the KV's CUDA context current on this thread
            import torch

            torch.cuda.set_device(self.layout.device_id)
        self.transport = transport = NixlTransport(self.agent_name, self.cfg)
        # The start-up preflight, from what this agent really created (kvferry_preflight_ok).
        wanted: list[str] = list(self.cfg.backends)
        checks = backend_checks(transport.backends, wanted) + efa_checks(wanted)
        record_checks(checks, self.metrics)
        for c in checks:
            if not c.ok:
                log.warning("kvferry preflight: %s: %s", c.name, c.detail)
        transport.register(self.layout)
        info = PeerInfo(
            self.engine_id, self.agent_name, transport.metadata(), self.tp_rank, self.tp_size,
            self.incarnation, layout_to_wire(self.layout), self.layout.fingerprint,
        )  # fmt: skip
        port = self.cfg.side_channel_port + self.tp_rank if self.cfg.side_channel_port else 0  # 0: any port
        self.side = SideChannelServer(
            self.cfg.side_channel_host, port, encode(info), on_contact=self._contacted, auth=self.auth,
            on_auth_failure=lambda reason: self.metrics.record("side_auth_failures", 1, reason),
        )  # fmt: skip
        refusals = Refusals(transport, self.layout)
        notifier = Notifier(
            self.cfg, transport, self.peers, self.metrics, me=info, side_port=self.side_port,
            role=self.role, refusal=refusals.of_producer, model_digest=self.model_digest,
        )  # fmt: skip
        live = Live(
            self.cfg, self.engine_id, self.tp_rank, self.layout, self.metrics, self.peers, self.writes,
            transport, notifier, refusals, self._publish,
        )  # fmt: skip
        if self.producer is not None:
            return ProducerSide(live, self.producer)
        return ConsumerSide(live, self._consumer(), self._recv)

    def _teardown(self) -> None:
        if self._fenced:
            # Neither the agent nor its side channel is touched: a consumer holding blocks for our
            # stuck WRITE reads "nothing listens there" as "its producer is gone", which is only
            # true once this process (and with it the agent and the WRITE) has ended.
            return
        if self.transport is not None:
            self.writes.release_all(self.transport)
            self.transport.close()
        if self.side is not None:  # after the agent, for the same reason
            self.side.close()

    def _contacted(self) -> None:
        self._contact_until = time.monotonic() + CONTACT_WINDOW_S
        self._wake.set()

    def _load(self, active: bool) -> Load:
        return Load(
            active=active,
            writing=bool(self.writes),
            receiving=bool(self.peers.fetching or (self.consumer and self.consumer.expected)),
            pending=any(self._last_pending.values()),  # this round's, handshakes included
            connecting=time.monotonic() < self._contact_until,
            driven=self._driven(),
        )

    def _driven(self) -> bool:
        """A consumer whose engine steps run its rounds (round_now) lately, with no handshake under way
        (a metadata fetch completes on this thread's polls, not on steps)."""
        if self.role != "consumer" or self.cfg.consumer_rounds != "step" or self.peers.fetching:
            return False
        return time.monotonic() - self._stepped_at < DRIVEN_FOR_S

    def _round(self, side: Serving) -> bool:
        now = time.monotonic()
        actions, came_in = self._commands_in(side, now)
        active = bool(actions)
        actions += side.read_notifs(now)
        quiet = not (came_in or actions or self.writes or self.peers.fetching)
        if quiet and now < self._next_full_round:
            # Nothing came in and nothing is in flight: a poll (most rounds of a busy decode). Timers,
            # pending counts and pruning wait for the next full round, at most FULL_ROUND_S away.
            return False
        self._next_full_round = now + FULL_ROUND_S
        actions += side.check_writes(now)
        active |= self.peers.finish(side.transport)
        actions += side.tick(now)
        if now >= self._next_prune:  # pods come and go: unload agents nobody uses
            self._next_prune = now + PRUNE_EVERY_S
            side.refusals.forget(self.peers.prune(side.transport, self.writes.agents(), now))
        side.carry_out(actions, now)
        self._journal({**side.pending(), "handshakes": self.peers.fetching})
        return active or bool(actions)

    def _commands_in(self, side: Serving, now: float) -> tuple[list[A.Action], bool]:
        """Run every queued command: their actions, and whether any came in."""
        actions: list[A.Action] = []
        came_in = False
        while True:
            try:
                command, key = self._commands.get_nowait()
            except queue.Empty:
                return actions, came_in
            came_in = True
            try:
                actions += command(now)
            except Exception as exc:  # one request's bad input fails that request, never the thread
                side.fail_key(key, f"rejected: {exc}")

    def _journal(self, pending: dict[str, int]) -> None:
        if pending != self._last_pending:  # journal changes only: rounds run hundreds of times a second
            for kind, n in pending.items():
                self.metrics.record("pending", n, self.role, kind, str(self.tp_rank))
            self._last_pending = pending
