"""Pod network step for Python processes in local pods: a wildcard bind means the pod's own address.

In Kubernetes each pod has its own network namespace, so every server may listen on 0.0.0.0:8000.
Local pods share the host's network and differ only by their loopback pod IP, so the node agent puts
this directory on the pod's PYTHONPATH: binds of an IPv4 socket to "" or 0.0.0.0 are turned into
binds to KVFERRY_POD_IP, and so are ZMQ binds to `tcp://*:PORT` (vLLM's KV-event publisher binds its
endpoints that way; libzmq binds in C, past the socket patch). Nothing else changes; processes that
bind explicit addresses are untouched.
"""

from __future__ import annotations

import os
import socket

_POD_IP = os.environ.get("KVFERRY_POD_IP")
_WILDCARDS = ("", "0.0.0.0", None)

if _POD_IP:
    _original_bind = socket.socket.bind

    def _pod_bind(self: socket.socket, address, /):  # type: ignore[no-untyped-def]
        if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] in _WILDCARDS:
            address = (_POD_IP, *address[1:])
        return _original_bind(self, address)

    socket.socket.bind = _pod_bind  # type: ignore[method-assign]

    def _patch_zmq() -> None:
        try:
            from zmq.sugar import socket as zmq_socket
        except ImportError:  # a pod process without pyzmq binds no ZMQ socket
            return
        original = zmq_socket.Socket.bind

        def _pod_zmq_bind(self, addr, /):  # type: ignore[no-untyped-def]
            if isinstance(addr, str) and addr.startswith("tcp://*:"):
                addr = f"tcp://{_POD_IP}:{addr[len('tcp://*:') :]}"
            return original(self, addr)

        zmq_socket.Socket.bind = _pod_zmq_bind  # type: ignore[method-assign]

    _patch_zmq()
