"""Transfer status in O(services) (issue 19): the operator reads one URL per CR, its router's pool
metrics (router/poolstatus.py), and gets the engines' texts it would have read pod by pod."""

from __future__ import annotations

import json
from typing import Any

from kvferry.contracts.pods import POOL_METRICS_PATH
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import names
from kvferry.operator.status import scrape

PREFILL = 'kvferry_transfers_total{backend="UCX"} 12.0\n'


def _pod(role: str, owner_kind: str, owner: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{owner}-0",
            "namespace": "ns",
            "labels": {names.LABEL_ROLE: role},
            "ownerReferences": [{"kind": owner_kind, "name": owner, "controller": True}],
        },
        "status": {"phase": "Running", "podIP": f"10.0.0.{len(owner)}"},
    }


def test_the_operator_reads_one_url_per_cr_and_gets_the_pods_texts() -> None:
    pods = [
        _pod("prefill", "StatefulSet", "x-prefill"),
        _pod("decode", "StatefulSet", "x-decode"),
        _pod("router", "ReplicaSet", names.router_name("x") + "-5d8f"),
        _pod("router", "ReplicaSet", "someone-elses-router-1"),  # not this CR's router: never read
    ]
    fetched: list[str] = []
    answer = {"prefill": [PREFILL], "decode": [""], "unreachable": {"prefill": 0, "decode": 0}}

    def fetch(url: str) -> str:
        fetched.append(url)
        return json.dumps(answer)

    texts = scrape.texts_from_router(pods, OperatorConfig(), fetch, "x")
    assert fetched == [f"http://10.0.0.{len(names.router_name('x') + '-5d8f')}:8000{POOL_METRICS_PATH}"]
    assert texts == {"prefill": [PREFILL], "decode": [""]}
    assert scrape.texts_from_router(pods, OperatorConfig(), lambda url: "not json", "x") == {
        "prefill": [],
        "decode": [],
    }
    assert scrape.texts_from_router(pods[:2], OperatorConfig(), fetch, "x") == {"prefill": [], "decode": []}
