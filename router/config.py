"""Router config step: parse and validate `router.yaml` (docs/contracts.md §2) into typed settings.

Every error names the offending path (`discovery.static.decode[0].url: ...`) so a bad ConfigMap
fails at start with a message that says what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MODES = ("kvferry", "vllm-push", "vllm-pull")
POLICIES = ("least-loaded", "round-robin")
ROLES = ("prefill", "decode")


class ConfigError(ValueError):
    """A router config that cannot work; the message names the path and the problem."""


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


@dataclass(frozen=True)
class Deadlines:
    prefill_s: float = 60.0
    decode_first_token_s: float = 60.0
    transfer_s: float = 30.0
    total_s: float = 600.0


@dataclass(frozen=True)
class Limits:
    """Overload control. The in-flight limit counts the legs this router has open on one engine
    (vLLM's default max_num_seqs is 256: beyond that requests only queue inside the engine). The
    recompute budget lets local recomputes add at most recompute_ratio of recent requests' work,
    plus a burst of recompute_burst."""

    max_in_flight_per_engine: int = 256
    recompute_ratio: float = 0.2
    recompute_burst: int = 10


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    namespace: str
    prefill_service: str
    decode_service: str
    revision_label: str = "kvferry.io/revision"
    tp_size: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    poll_s: float = 5.0


@dataclass(frozen=True)
class AuthConfig:
    """Where the API key comes from (never the key itself: configs end up in ConfigMaps)."""

    api_key_env: str | None = None
    api_key_file: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    mode: str
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    policy: str = "least-loaded"
    deadlines: Deadlines = field(default_factory=Deadlines)
    limits: Limits = field(default_factory=Limits)
    static: dict[str, tuple[Endpoint, ...]] | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)


def _mapping(value: Any, path: str, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(value))
    if missing:
        raise ConfigError(f"{path}: missing required key(s) {missing}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}")
    return str(value)


def _positive(value: Any, path: str, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{path}: expected a positive number, got {value!r}")
    if kind is int and int(value) != value:
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    return kind(value)


def _count(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path}: expected a non-negative integer, got {value!r}")
    return value


def _fraction(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{path}: expected a number from 0 to 1, got {value!r}")
    return float(value)


def _port(value: Any, path: str) -> int:
    port = _positive(value, path, int)
    if port > 65535:
        raise ConfigError(f"{path}: port {port} is out of range 1-65535")
    return port


def _url(value: Any, path: str) -> str:
    url = _str(value, path)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{path}: {url!r} is not an http(s) URL with a host")
    return url.rstrip("/")


def _endpoint(value: Any, path: str, role: str) -> Endpoint:
    keys = {"url", "engine_id", "side_host", "side_port", "tp_size", "revision"}
    raw = _mapping(value, path, keys, {"url", "engine_id", "side_host", "side_port"})
    return Endpoint(
        role=role,
        url=_url(raw["url"], f"{path}.url"),
        engine_id=_str(raw["engine_id"], f"{path}.engine_id"),
        side_host=_str(raw["side_host"], f"{path}.side_host"),
        side_port=_port(raw["side_port"], f"{path}.side_port"),
        tp_size=_positive(raw.get("tp_size", 1), f"{path}.tp_size", int),
        revision=str(raw.get("revision", "")),
    )


def _static(value: Any, path: str) -> dict[str, tuple[Endpoint, ...]]:
    raw = _mapping(value, path, set(ROLES), set(ROLES))
    out: dict[str, tuple[Endpoint, ...]] = {}
    for role in ROLES:
        items = raw[role]
        if not isinstance(items, list) or not items:
            raise ConfigError(f"{path}.{role}: expected a non-empty list of endpoints")
        out[role] = tuple(_endpoint(item, f"{path}.{role}[{i}]", role) for i, item in enumerate(items))
    engine_ids = [e.engine_id for role in ROLES for e in out[role]]
    dupes = sorted({e for e in engine_ids if engine_ids.count(e) > 1})
    if dupes:
        raise ConfigError(f"{path}: engine_id(s) {dupes} used more than once; NIXL needs unique ids")
    return out


def _kubernetes(value: Any, path: str) -> KubernetesDiscoveryConfig:
    keys = {"namespace", "prefill_service", "decode_service", "revision_label", "tp_size", "poll_s"}
    raw = _mapping(value, path, keys, {"namespace", "prefill_service", "decode_service"})
    tp_raw = _mapping(raw.get("tp_size", {}), f"{path}.tp_size", set(ROLES))
    tp = {role: _positive(tp_raw.get(role, 1), f"{path}.tp_size.{role}", int) for role in ROLES}
    return KubernetesDiscoveryConfig(
        namespace=_str(raw["namespace"], f"{path}.namespace"),
        prefill_service=_str(raw["prefill_service"], f"{path}.prefill_service"),
        decode_service=_str(raw["decode_service"], f"{path}.decode_service"),
        revision_label=_str(raw.get("revision_label", "kvferry.io/revision"), f"{path}.revision_label"),
        tp_size=tp,
        poll_s=_positive(raw.get("poll_s", 5.0), f"{path}.poll_s"),
    )


def _deadlines(value: Any, path: str) -> Deadlines:
    names = {"prefill_s", "decode_first_token_s", "transfer_s", "total_s"}
    raw = _mapping(value, path, names)
    d = Deadlines(**{k: _positive(v, f"{path}.{k}") for k, v in raw.items()})
    for name in ("prefill_s", "decode_first_token_s"):
        if getattr(d, name) > d.total_s:
            raise ConfigError(f"{path}.{name}: {getattr(d, name)} exceeds total_s {d.total_s}")
    return d


def _limits(value: Any, path: str) -> Limits:
    checks = {
        "max_in_flight_per_engine": lambda v, p: _positive(v, p, int),
        "recompute_ratio": _fraction,
        "recompute_burst": _count,
    }
    raw = _mapping(value, path, set(checks))
    return Limits(**{k: checks[k](v, f"{path}.{k}") for k, v in raw.items()})


def _auth(value: Any, path: str) -> AuthConfig:
    raw = _mapping(value, path, {"api_key_env", "api_key_file"})
    if len(raw) != 1:
        raise ConfigError(f"{path}: give exactly one of api_key_env, api_key_file")
    key, source = next(iter(raw.items()))
    return AuthConfig(**{key: _str(source, f"{path}.{key}")})


def parse_config(raw: Any) -> RouterConfig:
    """Validate a decoded router.yaml document."""
    keys = {"listen", "mode", "model", "policy", "deadlines", "limits", "discovery", "auth"}
    doc = _mapping(raw, "config", keys, {"mode", "discovery"})
    listen = _mapping(doc.get("listen", {}), "listen", {"host", "port"})
    discovery = _mapping(doc["discovery"], "discovery", {"static", "kubernetes"})
    if len(discovery) != 1:
        raise ConfigError("discovery: give exactly one of static, kubernetes")
    model = doc.get("model")
    return RouterConfig(
        mode=_choice(doc["mode"], "mode", MODES),
        host=_str(listen.get("host", "127.0.0.1"), "listen.host"),
        port=_port(listen.get("port", 8000), "listen.port"),
        model=None if model is None else _str(model, "model"),
        policy=_choice(doc.get("policy", "least-loaded"), "policy", POLICIES),
        deadlines=_deadlines(doc.get("deadlines", {}), "deadlines"),
        limits=_limits(doc.get("limits", {}), "limits"),
        static=_static(discovery["static"], "discovery.static") if "static" in discovery else None,
        kubernetes=(
            _kubernetes(discovery["kubernetes"], "discovery.kubernetes")
            if "kubernetes" in discovery
            else None
        ),
        auth=_auth(doc["auth"], "auth") if "auth" in doc else AuthConfig(),
    )


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
