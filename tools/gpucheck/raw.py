"""GPU check step: the baseline, a bare NIXL agent writing one descriptor.

The connector's WRITEs (many descriptors, built by mapping.py, posted from the endpoint thread)
are printed next to this: the same bytes, memory kind and backend between the same two processes,
one descriptor, busy-polled. The one module of the check that imports NIXL itself.
"""

from __future__ import annotations

import threading
import time

from kvferry.tools.gpucheck.devkv import ALIGN

DONE_TIMEOUT_S = 60.0


class RawAgent:
    """A bare NIXL agent with one registered buffer: the baseline the connector's WRITEs are
    compared with (one descriptor, the same bytes, the same memory kind and backend)."""

    def __init__(self, name: str, nbytes: int, device: str) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_listen_thread=False))
        self._store = torch.ones(nbytes + ALIGN, dtype=torch.uint8, device=torch.device(device))
        start = -self._store.data_ptr() % ALIGN
        self.buf = self._store[start : start + nbytes]
        self.mem = "VRAM" if self.buf.is_cuda else "DRAM"
        self.addr, self.nbytes = self.buf.data_ptr(), nbytes
        self.reg = self.agent.register_memory([(self.addr, nbytes, 0, "")], self.mem)
        self._thread: threading.Thread | None = None

    def serve(self, repeats: int) -> tuple[bytes, int, int, str]:
        """Progress this agent (notifications) on a thread until every WRITE's notice arrived."""

        def poll() -> None:
            seen, end = 0, time.monotonic() + DONE_TIMEOUT_S * repeats
            while seen < repeats and time.monotonic() < end:
                seen += sum(len(v) for v in self.agent.get_new_notifs().values())
                time.sleep(0.0002)

        meta = self.agent.get_agent_metadata()
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return meta, self.addr, self.nbytes, self.mem

    def write(self, target: tuple[bytes, int, int, str], repeats: int) -> list[float]:
        meta, addr, nbytes, mem = target
        peer = self.agent.add_remote_agent(meta)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        local = self.agent.get_xfer_descs([(self.addr, self.nbytes, 0)], self.mem)
        remote = self.agent.get_xfer_descs([(addr, nbytes, 0)], mem)
        out = []
        for i in range(repeats):
            handle = None
            end = time.monotonic() + DONE_TIMEOUT_S
            while handle is None:  # the peer's metadata may need a moment to wire up
                try:
                    handle = self.agent.initialize_xfer("WRITE", local, remote, peer, f"raw{i}".encode())
                except Exception:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.01)
            t0 = time.perf_counter()
            state = self.agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if time.monotonic() > end:
                    raise TimeoutError(f"raw NIXL WRITE of {nbytes} bytes not done in {DONE_TIMEOUT_S}s")
                state = self.agent.check_xfer_state(handle)
            out.append(time.perf_counter() - t0)
            self.agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError(f"raw NIXL WRITE of {nbytes} bytes failed")
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(DONE_TIMEOUT_S)
            self._thread = None
        self.agent.deregister_memory(self.reg)
