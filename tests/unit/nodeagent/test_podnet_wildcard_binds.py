"""local/nodeagent/podnet: local pods share the node's network namespace, so a wildcard bind must mean
the pod's own address: Python sockets and ZMQ `tcp://*:PORT` binds (vLLM's KV-event publisher) alike.
Two pods binding the same port on their own addresses then coexist, as in Kubernetes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvferry.local.nodeagent.image import PODNET_DIR
from kvferry.tools.serve import free_port

PROBE = """
import socket, zmq
z = zmq.Context.instance().socket(zmq.PUB)
z.bind("tcp://*:{port}")
s = socket.socket()
s.bind(("0.0.0.0", {other}))
print(z.getsockopt_string(zmq.LAST_ENDPOINT), s.getsockname()[0])
"""


def _pod(ip: str, port: int, other: int) -> subprocess.Popen[str]:
    env = {**os.environ, "KVFERRY_POD_IP": ip, "PYTHONPATH": str(PODNET_DIR)}  # as the node agent sets it
    code = PROBE.format(port=port, other=other) + "import time; time.sleep(2)\n"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def test_two_pods_bind_the_same_port_each_on_its_own_address(tmp_path: Path) -> None:
    port, other = free_port(), free_port()
    pods = [_pod("127.0.0.7", port, other), _pod("127.0.0.8", port, other)]
    lines = [p.communicate(timeout=60)[0].strip() for p in pods]
    assert [p.returncode for p in pods] == [0, 0], lines
    assert lines == [f"tcp://127.0.0.7:{port} 127.0.0.7", f"tcp://127.0.0.8:{port} 127.0.0.8"]
