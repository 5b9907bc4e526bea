"""Every condition reason has a fix (operator/status/remedies.py) and a row in docs/troubleshooting.md;
engine pods' kvferry termination messages become PreflightFailed / ConnectorInjectFailed
(operator/status/podchecks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.connector.preflight import Check, failure_message
from kvferry.contracts import termination
from kvferry.operator.status import podchecks, remedies
from kvferry.operator.status.conditions import Reason

DOC = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"


def test_every_reason_has_a_fix() -> None:
    missing = [r.value for r in Reason if not remedies.FIXES.get(r)]
    assert missing == [], f"add a remedies.FIXES entry for {missing}"


def test_troubleshooting_doc_lists_every_reason_as_generated() -> None:
    text = DOC.read_text()
    block = text.split("<!-- BEGIN reasons", 1)[1].split("\n", 1)[1].split("<!-- END reasons -->")[0]
    assert block.strip() == remedies.table(), "regenerate: python -m kvferry.operator.status.remedies"
    for reason in Reason:
        assert f"| `{reason.value}` |" in block


def test_explain_adds_the_fix_only_to_faults() -> None:
    assert remedies.explain(Reason.TRANSFERS_OK, "10 transfers") == "10 transfers"
    msg = remedies.explain(Reason.WRONG_BACKEND, "pods report NIXL backend UCX")
    assert msg.startswith("pods report NIXL backend UCX. Fix: set spec.kvTransfer.backends to [LIBFABRIC]")


def _pod(name: str, role: str, *, init=(), main=()) -> dict:
    return {
        "metadata": {"name": name, "labels": {"kvferry.io/role": role}},
        "status": {"initContainerStatuses": list(init), "containerStatuses": list(main)},
    }


def _status(
    name: str, *, running: bool = False, exit_code: int = 1, message: str = "", last: bool = True
) -> dict:
    terminated = {"exitCode": exit_code, "message": message}
    if running:
        return {"name": name, "state": {"running": {}}, "lastState": {"terminated": terminated}}
    if last:
        return {
            "name": name,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": terminated},
        }
    return {"name": name, "state": {"terminated": terminated}}


# As the connector's start-up preflight and `kvferry inject` write them.
PREFLIGHT = failure_message([Check("nixl_version", False, "NIXL 1.4.2 is older than 1.5")])
INJECT = termination.INJECT_FAILED + "No space left on device"


def test_crashlooping_preflight_is_named_with_its_pods() -> None:
    pods = [_pod(f"m-decode-{i}", "decode", main=[_status("vllm", message=PREFLIGHT)]) for i in range(5)]
    reason, message = podchecks.start_failure(pods)
    assert reason == Reason.PREFLIGHT_FAILED
    assert message == (
        "m-decode-0/vllm, m-decode-1/vllm, m-decode-2/vllm and 2 more refused to start: "
        "nixl_version: NIXL 1.4.2 is older than 1.5"
    )


def test_failed_inject_init_container_is_named() -> None:
    init = _status("kvferry-inject", message=INJECT, last=False)
    reason, message = podchecks.start_failure([_pod("m-prefill-0", "prefill", init=[init])])
    assert reason == Reason.INJECT_FAILED and "m-prefill-0/kvferry-inject" in message


@pytest.mark.parametrize(
    "pod",
    [
        _pod("a", "decode", main=[_status("vllm", running=True, message=PREFLIGHT)]),  # recovered since
        _pod("b", "decode", init=[_status("kvferry-inject", exit_code=0, last=False)]),  # init succeeded
        _pod("c", "decode", main=[_status("vllm", message="OOMKilled")]),  # not ours
        _pod("d", "router", main=[_status("router", message=PREFLIGHT)]),  # not an engine
    ],
)
def test_other_pod_states_are_not_start_up_refusals(pod: dict) -> None:
    assert podchecks.start_failure([pod]) is None


def test_ucx_on_efa_names_the_roles_that_run_it() -> None:
    from kvferry.operator.status import transfer as tm

    decode_only = tm.Sample(backends={"UCX"})
    state, reason, message = tm.health(tm.Sample(backends={"LIBFABRIC"}), decode_only, {}, True, 2)
    assert (state, reason) == ("False", Reason.WRONG_BACKEND)
    assert message.startswith("decode pods run NIXL backend UCX on EFA nodes")
