"""Probe results follow the kubelet's thresholds: liveness passes until failureThreshold misses."""

from __future__ import annotations

from kvferry.local.nodeagent.probes import ProbeState

PROBE = {"httpGet": {"port": 8000}, "periodSeconds": 10, "failureThreshold": 3, "initialDelaySeconds": 5}


def test_liveness_counts_as_alive_until_failure_threshold() -> None:
    state = ProbeState(PROBE, True, initial=True, started_at=0.0)
    assert state.result is True and not state.due(4.0) and state.due(5.0)
    for n in range(2):
        state.record(False, 5.0 + 10 * n)
        assert state.result is True and not state.failed_out
    state.record(False, 25.0)
    assert state.result is False and state.failed_out
    assert state.next_at == 35.0


def test_readiness_starts_unready_and_a_success_resets_failures() -> None:
    state = ProbeState(PROBE, True, started_at=0.0)
    assert state.result is False
    state.record(False, 5.0)
    state.record(True, 15.0)
    assert state.result is True and state.failures == 0


def test_absent_probe_takes_the_default_and_never_runs() -> None:
    state = ProbeState(None, True)
    assert state.result is True and not state.due(1e9)
