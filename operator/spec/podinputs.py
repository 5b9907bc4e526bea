"""What a CR hands into its pods verbatim, bounded: resource quantities, env names, image references (pure).

Each piece is a schema fragment for types.py plus the check rules.py's CEL rules and their Python
twins share, so the CRD and `kvferry render` refuse the same inputs.
"""

from __future__ import annotations

import re
from typing import Any

from kvferry.operator.spec.quantity import SPEC_MAX_CHARS, SPEC_PATTERN, spec_quantity

# ---- resources: {limits, requests: name -> quantity, claims} ----

MAX_RESOURCE_NAMES = 32  # per map; CEL's cost estimate needs a bound
_QUANTITY_VALUE = {
    "x-kubernetes-int-or-string": True,
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "maxLength": SPEC_MAX_CHARS,  # a longer string is refused before any rule parses it
}
_QUANTITY_MAP = {
    "type": "object",
    "maxProperties": MAX_RESOURCE_NAMES,
    "additionalProperties": _QUANTITY_VALUE,
}
# Kubernetes ResourceRequirements: declared so CEL can read limits/requests (unknown fields are not
# visible to CEL); `claims` and anything else are kept as given.
RESOURCES_SCHEMA: dict[str, Any] = {
    "properties": {"limits": _QUANTITY_MAP, "requests": _QUANTITY_MAP},
}
RESOURCE_MAPS = ("limits", "requests")


def cel_quantities(path: str) -> str:
    """CEL: every limits/requests value under `path` (relative to spec) is a bounded quantity. The
    pattern goes first: `isQuantity` of an unbounded exponent would stall the API server itself."""
    checks = []
    for m in RESOURCE_MAPS:
        p = f"self.{path}.{m}"
        ok = f"string({p}[k]).matches('{SPEC_PATTERN}') && isQuantity(string({p}[k]))"
        checks.append(f"(!has({p}) || {p}.all(k, {ok}))")
    return " && ".join(checks)


def bad_quantities(resources: Any) -> list[str]:
    """`limits.cpu`-style keys whose values a CR may not hand in (empty when all are fine)."""
    if not isinstance(resources, dict):
        return ["(not a mapping)"]
    bad = []
    for m in RESOURCE_MAPS:
        values = resources.get(m)
        if values is None:
            continue
        if not isinstance(values, dict) or len(values) > MAX_RESOURCE_NAMES:
            bad.append(m)
            continue
        bad += [f"{m}.{k}" for k, v in values.items() if not spec_quantity(v)]
    return bad


QUANTITY_MESSAGE = (
    "values in limits and requests must be Kubernetes quantities of at most "
    f"{SPEC_MAX_CHARS} characters, not negative, with at most 18 integer and 9 fraction digits and a "
    "suffix (n u m k M G T P E, Ki Mi Gi Ti Pi Ei) or an exponent of at most two digits "
    "(e.g. 500m, 4, 16Gi, 1e3)"
)

# ---- env: names the operator sets for the engine's identity ----

# The engine's identity: render sets these from the downward API (POD_IP, the NIXL side channel's
# address). A later entry of the same name wins in Kubernetes, so a role's env could move the side
# channel to another address or pod name; they are refused instead.
RESERVED_ENV = (
    "POD_NAME",
    "POD_NAMESPACE",
    "POD_IP",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "KVFERRY_TRANSFER_TOKEN_FILE",  # contracts.pods.TRANSFER_TOKEN_ENV: where the CR's token is mounted
)
# EnvVar items: `name` declared (so CEL can read it), the rest kept as given.
ENV_ITEM_SCHEMA: dict[str, Any] = {
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}},
}
_RESERVED_CEL = "[" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "]"


def cel_no_reserved_env(path: str) -> str:
    return f"self.{path}.all(e, !(e.name in {_RESERVED_CEL}))"


def reserved_env_in(env: list[Any]) -> list[str]:
    return [e.get("name", "") for e in env if isinstance(e, dict) and e.get("name") in RESERVED_ENV]


RESERVED_ENV_MESSAGE = (
    f"must not set {', '.join(RESERVED_ENV)}: the operator sets them for the engine's identity (its pod "
    "name, the address the NIXL side channel binds and advertises, and its transfer token's file)"
)

# ---- images: a tag, a digest, or both ----

_COMPONENT = "[a-z0-9]+(([.]|_|__|[-]+)[a-z0-9]+)*"
_HOST = "[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?([.][a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?)*(:[0-9]+)?/"
# An image reference as container runtimes read it: [host[:port]/]path[:tag][@sha256:<64 hex>].
# A digest pins the bytes: the revision (and so a rollout) changes exactly when the image does,
# while a re-pushed tag changes the code under the same revision.
_TAG = "(:[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127})?"
_DIGEST = "(@sha256:[a-f0-9]{64})?"
IMAGE_PATTERN = f"^({_HOST})?{_COMPONENT}(/{_COMPONENT})*{_TAG}{_DIGEST}$"
IMAGE_SCHEMA: dict[str, Any] = {"maxLength": 512, "pattern": IMAGE_PATTERN}
_IMAGE = re.compile(IMAGE_PATTERN)


def image_ok(ref: str) -> bool:
    return len(ref) <= 512 and _IMAGE.match(ref) is not None
