"""Router config: a valid file parses; every kind of mistake fails with the path that is wrong."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from kvferry.router.config import ConfigError, TpSize, load_config, parse_config, read_api_key

from tests.unit.docedit import mutated

VALID: dict[str, Any] = {
    "listen": {"host": "127.0.0.1", "port": 8000},
    "mode": "kvferry",
    "model": "tiny",
    "policy": "least-loaded",
    "deadlines": {"prefill_s": 60, "decode_first_token_s": 60, "transfer_s": 30, "total_s": 600},
    "limits": {"max_in_flight_per_engine": 64, "recompute_ratio": 0.1, "recompute_burst": 5},
    "discovery": {
        "static": {
            "prefill": [{"url": "http://127.0.0.1:8100", "engine_id": "prefill-0", "side_host": "127.0.0.1",
                         "side_port": 5600, "tp_size": 1, "revision": "r1"}],
            "decode": [{"url": "http://127.0.0.1:8200", "engine_id": "decode-0", "side_host": "127.0.0.1",
                        "side_port": 5601, "tp_size": 1, "revision": "r1"}],
        }
    },
}  # fmt: skip


def test_contract_example_parses() -> None:
    cfg = parse_config(VALID)
    assert cfg.mode == "kvferry" and cfg.port == 8000 and cfg.deadlines.transfer_s == 30
    assert cfg.static is not None
    assert [e.engine_id for e in cfg.static["decode"]] == ["decode-0"]
    assert cfg.static["prefill"][0].side_port == 5600 and cfg.static["prefill"][0].role == "prefill"
    assert (cfg.limits.max_in_flight_per_engine, cfg.limits.recompute_ratio) == (64, 0.1)
    assert cfg.limits.recompute_burst == 5


def test_limits_default_when_absent() -> None:
    doc = copy.deepcopy(VALID)
    del doc["limits"]
    limits = parse_config(doc).limits
    assert (limits.max_in_flight_per_engine, limits.recompute_ratio, limits.recompute_burst) == (256, 0.2, 10)
    partial = parse_config({**VALID, "limits": {"recompute_ratio": 0}}).limits
    assert partial.recompute_ratio == 0 and partial.max_in_flight_per_engine == 256


def test_kubernetes_discovery_parses_with_defaults() -> None:
    doc = copy.deepcopy(VALID)
    doc["discovery"] = {
        "kubernetes": {"namespace": "ns", "prefill_service": "a-prefill", "decode_service": "a-decode"}
    }
    cfg = parse_config(doc)
    assert cfg.kubernetes is not None and cfg.kubernetes.revision_label == "kvferry.io/revision"
    assert cfg.kubernetes.tp_size == TpSize(prefill=1, decode=1)
    kube = doc["discovery"]["kubernetes"]
    partial = parse_config(mutated(doc, ["discovery", "kubernetes", "tp_size"], {"decode": 2})).kubernetes
    assert partial is not None and partial.tp_size == TpSize(prefill=1, decode=2)
    assert (partial.tp_size.of("prefill"), partial.tp_size.of("decode")) == (1, 2)
    for tp_size, message in (
        ({"router": 2}, "tp_size: unknown key(s) ['router']"),
        ({"prefill": 0}, "tp_size.prefill: expected a positive"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"discovery.kubernetes.{message}")):
            parse_config(mutated(doc, ["discovery", "kubernetes"], {**kube, "tp_size": tp_size}))


def test_an_unquoted_numeric_revision_is_a_string() -> None:
    cfg = parse_config(mutated(VALID, ["discovery", "static", "decode", 0, "revision"], 1234))
    assert cfg.static is not None and cfg.static["decode"][0].revision == "1234"


def _broken(path: list[Any], value: Any) -> dict[str, Any]:
    return mutated(VALID, path, value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["mode"], "push", "mode: 'push' is not one of"),
        (["mode"], KeyError, "missing required key(s) ['mode']"),
        (["policy"], "random", "policy: 'random' is not one of"),
        (["listen", "port"], 70000, "listen.port: port 70000 is out of range"),
        (["listen", "bind"], "x", "listen: unknown key(s) ['bind']"),
        (["deadlines", "total_s"], -1, "deadlines.total_s: expected a positive number"),
        (["deadlines", "prefill_s"], 900, "deadlines.prefill_s: 900.0 exceeds total_s"),
        (["discovery", "static", "decode"], [], "discovery.static.decode: expected a non-empty list"),
        (["discovery", "static", "decode", 0, "url"], "127.0.0.1:8200", "discovery.static.decode[0].url: "),
        (["discovery", "static", "decode", 0, "engine_id"], KeyError, "decode[0]: missing required key(s)"),
        (["discovery", "static", "decode", 0, "engine_id"], "prefill-0", "used more than once"),
        (["discovery", "static", "prefill", 0, "tp_size"], 1.5, "prefill[0].tp_size: expected an integer"),
        (
            ["discovery", "kubernetes"],
            {"namespace": "x"},
            "discovery: give exactly one of static, kubernetes",
        ),
        (["auth"], {"api_key_env": "A", "api_key_file": "/k"}, "auth: give exactly one of"),
        (["limits", "max_in_flight_per_engine"], 0, "limits.max_in_flight_per_engine: expected a positive"),
        (["limits", "max_in_flight_per_engine"], 2.5, "limits.max_in_flight_per_engine: expected an integer"),
        (["limits", "recompute_ratio"], 1.5, "limits.recompute_ratio: expected a number from 0 to 1"),
        (["limits", "recompute_ratio"], True, "limits.recompute_ratio: expected a number from 0 to 1"),
        (["limits", "recompute_burst"], -1, "limits.recompute_burst: expected a non-negative integer"),
        (["limits", "max_queue"], 3, "limits: unknown key(s) ['max_queue']"),
        (["listen", "port"], "80", "listen.port: expected an integer, got '80'"),
        (["deadlines"], [60], "deadlines: expected a mapping, got list"),
        (["auth"], {"api_key_env": ""}, "auth.api_key_env: expected a non-empty string"),
        (["discovery", "static", "decode", 0, "revision"], [1], "decode[0].revision: expected"),
        (
            ["discovery", "static", "decode", 0],
            "x",
            "discovery.static.decode[0]: expected a mapping, got 'x'",
        ),
    ],
)
def test_bad_config_names_the_path(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_broken(path, value))
    assert message in str(err.value)


def test_not_a_mapping_and_bad_yaml(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="config: expected a mapping, got list"):
        parse_config([1])
    bad = tmp_path / "router.yaml"
    bad.write_text("mode: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_api_key_sources(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_api_key(parse_config(VALID).auth) is None
    monkeypatch.setenv("ROUTER_KEY", "s3cret")
    assert read_api_key(parse_config({**VALID, "auth": {"api_key_env": "ROUTER_KEY"}}).auth) == "s3cret"
    monkeypatch.delenv("ROUTER_KEY")
    with pytest.raises(ConfigError, match="ROUTER_KEY is unset or empty"):
        read_api_key(parse_config({**VALID, "auth": {"api_key_env": "ROUTER_KEY"}}).auth)
    key_file = tmp_path / "key"
    key_file.write_text("filekey\n")
    assert read_api_key(parse_config({**VALID, "auth": {"api_key_file": str(key_file)}}).auth) == "filekey"
