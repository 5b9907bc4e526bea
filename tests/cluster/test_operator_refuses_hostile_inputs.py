"""On the real API server (Kubernetes 1.35, CEL's quantity library): the CRD refuses the resource
quantities, identity env and image references of tests/unit/operator/hostile_cases.py, naming the
field, and promptly: a hostile exponent is stopped by the pattern before `isQuantity` parses it. The
bounded ones, digests included, are accepted."""

from __future__ import annotations

import pytest
import yaml
from kvferry.operator.reconcile.drift import is_subset

from tests.unit.operator.hostile_cases import HOSTILE_INVALID, HOSTILE_VALID


def test_hostile_inputs_are_refused_naming_the_field(control_plane, kvferry_crd, namespace) -> None:
    outcomes = {}
    for case, cr, field in HOSTILE_INVALID:
        body = {**cr, "metadata": {**cr["metadata"], "namespace": namespace}}
        res = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
        outcomes[case] = (res.returncode, res.stderr.strip(), field)
    accepted = [case for case, (rc, _, _) in outcomes.items() if rc == 0]
    assert not accepted, f"API server accepted hostile CRs: {accepted}"
    unnamed = {case: err for case, (_, err, field) in outcomes.items() if field not in err}
    assert not unnamed, unnamed


@pytest.mark.parametrize("case", sorted(HOSTILE_VALID))
def test_bounded_inputs_are_accepted_as_given(cluster, kvferry_crd, case) -> None:
    cluster.apply(HOSTILE_VALID[case])
    stored = cluster.cr(HOSTILE_VALID[case]["metadata"]["name"])
    assert is_subset(HOSTILE_VALID[case]["spec"], stored["spec"]), stored["spec"]  # as given, plus defaults
