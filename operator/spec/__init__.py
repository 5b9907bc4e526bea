"""Spec step: the DisaggregatedInference API as typed Python, the one source of the CRD, its docs and checks.

`crdgen.py` turns these dataclasses (field docs, defaults, bounds, enums) and `RULES` (CEL with a
Python twin) into `crds/disaggregatedinferences.yaml` and `docs/api-reference.md`; `parse_spec` applies
the same constraints offline so `kvferry render` rejects what the API server would.

One module per concern: `constants` (API identity, presets' limits), `fields` (the documented field
helper), `types` (the spec sections; a new section may live in its own module and be one field of
`Spec`), `rules` (cross-field CEL rules with Python twins), `parse` (offline validation), `inference` (a CR
body parsed once into typed metadata and spec: what render, status and autoscale take).
"""

from kvferry.operator.spec.constants import (
    ACCELERATORS,
    BACKENDS,
    CONNECTORS,
    EFA_ACCELERATORS,
    GROUP,
    KIND,
    MAX_NAME_LEN,
    MAX_TP,
    MODES,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from kvferry.operator.spec.fields import Obj, f
from kvferry.operator.spec.inference import Inference, Meta
from kvferry.operator.spec.parse import SpecError, camel, parse_dataclass, parse_spec, unwrap_optional
from kvferry.operator.spec.rules import NAME_RULE, RULES, Rule
from kvferry.operator.spec.types import (
    Engine,
    KvTransfer,
    ModelToken,
    NetworkPolicy,
    Role,
    Router,
    SecretKeyRef,
    Spec,
)

__all__ = [
    "ACCELERATORS",
    "BACKENDS",
    "CONNECTORS",
    "EFA_ACCELERATORS",
    "GROUP",
    "KIND",
    "MAX_NAME_LEN",
    "MAX_TP",
    "MODES",
    "NAME_RULE",
    "PLURAL",
    "RULES",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "Engine",
    "Inference",
    "KvTransfer",
    "Meta",
    "ModelToken",
    "NetworkPolicy",
    "Obj",
    "Role",
    "Router",
    "Rule",
    "SecretKeyRef",
    "Spec",
    "SpecError",
    "camel",
    "f",
    "parse_dataclass",
    "parse_spec",
    "unwrap_optional",
]
