"""Scale out (issue 19): two operator replicas on the real API server, each serving its shard of the CRs
(`--shard 0/2`, `--shard 1/2`, operator/runtime/shard.py). Every CR is reconciled, and each replica's own
metrics show it reconciled exactly the CRs of its shard: none twice, none by both, none left out."""

from __future__ import annotations

import urllib.request

from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator.runtime.shard import shard_of

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

PER_SHARD = 3


def _names(namespace: str, shard: int, count: int = PER_SHARD) -> list[str]:
    """The first `count` names of the form s<i> that hash to `shard` of 2 in `namespace`."""
    return [n for n in (f"s{i}" for i in range(64)) if shard_of(namespace, n, 2) == shard][:count]


def _created(port: int) -> dict[str, float]:
    """Reconciles by trigger, from one replica's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvferry_operator_reconciles_total{"):
            trigger = line.split('trigger="')[1].split('"')[0]
            out[trigger] = out.get(trigger, 0) + float(line.rsplit(" ", 1)[1])
    return out


def _reconciled(cluster, name: str) -> bool:
    """The CR's objects exist and its status is written for its generation (Ready needs kwok capacity
    for every engine pod, which is not what this test is about)."""
    cr = cluster.cr(name)
    status = cr.get("status") or {}
    done = status.get("revision") and status.get("observedGeneration") == cr["metadata"]["generation"]
    return bool(done) and cluster.get("statefulset", f"{name}-decode") is not None


def test_two_replicas_each_reconcile_exactly_their_shard(cluster, start_operator) -> None:
    ports = reserve_ports(2)
    for index, port in enumerate(ports):
        start_operator("--shard", f"{index}/2", env={"KVFERRY_METRICS_PORT": str(port)})
    owners = {name: index for index in (0, 1) for name in _names(cluster.ns, index)}
    for name in owners:
        cluster.apply(make_inference(name).obj())
    for name in owners:  # reconciled: objects applied and a status for this generation written
        wait_until(lambda n=name: _reconciled(cluster, n), f"CR {name} reconciled")
    for index, port in enumerate(ports):
        mine = sum(owner == index for owner in owners.values())
        wait_until(lambda p=port, m=mine: _created(p).get("create", 0) == m, f"shard {index} created {mine}")
        counts = _created(port)
        full = sum(counts.get(t, 0) for t in ("create", "update", "resume", "drift"))
        assert full == mine, (index, counts)  # nothing of the other shard, nothing twice


def test_a_replica_restarted_with_another_shard_takes_over_its_crs(cluster, start_operator) -> None:
    port = reserve_ports(1)[0]
    first = start_operator("--shard", "0/2")
    names = _names(cluster.ns, 1, 2)
    for name in names:
        cluster.apply(make_inference(name).obj())
    first.stop()  # nobody serves shard 1 yet: its CRs wait, nothing is lost
    assert all(not (cluster.cr(n).get("status") or {}).get("revision") for n in names)
    start_operator("--shard", "1/2", env={"KVFERRY_METRICS_PORT": str(port)})
    for name in names:
        wait_until(lambda n=name: _reconciled(cluster, n), f"CR {name} reconciled once shard 1 runs")
    assert _created(port).get("resume", 0) + _created(port).get("create", 0) >= len(names)
