"""Autoscale handlers: the kopf timer that runs one evaluation per autoscaled CR, and its clean-up.

Registered from operator/runtime/handlers.py (`register`), beside the transfer-status timer and at its
interval (KVFERRY_METRICS_INTERVAL); only CRs with `spec.autoscaling` get the timer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf
from kvferry.operator.autoscale.loop import Autoscaler
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import GROUP, PLURAL, VERSION, Inference, Meta
from kvferry.operator.status.publish import Watched

CR = (GROUP, VERSION, PLURAL)


def autoscaled(spec: Any, **_: Any) -> bool:
    return bool((spec or {}).get("autoscaling"))


def register(
    registry: kopf.OperatorRegistry,
    cfg: OperatorConfig,
    *,
    plain: Callable[[Any], dict[str, Any]],
    watched_by: Callable[[Any, Any], Watched],
    when: Callable[..., bool] | None = None,
) -> Autoscaler:
    """Attach the autoscale timer; `when` narrows the CRs further (e.g. this operator's shard)."""
    autoscaler = Autoscaler()

    def wanted(**kw: Any) -> bool:
        return autoscaled(**kw) and (when is None or when(**kw))

    @kopf.timer(
        *CR, id="autoscale", interval=cfg.metrics_interval, initial_delay=2.0, when=wanted, registry=registry
    )
    def autoscale(body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
        watched = watched_by(kw.get("owned"), body)  # kopf passes its indexes by name
        cr = Inference.of(plain(body))  # parsed once: the evaluation reads the typed CR
        for kind, reason, message in autoscaler.evaluate(memo.kube, cr, cfg, memo.fetch, watched):
            (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason.value, message=message[:1000])

    @kopf.on.delete(*CR, id="autoscale-forget", optional=True, registry=registry)
    def forget(body: kopf.Body, **_: Any) -> None:
        autoscaler.forget(Meta.of(body.get("metadata")))

    return autoscaler
