"""The real API server rejects invalid DisaggregatedInferences (schema + CEL) with messages naming the
field, and accepts the valid ones with defaults filled in."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.operator.cases import INVALID, VALID


def test_invalid_crs_are_rejected_naming_the_field(control_plane, kvferry_crd, namespace) -> None:
    outcomes = {}
    for case, cr, field in INVALID:
        body = {**cr, "metadata": {**cr["metadata"], "namespace": namespace}}
        res = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
        outcomes[case] = (res.returncode, res.stderr.strip(), field)
    accepted = [case for case, (rc, _, _) in outcomes.items() if rc == 0]
    assert not accepted, f"API server accepted invalid CRs: {accepted}"
    # The message must name the offending field (the API server prints the path without the leading dot).
    unnamed = {case: err for case, (_, err, field) in outcomes.items() if field not in err}
    assert not unnamed, unnamed
    assert len(outcomes) >= 10


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_crs_are_accepted_with_defaults(cluster, kvferry_crd, case) -> None:
    cluster.apply(VALID[case])
    stored = cluster.cr(VALID[case]["metadata"]["name"])
    assert stored["spec"]["kvTransfer"]["leaseSeconds"] == 30
    assert stored["spec"]["router"]["policy"] == "least-loaded"
    assert stored["spec"]["prefill"]["replicasOwner"] == "spec"
