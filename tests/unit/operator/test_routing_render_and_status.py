"""Issue 18 on the operator side: the CR's router.routing reaches the router's config as the router
parses it, bad values are refused naming the field, and the prefix hit rate reaches status.transfer."""

from __future__ import annotations

import pytest
import yaml
from kvferry.codegen.crdgen import PRINTER_COLUMNS
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError, parse_spec
from kvferry.operator.status import transfer as tm
from kvferry.router.config import parse_config

from tests.unit.operator.cases import make_inference

SELECTIVE = {
    "loadBound": 3,
    "charsPerToken": 3.5,
    "disaggregation": {"rule": "selective", "minPrefillTokens": 512, "decodeHitPercent": 90},
}


def _router_config(cr: dict) -> object:
    cm = next(o for o in render(cr).objects if o["kind"] == "ConfigMap")
    return parse_config(yaml.safe_load(cm["data"]["router.yaml"]))


def test_the_rendered_router_config_carries_the_crs_rule() -> None:
    cfg = _router_config(make_inference("c", namespace="ns").router(routing=SELECTIVE).obj())
    r = cfg.routing  # type: ignore[attr-defined]
    assert (r.prefix_aware, r.load_bound, r.chars_per_token, r.block_tokens) == (True, 3, 3.5, 128)
    d = r.disaggregation
    assert (d.rule, d.min_prefill_tokens, d.decode_hit_fraction) == ("selective", 512, 0.9)


def test_defaults_disaggregate_always_and_block_size_follows_the_engines() -> None:
    cr = make_inference("c", namespace="ns", accelerator="p5en").vllm(blockSize=32).obj()
    r = _router_config(cr).routing  # type: ignore[attr-defined]
    assert (r.prefix_aware, r.block_tokens, r.disaggregation.rule) == (True, 32, "always")
    rr = make_inference("c", namespace="ns").router(policy="round-robin").obj()
    assert _router_config(rr).routing.prefix_aware is False  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("routing", "words"),
    [
        ({"disaggregation": {"rule": "sometimes"}}, "router.routing.disaggregation.rule"),
        ({"disaggregation": {"decodeHitPercent": 0}}, "router.routing.disaggregation.decodeHitPercent"),
        ({"loadBound": -1}, "router.routing.loadBound"),
        ({"prefixAwre": True}, "prefixAwre"),
    ],
)
def test_bad_routing_is_refused_naming_the_field(routing: dict, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"model": "m", "router": {"routing": routing}})
    assert words in str(err.value)


def _vllm(queries: int, hits: int) -> str:
    return (
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    )


def test_prefix_hit_rate_sums_both_roles() -> None:
    summary, _ = tm.summarize(
        [_vllm(1000, 300)], [_vllm(1000, 500)], previous={}, mode="push", efa=False, now="t"
    )
    assert (summary["prefixHitTokens"], summary["prefixQueryTokens"]) == (800, 2000)
    assert summary["prefixHitRate"] == "40%"
    none, _ = tm.summarize([_vllm(0, 0)], [], previous={}, mode="push", efa=False, now="t")
    assert none["prefixHitRate"] == ""


def test_kubectl_get_shows_the_prefix_hit_rate_after_the_existing_columns() -> None:
    names = [c["name"] for c in PRINTER_COLUMNS]
    assert names.index("Prefix-Hit") == names.index("Xfer-P50") + 1
    column = next(c for c in PRINTER_COLUMNS if c["name"] == "Prefix-Hit")
    assert column["jsonPath"] == ".status.transfer.prefixHitRate"
