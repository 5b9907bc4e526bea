"""Transport step: the NIXL agent and everything that touches it. Call only from the endpoint thread.

NIXL runs in NIXL_THREAD_SYNC_NONE without a listener thread, so one thread must own the agent;
`Endpoint` (endpoint.py) is that thread and the only caller of this class. The agent is created
without UCX's progress thread (it busy-spins about one core per agent while idle): progress happens
inside our own `notifs()` / `state()` calls, which the endpoint makes on a bounded backoff.

Descriptors: when both sides have the same per-block layout, writes use NIXL prepped descriptor
lists (one entry per layer and block, prepared once per local cache and once per peer) and pass only
indices per request; otherwise each request gets a coalesced descriptor list from layout.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from kvferry.connector.config import KvferryConfig
from kvferry.connector.layout import KVLayout
from kvferry.connector.mapping import Segments, block_aligned, block_pairs, coalesce, plan, pushed_blocks

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """NIXL refused something (backend, registration, peer, transfer); the message says what."""


@dataclass
class Peer:
    agent_name: str
    layout: KVLayout
    prepped: object | None = None  # remote block-granular dlist, prepared on first aligned write


@dataclass
class WritePlan:
    """What one WRITE will move, and what building it cost (for metrics and the benchmark)."""

    mode: str  # prepped | coalesced | units
    descriptors: int
    nbytes: int
    prep_s: float
    tokens: int = 0  # tokens written (those the consumer lacked)
    blocks: int = 0  # consumer blocks written into (per layer)


class NixlTransport:
    def __init__(self, name: str, cfg: KvferryConfig) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # imported here: only this module needs NIXL

        conf = nixl_agent_config(
            enable_prog_thread=cfg.progress_thread,
            enable_listen_thread=False,
            capture_telemetry=False,
            num_threads=cfg.num_threads,
            backends=list(cfg.backends),
        )
        self.agent = nixl_agent(name, conf)
        missing = [b for b in cfg.backends if b not in self.agent.backends]
        if missing:
            raise TransportError(
                f"NIXL backend plugin(s) {missing} could not be created "
                f"(available: {self.agent.get_plugin_list()}); run `kvferry preflight`"
            )
        self.name, self.cfg = name, cfg
        self.backends: list[str] = [b for b in cfg.backends if b in self.agent.backends]
        self.backend = self.backends[0]  # NIXL picks the first backend both sides have: metrics label
        self.peers: dict[str, Peer] = {}
        self.layout: KVLayout | None = None
        self._local_prepped: object | None = None
        self._reg: object | None = None

    def register(self, layout: KVLayout) -> None:
        """Register the local KV memory once (host DRAM, or GPU VRAM for CUDA caches); writes read
        from, and peers write into, it. Regions that share pages (cross-layer layouts) register once."""
        descs = [(base, size, layout.device_id, "") for base, size in layout.spans()]
        try:
            self._reg = self.agent.register_memory(descs, layout.memory)
        except Exception as exc:
            raise TransportError(
                f"registering {len(descs)} KV spans ({layout.memory}) with NIXL failed: {exc}"
            ) from exc
        self.layout = layout

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def load_peer(self, agent_metadata: bytes, layout: KVLayout, agent_name: str = "") -> str:
        """Load a peer agent; a restarted peer (new incarnation = new name) replaces nothing else. The
        same agent again (refetched after a failed send) is unloaded first: its connection broke."""
        if agent_name in self.peers:
            self.forget_peer(agent_name)
        name = self.agent.add_remote_agent(agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.peers[name] = Peer(name, layout)
        return name

    def forget_peer(self, agent_name: str) -> None:
        peer = self.peers.pop(agent_name, None)
        if peer is not None:
            if peer.prepped is not None:
                self.agent.release_dlist_handle(peer.prepped)
            self.agent.remove_remote_agent(agent_name)

    def send(self, agent_name: str, payload: bytes) -> None:
        self.agent.send_notif(agent_name, payload)

    def notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name (also drives UCX progress)."""
        raw = self.agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}

    def write(
        self,
        agent_name: str,
        src_blocks: list[list[int]],
        dst_blocks: list[list[int]],
        num_tokens: int,
        notif: bytes,
        mode: str = "auto",
        first_token: int = 0,
    ) -> tuple[object, WritePlan]:
        """Map tokens [first_token, num_tokens), build descriptors and post one WRITE carrying `notif`;
        returns (handle, plan). `src_blocks` hold the prompt from token 0, `dst_blocks` from
        `first_token` (mapping.plan)."""
        assert self.layout is not None, "register() first"
        peer = self.peers[agent_name]
        t0 = time.perf_counter()
        if mode == "auto":
            mode = "prepped" if block_aligned(self.layout, peer.layout) else "coalesced"
        if mode == "prepped" and not block_aligned(self.layout, peer.layout):
            raise TransportError("descriptors=prepped needs the same per-block layout on both sides")
        if mode == "prepped":
            handle, count, nbytes = self._prepped_xfer(
                peer, src_blocks, dst_blocks, first_token, num_tokens, notif
            )
        else:
            seg = plan(
                self.layout, src_blocks, peer.layout, dst_blocks, num_tokens,
                first_token=first_token, merge=mode == "coalesced",
            )  # fmt: skip
            seg = coalesce(seg) if mode == "coalesced" else seg
            handle, count, nbytes = self._explicit_xfer(peer, seg, notif), len(seg), seg.total_bytes
        prep_s = time.perf_counter() - t0
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransportError(f"posting a WRITE of {nbytes} bytes to {agent_name} failed")
        tokens, blocks = num_tokens - first_token, pushed_blocks(peer.layout, first_token, num_tokens)
        return handle, WritePlan(mode, count, nbytes, prep_s, tokens, blocks)

    def _explicit_xfer(self, peer: Peer, seg: Segments, notif: bytes) -> object:
        assert self.layout is not None
        local = self.agent.get_xfer_descs(_descs(seg.src_addr, seg.length, self.layout), self.layout.memory)
        remote = self.agent.get_xfer_descs(_descs(seg.dst_addr, seg.length, peer.layout), peer.layout.memory)
        return self.agent.initialize_xfer("WRITE", local, remote, peer.agent_name, notif)

    def _prepped_xfer(
        self,
        peer: Peer,
        src_blocks: list[list[int]],
        dst_blocks: list[list[int]],
        first_token: int,
        num_tokens: int,
        notif: bytes,
    ) -> tuple[object, int, int]:
        assert self.layout is not None
        if self._local_prepped is None:
            self._local_prepped = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _block_descs(self.layout), self.layout.memory
            )
        if peer.prepped is None:
            peer.prepped = self.agent.prep_xfer_dlist(
                peer.agent_name, _block_descs(peer.layout), peer.layout.memory
            )
        s_ids, d_ids = block_pairs(
            self.layout, src_blocks, peer.layout, dst_blocks, num_tokens, first_token=first_token
        )
        s_idx = _block_indices(self.layout, s_ids)
        d_idx = _block_indices(peer.layout, d_ids)
        handle = self.agent.make_prepped_xfer("WRITE", self._local_prepped, s_idx, peer.prepped, d_idx, notif)
        return handle, int(s_idx.size), int(s_idx.size) * self.layout.page_bytes

    def state(self, handle: object) -> str:
        """DONE, PROC or ERR (also drives UCX progress)."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle: object) -> None:
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        for name in list(self.peers):
            try:
                self.forget_peer(name)
            except Exception as exc:  # closing must finish: a dead peer may refuse removal
                log.debug("forgetting %s at close: %s", name, exc)
        if self._local_prepped is not None:
            self.agent.release_dlist_handle(self._local_prepped)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)


def _descs(addr: np.ndarray, length: np.ndarray, layout: KVLayout) -> np.ndarray:
    """NIXL descriptor rows (address, length, device id)."""
    dev = np.full(addr.size, layout.device_id, dtype=np.uint64)
    return np.stack([addr.astype(np.uint64), length.astype(np.uint64), dev], axis=1)


def _block_descs(layout: KVLayout) -> np.ndarray:
    """One descriptor per (region, block), region-major: index = region * num_blocks + block; each
    covers the block's dense page (block_aligned() guarantees it holds only that block's KV)."""
    nb = layout.regions[0].num_blocks
    bases = np.array([r.base for r in layout.regions], dtype=np.uint64)
    addrs = (
        bases[:, None] + np.arange(nb, dtype=np.uint64)[None, :] * np.uint64(layout.block_stride)
    ).ravel()
    return _descs(addrs, np.full(addrs.size, layout.page_bytes, dtype=np.uint64), layout)


def _block_indices(layout: KVLayout, per_region: list[np.ndarray]) -> np.ndarray:
    """Indices into _block_descs of each region's blocks."""
    nb = layout.regions[0].num_blocks
    rows = [i * nb + ids for i, ids in enumerate(per_region)]
    return np.concatenate(rows).astype(np.int32)
