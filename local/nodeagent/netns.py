"""Network step: the node's own network namespace, where every pod of the node lives with its IP.

Why not plain loopback addresses: the API server refuses EndpointSlice addresses in 127.0.0.0/8, so
pods on 127.x could never be discovered through their Services. Instead the agent creates a network
namespace for the node, joined to the host by a veth pair: the host side holds the node IP (the
subnet's first address), the namespace side one address per pod. The host (operator, demo client,
probes) reaches pod IPs through that link; nothing is reachable from outside the machine.
Pods in the namespace reach the API server through a forwarder that listens on 127.0.0.1:<port>
inside the namespace and connects to the same address on the host, so in-cluster URLs and the
server certificate stay valid.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import subprocess
import threading
import zlib

CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 10.0
log = logging.getLogger("kvferry.nodeagent")


class NetworkError(RuntimeError):
    """Setting up the node's namespace failed; the message names the `ip` command and its error."""


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if res.returncode != 0:
        raise NetworkError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()} (the node agent needs root)")


class NodeNetwork:
    """A network namespace plus veth link for one node; pod IPs are added and removed per pod."""

    def __init__(self, name: str, cidr: str) -> None:
        net = ipaddress.ip_network(cidr)
        if not net.is_private or net.is_loopback or net.prefixlen > 29:
            raise ValueError(f"pod subnet {cidr} must be a private, non-loopback IPv4 /29 or larger")
        self.net, self.ns = net, name
        self.prefix = net.prefixlen
        self.host_if = f"kvf{zlib.crc32(name.encode()):08x}"  # interface names: at most 15 bytes
        self._forwarders: list[_Forwarder] = []

    @property
    def ns_path(self) -> str:
        return f"/run/netns/{self.ns}"

    def exec_prefix(self) -> list[str]:
        """What a command line is prefixed with to run inside the node's namespace."""
        return ["nsenter", f"--net={self.ns_path}", "--"]

    def setup(self, node_ip: str) -> None:
        self.teardown()  # a namespace left by a killed agent
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _ip("addr", "add", f"{node_ip}/{self.prefix}", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "set", "eth0", "up")

    def add_pod_ip(self, ip: str) -> None:
        _ip("-n", self.ns, "addr", "add", f"{ip}/{self.prefix}", "dev", "eth0")

    def remove_pod_ip(self, ip: str) -> None:
        try:
            _ip("-n", self.ns, "addr", "del", f"{ip}/{self.prefix}", "dev", "eth0")
        except NetworkError as exc:
            log.warning("%s", exc)

    def forward_loopback_port(self, port: int) -> None:
        """Make host 127.0.0.1:port reachable as 127.0.0.1:port inside the namespace."""
        fwd = _Forwarder(self.ns_path, port)
        fwd.start()
        self._forwarders.append(fwd)

    def teardown(self) -> None:
        for fwd in self._forwarders:
            fwd.stop()
        self._forwarders.clear()
        if os.path.exists(self.ns_path):
            _ip("netns", "del", self.ns)  # also removes the veth pair


def _socket_in_netns(ns_path: str, port: int) -> socket.socket:
    """A listening socket created inside the namespace (setns is per thread, so a helper thread)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(ns_path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns_path}) failed")
            finally:
                os.close(fd)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(64)
            out["sock"] = sock
        except OSError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name="netns-listen")
    thread.start()
    thread.join(timeout=IP_TIMEOUT_S)
    if "sock" not in out:
        raise NetworkError(f"cannot listen on 127.0.0.1:{port} in {ns_path}: {out.get('error')}")
    return out["sock"]  # type: ignore[return-value]


class _Forwarder:
    """TCP relay: namespace 127.0.0.1:port -> host 127.0.0.1:port, one thread pair per connection."""

    def __init__(self, ns_path: str, port: int) -> None:
        self.port = port
        self.listener = _socket_in_netns(ns_path, port)
        self._thread = threading.Thread(target=self._accept, name=f"netns-fwd-{port}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        # shutdown() wakes the blocked accept(); close() alone does not on Linux.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
