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
from dataclasses import dataclass, field
from functools import partial

from kvferry.connector import actions as A
from kvferry.connector import protocol as P
from kvferry.connector import sideauth
from kvferry.connector.config import KvferryConfig
from kvferry.connector.identity import tokens_digest
from kvferry.connector.intake import admit
from kvferry.connector.kvcache import read_host
from kvferry.connector.layout import KVLayout, LayoutError, refusal
from kvferry.connector.metrics import Metrics, failure_reason
from kvferry.connector.notify import Notifier, Receive
from kvferry.connector.pacing import Load, Usage, next_wait
from kvferry.connector.peers import Peers
from kvferry.connector.preflight import backend_checks, efa_checks
from kvferry.connector.preflight import record as record_checks
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.sentinel import digest, sample_tokens, sampled, shared_heads
from kvferry.connector.sidechannel import SideChannelServer
from kvferry.connector.transport import NixlTransport
from kvferry.connector.wire import (
    Cancel,
    Done,
    Failure,
    PeerInfo,
    Registration,
    decode,
    encode,
    layout_to_wire,
)
from kvferry.connector.writes import InFlight, StuckWrite, Write
from kvferry.contracts.metrics import LAYOUT_MISMATCH, SAMPLE_MISMATCH

log = logging.getLogger(__name__)
Key = A.Key
PRUNE_EVERY_S = 5.0
CONTACT_WINDOW_S = 5.0  # after a peer fetched our metadata, poll while it connects (UCX wire-up)
FULL_ROUND_S = 0.005  # a round with nothing new skips the core's timers if a full round ran this recently
DRIVEN_FOR_S = 0.05  # a consumer polls on its own again once no engine step ran a round for this long


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (`top -H`, /proc/<pid>/task/*/comm), so its CPU
    is told apart from vLLM's worker thread; Linux only, best effort."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@dataclass
class Results:
    """What finished since the last take: keys with reasons."""

    sent: list[Key] = field(default_factory=list)  # producer: source blocks may be freed
    released: list[tuple[Key, str]] = field(default_factory=list)  # producer: freed without a full send
    received: list[Key] = field(default_factory=list)  # consumer: KV landed
    failed: list[tuple[Key, str]] = field(default_factory=list)  # consumer: KV will not land

    def __bool__(self) -> bool:
        return bool(self.sent or self.released or self.received or self.failed)


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
        core_args = dict(total_heads=layout.total_heads, rank=tp_rank, tp_size=tp_size, limits=limits)
        self.producer = P.ProducerCore(**core_args, identity=model_digest) if role == "producer" else None
        self.consumer = P.ConsumerCore(**core_args) if role == "consumer" else None
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
        self._recv: dict[Key, Receive] = {}  # consumer
        self.transport: NixlTransport | None = None
        self.side: SideChannelServer | None = None
        self.notifier: Notifier | None = None
        self._refused: set[str] = set()  # peer agents whose layout mismatch was logged
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
            lambda now: self.producer.prefill_finished(key, block_ids, num_tokens, consumer_engine, now, ids),
            key,
        )

    def prefill_aborted(self, request_id: str, attempt: int) -> None:
        self._submit(
            lambda now: self.producer.prefill_aborted((request_id, attempt), now), (request_id, attempt)
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
            out = self.consumer.expect(key, producer_engine, producer_tp, deadline, now)
            if any(isinstance(a, A.Register) for a in out):  # accepted: its actions need these
                self._recv[key] = (
                    producer_host, producer_port, block_ids, first_token, num_tokens, producer_tp, digest_of
                )  # fmt: skip
            return out

        self._submit(run, key)

    def abort(self, request_id: str, attempt: int) -> None:
        self._submit(lambda now: self.consumer.abort((request_id, attempt), now), (request_id, attempt))

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
            self._setup()
        except BaseException as exc:  # reported to start(), which raises it in the caller
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        interval = self.cfg.poll_min_s
        try:
            self._serve(interval)
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

    def _serve(self, interval: float) -> None:
        usage = Usage(self.metrics, self.role)
        while not self._stop.is_set():
            with self._round_cv:
                self._rounds_begun += 1
                begun = self._rounds_begun
            active = self._round()
            with self._round_cv:
                self._rounds_ended = begun
                self._round_cv.notify_all()
            usage.round()
            interval = next_wait(self.cfg, self._load(active), interval)
            self._wake.wait(interval)
            self._wake.clear()

    def _setup(self) -> None:
        if self.layout.memory == "VRAM":  # NIXL/UCX need the KV's CUDA context current on this thread
            import torch

            torch.cuda.set_device(self.layout.device_id)
        self.transport = NixlTransport(self.agent_name, self.cfg)
        # The start-up preflight, from what this agent really created (kvferry_preflight_ok).
        checks = backend_checks(self.transport.backends, self.cfg.backends) + efa_checks(self.cfg.backends)
        record_checks(checks, self.metrics)
        for c in checks:
            if not c.ok:
                log.warning("kvferry preflight: %s: %s", c.name, c.detail)
        self.transport.register(self.layout)
        info = PeerInfo(
            self.engine_id, self.agent_name, self.transport.metadata(), self.tp_rank, self.tp_size,
            self.incarnation, layout_to_wire(self.layout), self.layout.fingerprint,
        )  # fmt: skip
        port = self.cfg.side_channel_port + self.tp_rank if self.cfg.side_channel_port else 0  # 0: any port
        self.side = SideChannelServer(
            self.cfg.side_channel_host, port, encode(info), on_contact=self._contacted, auth=self.auth,
            on_auth_failure=lambda reason: self.metrics.record("side_auth_failures", 1, reason),
        )  # fmt: skip
        self.notifier = Notifier(
            self.cfg, self.transport, self.peers, self.metrics, me=info, side_port=self.side_port,
            role=self.role, refusal=partial(self._refusal, consumer_side=True),
            model_digest=self.model_digest,
        )  # fmt: skip

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

    def _round(self) -> bool:
        now = time.monotonic()
        actions: list[A.Action] = []
        came_in = False
        while True:
            try:
                command, key = self._commands.get_nowait()
            except queue.Empty:
                break
            came_in = True
            try:
                actions += command(now)
            except Exception as exc:  # one request's bad input fails that request, never the thread
                self._fail_key(key, f"rejected: {exc}")
        active = bool(actions)
        actions += self._read_notifs(now)
        quiet = not (came_in or actions or self.writes or self.peers.fetching)
        if quiet and now < self._next_full_round:
            # Nothing came in and nothing is in flight: a poll (most rounds of a busy decode). Timers,
            # pending counts and pruning wait for the next full round, at most FULL_ROUND_S away.
            return False
        self._next_full_round = now + FULL_ROUND_S
        actions += self._check_writes(now)
        active |= self.peers.finish(self.transport)
        core = self.producer or self.consumer
        actions += core.tick(now)
        if now >= self._next_prune:  # pods come and go: unload agents nobody uses
            self._next_prune = now + PRUNE_EVERY_S
            self._refused -= set(self.peers.prune(self.transport, self.writes.agents(), now))
        for action in actions:
            try:
                self._do(action, now)
            except Exception as exc:  # one action's failure settles its request, never the thread
                self._action_failed(action, exc, now)
        pending = {**core.pending(), "handshakes": self.peers.fetching}
        if pending != self._last_pending:  # journal changes only: rounds run hundreds of times a second
            for kind, n in pending.items():
                self.metrics.record("pending", n, self.role, kind, str(self.tp_rank))
            self._last_pending = pending
        return active or bool(actions)

    def _read_notifs(self, now: float) -> list[A.Action]:
        # The round's first call that drives NIXL's progress: a stuck WRITE fences the rank before it.
        self.writes.fence(time.monotonic())
        out: list[A.Action] = []
        for sender, messages in self.transport.notifs().items():
            for raw in messages:
                try:
                    out += self._on_message(sender, raw, now)
                except Exception as exc:  # e.g. a registration whose TP cannot split the heads
                    out.append(A.Reject("invalid", f"from {sender}: {type(exc).__name__}: {exc}"))
        return out

    def _action_failed(self, action: A.Action, exc: Exception, now: float) -> None:
        log.exception("kvferry %s: %s failed", self.role, type(action).__name__)
        key = getattr(action, "key", None)
        if isinstance(action, A.StartWrite):
            self._feed(
                self.producer.write_finished(key, action.reg.consumer_rank, False, "write_failed", now), now
            )
        elif key is not None:
            self._fail_key(key, f"{type(exc).__name__}: {exc}")

    def _fail_key(self, key: Key, why: str) -> None:
        """Settle a request whose command could not be carried out: the caller gets an answer."""
        log_limited(
            log, logging.WARNING, "rejected", "kvferry %s: request %s failed: %s", self.role, key, why
        )
        self.metrics.record("failures", 1, self.role, "rejected")
        self._recv.pop(key, None)
        if self.role == "consumer":
            self._publish(lambda r: r.failed.append((key, "rejected")))
        else:
            self._publish(lambda r: r.released.append((key, "rejected")))

    def _on_message(self, sender_agent: str, raw: bytes, now: float) -> list[A.Action]:
        msg = admit(raw, sender_agent, self.role, self.cfg.revision)
        if isinstance(msg, A.Reject):
            if msg.reason == "wrong_revision" and self.role == "producer":
                self._refuse_other_revision(sender_agent, raw)
            return [msg]
        if isinstance(msg, Registration):
            # Wall clock across hosts (NTP-synced; the consumer's grace_s covers the skew), ours after.
            return self.producer.registration(msg, now, now + msg.deadline_unix - time.time())
        if isinstance(msg, Cancel):
            key = (msg.request_id, msg.attempt)
            out = self.producer.cancel(key, msg.consumer_engine, msg.consumer_rank, now)
            if any(isinstance(a, A.NothingInFlight) for a in out):
                # to the canceller's agent only (intake bound its rank to that agent's name)
                answer = Failure(*key, self.engine_id, self.tp_rank, "cancelled", self.cfg.revision)
                self.notifier.send(sender_agent, encode(answer), "")
            return [a for a in out if not isinstance(a, A.NothingInFlight)]
        if isinstance(msg, Done) and msg.sample and not self._sample_holds(msg):
            msg = Failure(msg.request_id, msg.attempt, msg.producer_engine, msg.producer_rank,
                          SAMPLE_MISMATCH, msg.revision)  # fmt: skip
        return self.consumer.notice(msg, now)

    def _refuse_other_revision(self, sender_agent: str, raw: bytes) -> None:
        """A consumer of another revision never gets KV from us, but always an answer: it holds its
        blocks until each producer rank answered or is gone. Unverified peers are reached only the
        bounded way (notify.py: a known agent, or one suspect handshake at a time)."""
        msg = decode(raw)  # admit() decoded it already: well-formed, bound to its sender's name
        if isinstance(msg, Registration):
            self.notifier.failure(msg, "wrong_revision", verified=False)
        elif isinstance(msg, Cancel):
            answer = Failure(msg.request_id, msg.attempt, self.engine_id, self.tp_rank, "wrong_revision",
                             self.cfg.revision)  # fmt: skip
            self.notifier.send(sender_agent, encode(answer), "")

    def _sample_holds(self, done: Done) -> bool:
        """Consumer: the sampled tokens' KV in our blocks is what the producer digested (sentinel.py)."""
        info = self._recv.get((done.request_id, done.attempt))
        if info is None:  # not expected (the core rejects it) or already settled
            return True
        _, _, blocks, first_token, num_tokens, producer_tp, _ = info
        tokens = sample_tokens(self.layout, done.request_id, done.attempt, first_token, num_tokens)
        heads = shared_heads(self.layout, done.producer_rank, producer_tp)
        try:
            ours = digest(self.layout, blocks, first_token, tokens, heads, read_host)
        except (LayoutError, ValueError):
            ours = "unreadable"
        ok = ours == done.sample
        self.metrics.record("sentinel", 1, "ok" if ok else "mismatch")
        if not ok:
            log_limited(log, logging.ERROR, "sample_mismatch",
                        "kvferry: KV of %s from %s rank %d is not what it sent (sampled tokens %s): "
                        "failing the receive", (done.request_id, done.attempt), done.producer_engine,
                        done.producer_rank, tokens)  # fmt: skip
        return ok

    def _sample_sent(self, key: Key, blocks: list[list[int]], reg: Registration) -> str:
        """Producer: the digest a sampled request's Done carries ("" when not sampled)."""
        if not sampled(key[0], key[1], self.cfg.sentinel_every):
            return ""
        tokens = sample_tokens(self.layout, key[0], key[1], reg.first_token, reg.num_tokens)
        heads = shared_heads(self.layout, reg.consumer_rank, reg.consumer_tp)
        try:
            return digest(self.layout, blocks, 0, tokens, heads, read_host)
        except (LayoutError, ValueError):
            return ""  # the mapping refuses the same blocks with its own reason

    def _check_writes(self, now: float) -> list[A.Action]:
        out: list[A.Action] = []
        for o in self.writes.check(self.transport, now):
            w = o.write
            if o.ok:
                self.metrics.record("bytes", w.plan.nbytes, self.role, self.transport.backend)
                self.metrics.record("pushed_tokens", w.plan.tokens)
                self.metrics.record("pushed_blocks", w.plan.blocks)
                self.metrics.record("match_to_done", now - w.started)
                self.metrics.record("transfers", 1, self.role)
            out += self.producer.write_finished(w.key, w.rank, o.ok, o.reason, now)
        return out

    # ---- actions ----
    def _do(self, action: A.Action, now: float) -> None:
        if isinstance(action, A.StartWrite):
            self.metrics.record("reg_to_match", action.registration_to_match_s)
            reg = action.reg
            self.peers.with_peer(
                reg.consumer_host,
                reg.consumer_port,
                reg.consumer_engine,
                reg.incarnation,
                lambda agent, err: self._start_write(action, agent, err),
            )
        elif isinstance(action, A.SendFailure):
            self.notifier.failure(action.reg, action.reason, action.verified)
        elif isinstance(action, A.Release):
            self._publish(
                lambda r: (
                    r.sent.append(action.key)
                    if action.reason == "sent"
                    else r.released.append((action.key, action.reason))
                )
            )
        elif isinstance(action, A.Register | A.SendCancel):
            self._to_producers(action, now)
        elif isinstance(action, A.ProbeProducers):
            self._probe_producers(action)
        elif isinstance(action, A.Received):
            self._recv.pop(action.key, None)
            self.metrics.record("transfers", 1, self.role)
            self.metrics.record("receive_wait", action.wait_s)
            self._publish(lambda r: r.received.append(action.key))
        elif isinstance(action, A.Failed):
            self._recv.pop(action.key, None)
            self.metrics.record("failures", 1, self.role, action.reason)
            log_limited(log, logging.WARNING, ("failed", failure_reason(action.reason)),
                        "kvferry: receive of %s failed: %.80s", action.key, action.reason)  # fmt: skip
            self._publish(lambda r: r.failed.append((action.key, action.reason)))
        elif isinstance(action, A.Reject):
            self.metrics.record("rejected", 1, self.role, action.reason)
            # A peer (or an attacker) decides how many of these come: never log more than one a key
            # per interval; the counter above counts every one.
            log_limited(log, logging.WARNING, ("reject", action.reason), "kvferry %s ignored input (%s): %s",
                        self.role, action.reason, action.detail)  # fmt: skip

    def _start_write(self, action: A.StartWrite, agent: str | None, err: str) -> None:
        key, reg, now = action.key, action.reg, time.monotonic()
        if agent is None:
            self._feed(
                self.producer.write_finished(key, reg.consumer_rank, False, "handshake_failed", now), now
            )
            return
        sample = self._sample_sent(key, action.block_ids, reg)
        notif = encode(
            Done(reg.request_id, reg.attempt, self.engine_id, self.tp_rank, self.cfg.revision, sample)
        )
        if now >= action.deadline:  # the handshake took us past the consumer's deadline
            self._feed(self.producer.write_finished(key, reg.consumer_rank, False, "deadline", now), now)
            return
        try:
            if self._refusal(agent, consumer_side=False, registered=reg.layout_fingerprint):
                why = LAYOUT_MISMATCH
                self._feed(self.producer.write_finished(key, reg.consumer_rank, False, why, now), now)
                return
            handle, plan = self.transport.write(
                agent, action.block_ids, reg.block_ids, reg.num_tokens, notif,
                mode=self.cfg.descriptors, first_token=reg.first_token,
            )  # fmt: skip
        except Exception as exc:  # mapping, descriptors or NIXL: this WRITE fails, the thread serves on
            log_limited(log, logging.WARNING, "write_start", "kvferry: write of %s to %s failed to start: %s",
                        key, agent, exc)  # fmt: skip
            self._feed(self.producer.write_finished(key, reg.consumer_rank, False, "write_failed", now), now)
            return
        self.metrics.record("descriptors", plan.descriptors, plan.mode)
        self.metrics.record("prep_seconds", plan.prep_s, plan.mode)
        must_end_by = action.deadline + self.cfg.grace_s / 2  # the consumer frees at deadline + grace_s
        self.writes.add(Write(key, reg.consumer_rank, agent, handle, now, plan, must_end_by))

    def _refusal(self, agent: str, *, consumer_side: bool, registered: str | None = None) -> str:
        """Why KV cannot move between this rank and `agent` ("" when it can; layout.refusal), logged
        once per peer agent; counted per request by the caller's Failure."""
        peer = self.transport.peers[agent].layout
        src, dst = (peer, self.layout) if consumer_side else (self.layout, peer)
        why = refusal(src, dst, registered)
        if why and agent not in self._refused:
            self._refused.add(agent)
            log.error("kvferry: layout mismatch with %s, refusing every transfer: %s", agent, why)
        return why

    def _to_producers(self, action: A.Register | A.SendCancel, now: float) -> None:
        info, expected = self._recv.get(action.key), self.consumer.expected.get(action.key)
        if info is None or expected is None:
            return
        fail = partial(self._registration_failed, action.key, expected.producer_engine)
        self.notifier.to_producers(action, info, expected.producer_engine, expected.deadline, now, fail)

    def _probe_producers(self, action: A.ProbeProducers) -> None:
        """A receive held past its deadline + grace: is each silent producer rank still there?
        Gone (nothing listens, or another incarnation does): unload its agent so nothing more of it
        lands, and let the core count it answered once the bytes on their way are in. Alive: cancel
        again (a lost Cancel, or one it had no registration for). Unknown: keep holding."""
        info, expected = self._recv.get(action.key), self.consumer.expected.get(action.key)
        if info is None or expected is None:
            return
        log_limited(log, logging.WARNING, "held", "kvferry: receive %s is held past its deadline: producer "
                    "%s ranks %s never answered; its blocks stay out of use until they do or are seen gone",
                    action.key, expected.producer_engine, list(action.producer_ranks))  # fmt: skip
        for rank in action.producer_ranks:
            then = partial(self._probed, action.key, rank)
            self.peers.probe(info[0], info[1] + rank, expected.producer_engine, then)

    def _probed(self, key: Key, rank: int, verdict: str, agent: str | None) -> None:
        now = time.monotonic()
        self.metrics.record("probes", 1, verdict)
        if verdict == "gone":
            if agent is not None and agent in self.transport.peers:
                try:
                    self.transport.forget_peer(agent)
                except Exception as exc:  # a dead peer may refuse removal; drop it from our maps anyway
                    log.debug("unloading gone peer agent %s: %s", agent, exc)
                    self.transport.peers.pop(agent, None)
            info = self._recv.get(key)
            if info is not None:
                self.peers.forget_address(info[0], info[1] + rank)
            self._feed(self.consumer.producer_gone(key, rank, now), now)
        elif verdict == "alive":
            self._to_producers(A.SendCancel(key, (rank,)), now)

    def _registration_failed(self, key: Key, engine: str, rank: int, why: str) -> None:
        """Producer rank `rank` will never see our registration: count it as its Failure."""
        now = time.monotonic()
        self._feed(
            self.consumer.notice(Failure(key[0], key[1], engine, rank, why, self.cfg.revision), now), now
        )

    def _feed(self, actions: list[A.Action], now: float) -> None:
        for action in actions:
            self._do(action, now)
