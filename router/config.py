"""Router config step: parse and validate `router.yaml` (docs/contracts.md §2) into typed settings.

The file's shape is declared below as msgspec Structs (unknown keys refused, bounds by msgspec.Meta) and
converted in one call. Every error names the offending path (`discovery.static.decode[0].url: ...`) so
a bad ConfigMap fails at start with a message that says what to fix; a Meta's extra["error"] words the
errors of the values it annotates (extra["type_error"] those of a wrong type, when it differs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect as mi

Mode = Literal["kvferry", "vllm-push", "vllm-pull"]
Policy = Literal["least-loaded", "round-robin"]
Rule = Literal["always", "selective"]
MODES: tuple[str, ...] = get_args(Mode)
POLICIES: tuple[str, ...] = get_args(Policy)
ROLES = ("prefill", "decode")

Text = Annotated[str, msgspec.Meta(min_length=1, extra={"error": "expected a non-empty string"})]
Positive = Annotated[float, msgspec.Meta(gt=0, extra={"error": "expected a positive number"})]
_INTEGER = "expected an integer"
PositiveInt = Annotated[
    int, msgspec.Meta(gt=0, extra={"error": "expected a positive number", "type_error": _INTEGER})
]
Count = Annotated[int, msgspec.Meta(ge=0, extra={"error": "expected a non-negative integer"})]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1, extra={"error": "expected a number from 0 to 1"})]
Port = Annotated[
    int,
    msgspec.Meta(
        ge=1, le=65535, extra={"error": "port {value!r} is out of range 1-65535", "type_error": _INTEGER}
    ),
]


class ConfigError(ValueError):
    """A router config that cannot work; the message names the path and the problem."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A mapping of router.yaml (mypy wants frozen=True and kw_only=True on each subclass)."""


@dataclass(frozen=True)
class Endpoint:
    """One vLLM engine: its HTTP URL and the NIXL identity its peer needs."""

    role: str
    url: str
    engine_id: str
    side_host: str
    side_port: int
    tp_size: int = 1
    revision: str = ""
    # Where it runs, broadest first: zone, network-node layers 1..3 (router/topology.py); () unknown.
    topology: tuple[str, ...] = ()
    # vLLM's KV-cache event stream (ZMQ PUB) and replay (ROUTER) endpoints (tcp:// or ipc://); "" none
    # (router/kvfeed.py follows them into the prefix index).
    kv_events: str = ""
    kv_events_replay: str = ""


class Deadlines(_Section, frozen=True, kw_only=True):
    prefill_s: Positive = 60.0
    decode_first_token_s: Positive = 60.0
    transfer_s: Positive = 30.0
    total_s: Positive = 600.0


class Limits(_Section, frozen=True, kw_only=True):
    """Overload control. The in-flight limit counts the legs this router has open on one engine
    (vLLM's default max_num_seqs is 256: beyond that requests only queue inside the engine). The
    recompute budget lets local recomputes add at most recompute_ratio of recent requests' work,
    plus a burst of recompute_burst. A request the prefill engine would queue longer than
    max_prefill_wait_s (unset: deadlines.prefill_s, where its leg would time out anyway) is refused
    with 429 before it costs anything (router/backlog.py)."""

    max_in_flight_per_engine: PositiveInt = 256
    max_prefill_wait_s: Positive | None = None
    recompute_ratio: Fraction = 0.2
    recompute_burst: Count = 10


DecodeStart = Literal["with-prefill", "before-prefill"]


class Push(_Section, frozen=True, kw_only=True):
    """When decode's leg opens (router/dispatch.py). with-prefill: together with prefill's, so decode
    registers its blocks while prefill computes. before-prefill (mode kvferry only; its default): once
    the router's backlog estimate (router/backlog.py) says prefill starts the request within
    decode_lead_s, or when prefill's leg ends, whichever comes first; past saturation decode then
    holds blocks only for requests whose KV is on its way instead of for prefill's whole queue (the
    kvferry producer keeps finished KV for a late registration until its lease ends). Unset: per mode."""

    decode_start: DecodeStart | None = None
    decode_lead_s: Positive = 0.25


FirstToken = Literal["decode", "prefill"]


class Streaming(_Section, frozen=True, kw_only=True):
    """Where a streaming client's first token comes from (router/early.py). decode: decode's stream,
    relayed as it comes. prefill: for greedy requests (temperature 0), prefill's own sampled token is
    sent the moment prefill's leg returns, and decode's copy of it is checked and dropped."""

    first_token: FirstToken = "decode"


class Disaggregation(_Section, frozen=True, kw_only=True):
    """Whether a request pays for P/D (router/scoring.py): always, or selective, where decode alone
    serves a request whose tokens decode lacks are fewer than min_prefill_tokens, or whose prompt
    decode already holds at least decode_hit_fraction of (if decode holds at least as much as prefill)."""

    rule: Rule = "always"
    min_prefill_tokens: Count = 256
    decode_hit_fraction: Fraction = 0.8


class Routing(_Section, frozen=True, kw_only=True):
    """Prefix-aware selection (router/prefix.py, router/scoring.py). block_tokens is the engines' KV
    block size; chars_per_token turns text into estimated tokens (the router does not tokenize);
    load_bound is how many requests busier than the least-loaded engine a prefix holder may be and
    still win; index_blocks_per_engine bounds what the router remembers per engine. prefix_aware
    unset means on with policy least-loaded, off with round-robin (which ignores caches by design)."""

    prefix_aware: bool | None = None
    block_tokens: PositiveInt = 16
    chars_per_token: Positive = 4.0
    load_bound: Annotated[float, msgspec.Meta(ge=0, extra={"error": "expected a non-negative number"})] = 2.0
    index_blocks_per_engine: PositiveInt = 65536
    disaggregation: Disaggregation = Disaggregation()


class AuthConfig(_Section, frozen=True, kw_only=True):
    """Where the API key comes from (never the key itself: configs end up in ConfigMaps)."""

    api_key_env: Text | None = None
    api_key_file: Text | None = None


class TpSize(_Section, frozen=True, kw_only=True):
    prefill: PositiveInt = 1
    decode: PositiveInt = 1

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


class KubernetesDiscoveryConfig(_Section, frozen=True, kw_only=True):
    """discovery.kubernetes as written, and as the router uses it (discovery.py)."""

    namespace: Text
    prefill_service: Text
    decode_service: Text
    revision_label: Text = "kvferry.io/revision"
    tp_size: TpSize = TpSize()
    poll_s: Positive = 5.0
    kv_events_port: Port | None = None  # each engine pod's KV-event publisher port, if it publishes
    kv_events_replay_port: Port | None = None


@dataclass(frozen=True)
class RouterConfig:
    mode: str
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    policy: str = "least-loaded"
    deadlines: Deadlines = Deadlines()
    limits: Limits = Limits()
    static: dict[str, tuple[Endpoint, ...]] | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None
    auth: AuthConfig = AuthConfig()
    routing: Routing = Routing()
    push: Push = Push()
    streaming: Streaming = Streaming()


# router.yaml as written; parse_config turns it into the settings above.
class _Listen(_Section, frozen=True, kw_only=True):
    host: Text = "127.0.0.1"
    port: Port = 8000


class _Engine(_Section, frozen=True, kw_only=True):
    url: Text
    engine_id: Text
    side_host: Text
    side_port: Port
    tp_size: PositiveInt = 1
    revision: str | int | float = ""  # YAML reads an unquoted 1234 as a number
    topology: tuple[str, ...] = ()  # zone, then network-node layers 1..3 (router/topology.py)
    kv_events: str = ""  # the engine's KV-event publisher (tcp://host:port or ipc:///path)
    kv_events_replay: str = ""  # its replay endpoint


Engines = Annotated[
    list[_Engine], msgspec.Meta(min_length=1, extra={"error": "expected a non-empty list of endpoints"})
]


class _Static(_Section, frozen=True, kw_only=True):
    prefill: Engines
    decode: Engines


class _Discovery(_Section, frozen=True, kw_only=True):
    static: _Static | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None


class _File(_Section, frozen=True, kw_only=True):
    listen: _Listen = _Listen()
    mode: Mode
    model: Text | None = None
    policy: Policy = "least-loaded"
    deadlines: Deadlines = Deadlines()
    limits: Limits = Limits()
    discovery: _Discovery
    auth: AuthConfig | None = None
    routing: Routing = Routing()
    push: Push = Push()
    streaming: Streaming = Streaming()


def parse_config(raw: Any) -> RouterConfig:
    """Validate a decoded router.yaml document."""
    discovery = raw.get("discovery") if isinstance(raw, dict) else None
    if isinstance(discovery, dict) and {"static", "kubernetes"} <= discovery.keys():  # before either's checks
        raise ConfigError("discovery: give exactly one of static, kubernetes")
    try:
        doc = msgspec.convert(raw, _File)
    except msgspec.ValidationError as exc:
        raise _named(exc, raw) from None
    for name in ("prefill_s", "decode_first_token_s"):
        if getattr(doc.deadlines, name) > doc.deadlines.total_s:
            raise ConfigError(
                f"deadlines.{name}: {getattr(doc.deadlines, name)} exceeds total_s {doc.deadlines.total_s}"
            )
    found = doc.discovery
    if (found.static is None) == (found.kubernetes is None):
        raise ConfigError("discovery: give exactly one of static, kubernetes")
    if doc.auth is not None and (doc.auth.api_key_env is None) == (doc.auth.api_key_file is None):
        raise ConfigError("auth: give exactly one of api_key_env, api_key_file")
    if doc.policy == "round-robin" and doc.routing.prefix_aware:
        raise ConfigError(
            "routing.prefix_aware: needs policy least-loaded (round-robin ignores where prefixes are "
            "cached); set prefix_aware: false or policy: least-loaded"
        )
    if doc.push.decode_start == "before-prefill" and doc.mode != "kvferry":
        raise ConfigError(
            f"push.decode_start: 'before-prefill' needs mode kvferry (mode is {doc.mode}: "
            "upstream's connector does not keep finished KV for a registration that arrives after it)"
        )
    default_start = "before-prefill" if doc.mode == "kvferry" else "with-prefill"
    push = msgspec.structs.replace(doc.push, decode_start=doc.push.decode_start or default_start)
    prefix_aware = doc.routing.prefix_aware
    if prefix_aware is None:
        prefix_aware = doc.policy == "least-loaded"
    return RouterConfig(
        mode=doc.mode,
        host=doc.listen.host,
        port=doc.listen.port,
        model=doc.model,
        policy=doc.policy,
        deadlines=doc.deadlines,
        limits=doc.limits,
        static=None if found.static is None else _static(found.static, "discovery.static"),
        kubernetes=found.kubernetes,
        auth=doc.auth or AuthConfig(),
        routing=msgspec.structs.replace(doc.routing, prefix_aware=prefix_aware),
        push=push,
        streaming=doc.streaming,
    )


def _static(static: _Static, path: str) -> dict[str, tuple[Endpoint, ...]]:
    out = {
        role: tuple(_endpoint(e, role, f"{path}.{role}[{i}]") for i, e in enumerate(getattr(static, role)))
        for role in ROLES
    }
    engine_ids = [e.engine_id for role in ROLES for e in out[role]]
    dupes = sorted({e for e in engine_ids if engine_ids.count(e) > 1})
    if dupes:
        raise ConfigError(f"{path}: engine_id(s) {dupes} used more than once; NIXL needs unique ids")
    return out


def _endpoint(e: _Engine, role: str, path: str) -> Endpoint:
    parts = urlsplit(e.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{path}.url: {e.url!r} is not an http(s) URL with a host")
    for name in ("kv_events", "kv_events_replay"):
        value = getattr(e, name)
        if value and not re.fullmatch(r"tcp://(?:[^:/\s\[\]]+|\[[0-9a-fA-F:]+\]):\d{1,5}|ipc:///\S+", value):
            raise ConfigError(
                f"{path}.{name}: {value!r} is not a ZMQ endpoint (tcp://host:port or ipc:///path)"
            )
    if e.kv_events_replay and not e.kv_events:
        raise ConfigError(f"{path}.kv_events_replay: needs kv_events (the live stream) too")
    fields = msgspec.structs.asdict(e)
    return Endpoint(role=role, **{**fields, "url": e.url.rstrip("/"), "revision": str(e.revision)})


# msgspec says `Expected `int` <= 65535 - at `$.listen.port``; the Meta's words say what that means here.
_AT = re.compile(r"(?P<what>.*?)(?: - at (?:`key` in )?`\$(?P<path>.*)`)?", re.DOTALL)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_FIELD = re.compile(r"Object (?P<kind>missing required|contains unknown) field `(?P<name>.*)`")
_TYPE = re.compile(r"Expected `(?P<want>[^`]+)`, got `\w+`")
_NOUNS = {
    "object": "a mapping",
    "array": "a list",
    "str": "a string",
    "int": "an integer",
    "float": "a number",
}


def _named(exc: msgspec.ValidationError, raw: Any) -> ConfigError:
    match = _AT.fullmatch(str(exc))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or ""
    where = path.lstrip(".") or "config"
    info: Any = mi.type_info(_File)
    value = raw
    for name, index in _STEP.findall(path):  # walk the declared type and the input to the bad value
        info = _unwrap(info)[0]
        if name:
            info = next(f.type for f in info.fields if f.encode_name == name)
            value = value.get(name) if isinstance(value, dict) else None
        else:
            info = info.item_type
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
    info, words = _unwrap(info)
    if m := _FIELD.fullmatch(what):
        if m["kind"] == "missing required":
            return ConfigError(f"{where}: missing required key(s) [{m['name']!r}]")
        allowed = sorted(f.encode_name for f in info.fields)
        return ConfigError(f"{where}: unknown key(s) [{m['name']!r}]; allowed: {allowed}")
    if what.startswith("Invalid enum value"):
        return ConfigError(f"{where}: {value!r} is not one of {list(info.values)}")
    wrong_type = _TYPE.fullmatch(what)
    said = words.get("type_error" if wrong_type and "type_error" in words else "error")
    if said:
        return ConfigError(
            f"{where}: " + (said.format(value=value) if "{value" in said else f"{said}, got {value!r}")
        )
    if wrong_type:
        want = " or ".join(_NOUNS.get(w, w) for w in wrong_type["want"].split(" | "))
        got = type(value).__name__ if isinstance(value, dict | list) else repr(value)
        return ConfigError(f"{where}: expected {want}, got {got}")
    return ConfigError(f"{where}: {what}")


def _unwrap(info: Any) -> tuple[Any, dict[str, str]]:
    """The type under an `| None` and a Meta, and the Meta's words."""
    if isinstance(info, mi.UnionType):
        types = [t for t in info.types if not isinstance(t, mi.NoneType)]
        info = types[0] if len(types) == 1 else info
    if isinstance(info, mi.Metadata):
        return info.type, info.extra or {}
    return info, {}


def load_config(path: str | Path) -> RouterConfig:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(raw)


def read_api_key(auth: AuthConfig) -> str | None:
    """The configured API key, or None when auth is off. Never logged."""
    import os

    if auth.api_key_env:
        key = os.environ.get(auth.api_key_env, "")
        if not key:
            raise ConfigError(f"auth.api_key_env: environment variable {auth.api_key_env} is unset or empty")
        return key
    if auth.api_key_file:
        try:
            key = Path(auth.api_key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"auth.api_key_file: cannot read {auth.api_key_file}: {exc.strerror}") from exc
        if not key:
            raise ConfigError(f"auth.api_key_file: {auth.api_key_file} is empty")
        return key
    return None
