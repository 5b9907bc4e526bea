"""Peer step: find a peer rank's agent from its side-channel address, once per incarnation.

Fetches (TCP, bounded, retried with backoff) run on a small pool of fetch threads that never touch
NIXL; loading the fetched agent metadata into NIXL happens in `finish()`, on the endpoint thread.
Callers pass a continuation that receives the agent name, or None and the reason. Pods come and go:
`prune()` unloads agents of peers unused for `peer_idle_s` and stale agents of restarted peers.
Bounded: at most MAX_FETCHES addresses are being fetched at once and MAX_WAITERS continuations wait
on one; beyond that a caller is answered at once with the reason, nothing queues. A fetch with an
expected incarnation must find that very agent at the address, not just an agent of the engine.
A `suspect` fetch (an address only an unverified registration names) runs on its own thread, one
at a time: whatever addresses a flood of made-up registrations names, this rank connects to at
most one of them at once, and never delays a real handshake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvferry.connector.config import KvferryConfig
from kvferry.connector.metrics import Metrics
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.sideauth import SideAuth
from kvferry.connector.sidechannel import NO_AUTH, PeerRefused, SideChannelError, fetch_peer
from kvferry.connector.transport import NixlTransport
from kvferry.connector.wire import PeerInfo, layout_from_wire

log = logging.getLogger(__name__)
Then = Callable[[str | None, str], None]
Verdict = Callable[[str, str | None], None]  # (gone | alive | unknown, the agent we knew there)
Addr = tuple[str, int]
MAX_FETCHES = 64  # addresses being fetched at once (a decode's producer ranks, a prefill's consumers)
MAX_WAITERS = 1024  # continuations waiting on one fetch


class Peers:
    def __init__(
        self,
        cfg: KvferryConfig,
        metrics: Metrics,
        wake: Callable[[], None],
        auth: SideAuth = NO_AUTH,
        name: str = "",
    ) -> None:
        """`auth`, `name`: the token this rank proves to peers' side channels, as agent `name`."""
        self.cfg, self.metrics, self._wake = cfg, metrics, wake
        self._auth, self._name = auth, name
        # several threads, so one silent peer does not delay fetches from the others
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvferry-fetch")
        self._suspect_pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-fetch-suspect")
        self._suspect: Addr | None = None  # the suspect fetch in flight
        self._fetches: dict[Addr, tuple[Future[PeerInfo], list[Then]]] = {}
        self._known: dict[Addr, tuple[str, str]] = {}  # address -> (incarnation, agent name)
        self._used: dict[Addr, float] = {}  # address -> last use (monotonic)
        # address -> (incarnation, agent) last loaded there, kept when forgotten: a probe compares
        self._loaded: dict[Addr, tuple[str, str]] = {}
        self._probes: dict[Addr, tuple[Future[str], str | None, list[Verdict]]] = {}

    @property
    def fetching(self) -> int:
        return len(self._fetches)

    def with_peer(
        self, host: str, port: int, engine: str | None, incarnation: str | None, then: Then,
        suspect: bool = False,
    ) -> None:  # fmt: skip
        """Run `then(agent, "")` with the loaded agent, now or after a fetch; `then(None, why)` on failure.
        A known incarnation different from the cached one (a restarted peer) forces a fetch."""
        cached = self._known.get((host, port))
        self._used[(host, port)] = time.monotonic()
        if cached and (incarnation is None or cached[0] == incarnation):
            then(cached[1], "")
            return
        if (host, port) in self._fetches:
            waiters = self._fetches[(host, port)][1]
            if len(waiters) >= MAX_WAITERS:
                then(None, f"{MAX_WAITERS} transfers already wait for {host}:{port}")
                return
            waiters.append(then)
            return
        if len(self._fetches) >= MAX_FETCHES or (suspect and self._suspect is not None):
            self.metrics.record("handshakes", 1, "refused")
            then(None, "a handshake for an unverified peer is under way" if suspect else
                 f"{MAX_FETCHES} handshakes already under way")  # fmt: skip
            return
        pool = self._suspect_pool if suspect else self._pool
        if suspect:
            self._suspect = (host, port)
        future = pool.submit(self._fetch, host, port, engine, incarnation)
        future.add_done_callback(lambda _: self._wake())
        self._fetches[(host, port)] = (future, [then])

    def probe(self, host: str, port: int, engine: str, then: Verdict) -> None:
        """One check (bounded by handshake_timeout_s, not retried) of whether the agent we loaded for
        host:port still serves there: then("gone", agent) when nothing listens there or another
        engine or incarnation does, ("alive", agent) when it does, ("unknown", agent) when the check
        proves neither (a timeout: a frozen peer may resume). Runs on the endpoint thread in finish()."""
        loaded = self._loaded.get((host, port))
        agent = loaded[1] if loaded else None
        if (host, port) in self._probes:
            self._probes[(host, port)][2].append(then)
            return
        if len(self._probes) >= MAX_FETCHES:
            then("unknown", agent)
            return
        future = self._pool.submit(self._probe, host, port, engine, loaded[0] if loaded else None)
        future.add_done_callback(lambda _: self._wake())
        self._probes[(host, port)] = (future, agent, [then])

    def _probe(self, host: str, port: int, engine: str, incarnation: str | None) -> str:
        try:
            info = fetch_peer(host, port, self.cfg.handshake_timeout_s, self._auth, self._name)
        except PeerRefused:
            return "gone"
        except SideChannelError:
            return "unknown"
        if info.engine_id != engine or (incarnation is not None and info.incarnation != incarnation):
            return "gone"  # the address now serves another process: the one we wrote with is gone
        return "alive"

    def known(self, host: str, port: int, incarnation: str) -> str | None:
        """The agent already loaded for host:port if it is that incarnation (no fetch, no I/O)."""
        cached = self._known.get((host, port))
        return cached[1] if cached is not None and cached[0] == incarnation else None

    def forget(self, agent: str) -> None:
        """A send to `agent` failed: the next use fetches the peer again (prune() unloads it)."""
        self._known = {k: v for k, v in self._known.items() if v[1] != agent}

    def forget_address(self, host: str, port: int) -> None:
        """The peer at host:port never answered us: its connection may be broken without a send ever
        failing (a notification posted on a dead endpoint), so the next use fetches it again."""
        self._known.pop((host, port), None)

    def prune(self, transport: NixlTransport, busy: set[str], now: float) -> list[str]:
        """Unload agents no address maps to any more (forgotten, replaced) and agents of peers unused
        for `peer_idle_s`; never one in `busy` (a WRITE to it is in flight). Returns the unloaded."""
        for addr, used in list(self._used.items()):
            if now - used >= self.cfg.peer_idle_s and addr not in self._fetches:
                known = self._known.get(addr)
                if known is None or known[1] not in busy:
                    self._known.pop(addr, None)
                    self._loaded.pop(addr, None)
                    del self._used[addr]
        live = {agent for _, agent in self._known.values()} | busy
        gone = [agent for agent in transport.peers if agent not in live]
        for agent in gone:
            try:
                transport.forget_peer(agent)
            except Exception as exc:  # a dead peer may refuse removal; it is dropped from our maps anyway
                log.debug("unloading peer agent %s: %s", agent, exc)
                transport.peers.pop(agent, None)
        return gone

    def _fetch(self, host: str, port: int, engine: str | None, incarnation: str | None) -> PeerInfo:
        delay, last = 0.05, None
        for _ in range(self.cfg.handshake_attempts):
            try:
                info = fetch_peer(host, port, self.cfg.handshake_timeout_s, self._auth, self._name)
            except SideChannelError as exc:
                last = exc
                time.sleep(delay)
                delay *= 4
                continue
            if engine is not None and info.engine_id != engine:
                raise SideChannelError(
                    f"side channel {host}:{port} is engine {info.engine_id!r}, expected {engine!r}"
                )
            if incarnation is not None and info.incarnation != incarnation:
                raise SideChannelError(
                    f"side channel {host}:{port} serves incarnation {info.incarnation!r}, "
                    f"expected {incarnation!r}"
                )
            return info
        raise SideChannelError(f"{last} (after {self.cfg.handshake_attempts} attempts)")

    def finish(self, transport: NixlTransport) -> bool:
        """Load finished fetches into NIXL and run their continuations (endpoint thread only)."""
        done = [addr for addr, (future, _) in self._fetches.items() if future.done()]
        for addr in done:
            future, waiters = self._fetches.pop(addr)
            if addr == self._suspect:
                self._suspect = None
            agent, err = None, ""
            try:
                info = future.result()
                layout = layout_from_wire(info.layout, info.layout_fingerprint)
                agent = transport.load_peer(info.agent_metadata, layout, info.agent_name)
                self._known[addr] = (info.incarnation, agent)  # a replaced agent: prune() unloads it
                self._loaded[addr] = (info.incarnation, agent)
                self.metrics.record("handshakes", 1, "ok")
            except Exception as exc:  # any failure fails the waiting transfers, never the thread
                err = str(exc)
                self.metrics.record("handshakes", 1, "failed")
                log_limited(log, logging.WARNING, "peer", "kvferry: peer %s:%d unavailable: %s", *addr, err)
            for then in waiters:
                try:
                    then(agent, err)
                except Exception:  # a continuation's bug must not stop the endpoint thread
                    log.exception("kvferry: continuation for peer %s:%d failed", *addr)
        return self._finish_probes() or bool(done)

    def _finish_probes(self) -> bool:
        done = [addr for addr, (future, _, _) in self._probes.items() if future.done()]
        for addr in done:
            future, agent, waiters = self._probes.pop(addr)
            try:
                verdict = future.result()
            except Exception:  # a probe that raised proves nothing
                verdict = "unknown"
            for then in waiters:
                try:
                    then(verdict, agent)
                except Exception:
                    log.exception("kvferry: probe continuation for peer %s:%d failed", *addr)
        return bool(done)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._suspect_pool.shutdown(wait=False, cancel_futures=True)
