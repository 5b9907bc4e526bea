"""`kvferry preflight` loads real NIXL backend plugins and fails loudly where EFA is missing."""

from __future__ import annotations

import pytest
from kvferry.connector.config import KvferryConfig
from kvferry.connector.metrics import Metrics
from kvferry.connector.preflight import main, record, run_checks
from prometheus_client import generate_latest

pytestmark = pytest.mark.nixl


def test_ucx_passes_here(capsys):
    assert main(["--backends", "UCX"]) == 0
    assert "ok   backend_UCX" in capsys.readouterr().out


def test_libfabric_without_efa_fails_with_reason(tmp_path):
    checks = {c.name: c for c in run_checks(KvferryConfig.from_extra({}), efa_root=tmp_path)}
    assert not checks["efa_device"].ok and "no EFA device" in checks["efa_device"].detail
    metrics = Metrics()
    record(list(checks.values()), metrics)
    assert 'kvferry_preflight_ok{check="efa_device"} 0.0' in generate_latest(metrics.registry).decode()


def test_bad_config_exits_2():
    assert main(["--extra-config", '{"lease": 1}']) == 2
