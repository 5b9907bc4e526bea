"""The CR is parsed once, where a handler receives it: render, status and autoscale read the typed object."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render.objects import render
from kvferry.operator.spec import Inference, SpecError, inference
from kvferry.operator.status import gang
from kvferry.operator.status.publish import desired_replicas

from tests.unit.operator.cases import make_inference


def _body() -> dict[str, Any]:
    body = make_inference("svc", namespace="ns").obj()
    body["metadata"] |= {"uid": "u-1", "generation": 4, "resourceVersion": "17"}
    return body


def test_metadata_and_spec_are_typed() -> None:
    cr = Inference.of(_body())
    assert (cr.meta.name, cr.meta.namespace, cr.meta.uid) == ("svc", "ns", "u-1")
    assert (cr.meta.generation, cr.meta.resource_version, cr.meta.deleting) == (4, "17", False)
    assert cr.valid and cr.spec.prefill.replicas == 1 and cr.revision == ""


def test_render_and_status_reuse_the_one_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str | None] = []
    real = inference.parse_spec

    def counting(spec: Any, name: str | None = None) -> Any:
        calls.append(name)
        return real(spec, name)

    monkeypatch.setattr(inference, "parse_spec", counting)
    cr = Inference.of(_body())
    rendered = render(cr)
    assert gang.observe_if_kueue(None, cr) is None  # type: ignore[arg-type]  # no gang: nothing read
    assert desired_replicas(cr) == {"prefill": 1, "decode": 1}
    assert calls == ["svc"]  # render, gang and status took the parsed spec
    owner = rendered.objects[0]["metadata"]["ownerReferences"][0]
    assert (owner["name"], owner["uid"]) == ("svc", "u-1")


def test_an_invalid_spec_is_kept_as_its_error() -> None:
    body = _body()
    body["spec"]["prefill"] = {"replicas": "two"}
    body["status"] = {"prefill": {"desired": 3}}
    cr = Inference.of(body)
    assert not cr.valid
    with pytest.raises(SpecError, match="spec.prefill.replicas"):
        cr.spec  # noqa: B018
    with pytest.raises(SpecError, match="spec.prefill.replicas"):
        render(cr)
    # Status keeps the desired counts it last showed: an invalid spec has none to trust.
    assert desired_replicas(cr) == {"prefill": 3, "decode": 1}
