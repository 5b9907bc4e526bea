"""Chart templates generated from the operator's own outputs (pure: text in, text out, no I/O).

Written by `kvferry generate` (codegen/generate.py) into charts/kvferry/templates, never edited by hand:
- `crd-disaggregatedinferences.yaml`, `crd-kopf-peerings.yaml`: the CRDs of crds/ (generated in the
  same run), wrapped in the crds.enabled / crds.keep gate as cert-manager's chart does, so
  `helm upgrade` updates the CRD (a chart's crds/ folder would be installed once and never again).
- `_rbac-rules.tpl`: the operator's RBAC rules as named templates, each rule under a comment that
  says why the operator needs it; operator-rbac.yaml decides where they are granted.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml
from kvferry.codegen.crdgen import GENERATED_BY

# Where a rule is granted (templates/operator-rbac.yaml), by the operator's watch scope:
#   cluster          always, in the ClusterRole (cluster-scoped kinds the operator reads)
#   namespaced       the ClusterRole with watch.scope=cluster, else a Role in each watched namespace
#   cluster-mode     only with watch.scope=cluster, in the ClusterRole (e.g. ClusterKopfPeering)
#   namespaces-mode  only with watch.scope=namespaces, in each namespace's Role (e.g. KopfPeering)
SCOPES = ("cluster", "namespaced", "cluster-mode", "namespaces-mode")
TEMPLATE_NAMES = {
    "cluster": "kvferry.rbac.clusterRules",
    "namespaced": "kvferry.rbac.namespacedRules",
    "cluster-mode": "kvferry.rbac.clusterModeRules",
    "namespaces-mode": "kvferry.rbac.namespacesModeRules",
}


@dataclass(frozen=True)
class Rule:
    """One RBAC PolicyRule plus why the operator needs it and where it is granted."""

    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str
    scope: str = "namespaced"
    resource_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"RBAC rule for {list(self.resources)}: scope {self.scope!r} not in {SCOPES}")
        if not self.resources or not self.verbs:
            raise ValueError(f"RBAC rule {self!r}: resources and verbs must not be empty")
        if "*" in self.verbs or "*" in self.resources:
            raise ValueError(f"RBAC rule for {list(self.resources)}: wildcards are not least privilege")
        if not self.why.strip():
            raise ValueError(f"RBAC rule for {list(self.resources)}: say why the operator needs it")

    def policy_rule(self) -> dict[str, Any]:
        rule: dict[str, Any] = {
            "apiGroups": list(self.api_groups),
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }
        if self.resource_names:
            rule["resourceNames"] = list(self.resource_names)
        return rule


def _escape_helm(text: str) -> str:
    """Make literal text safe inside a Helm template (CRD descriptions may contain `{{`)."""
    marker = "\x00OPEN\x00"
    text = text.replace("{{", marker).replace("}}", '{{ "}}" }}')
    return text.replace(marker, '{{ "{{" }}')


def _flow(items: list[str]) -> str:
    """A YAML flow list, quoting only what YAML would misread (e.g. the core API group "")."""
    return "[" + ", ".join(i if re.fullmatch(r"[a-z][a-z0-9./-]*", i) else json.dumps(i) for i in items) + "]"


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)


def _crd_document(crd: dict[str, Any]) -> list[str]:
    """Template lines of one CRD: the chart's labels, crds.keep's annotation, the body verbatim."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"expected a CustomResourceDefinition, got kind {crd.get('kind')!r}")
    meta = crd.get("metadata") or {}
    if not meta.get("name"):
        raise ValueError("CRD has no metadata.name")
    if meta.get("labels") or meta.get("annotations"):
        # The chart adds its own labels and the keep annotation; merging both sides' keys in a
        # template would risk duplicate YAML keys. Nothing needs them today.
        raise ValueError(f"CRD {meta['name']}: labels/annotations in crds/ are not carried into the chart")
    body = {k: v for k, v in crd.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    lines = [
        f"apiVersion: {crd['apiVersion']}",
        "kind: CustomResourceDefinition",
        "metadata:",
        f"  name: {meta['name']}",
        "  labels:",
        '    {{- include "kvferry.labels" . | nindent 4 }}',
        "  {{- if .Values.crds.keep }}",
        "  annotations:",
        "    # Uninstalling the release must not delete every custom resource along with the CRD.",
        "    helm.sh/resource-policy: keep",
        "  {{- end }}",
    ]
    return lines + _escape_helm(_dump(body)).splitlines()


def crd_template(crds: list[dict[str, Any]], source: str) -> str:
    """The chart template for the CRDs of one crds/ file, gated by crds.enabled.

    A template rather than the chart's crds/ folder so `helm upgrade` updates the CRDs, as
    cert-manager's chart does; helm.sh/resource-policy: keep (crds.keep) makes uninstall leave them.
    """
    if not crds:
        raise ValueError(f"{source}: no CRD documents")
    lines = [f"{{{{- /* Generated by `{GENERATED_BY}` from {source}. Do not edit. */}}}}"]
    lines.append("{{- if .Values.crds.enabled }}")
    for index, crd in enumerate(crds):
        if index:
            lines.append("---")
        lines += _crd_document(crd)
    lines.append("{{- end }}")
    return "\n".join(lines) + "\n"


def rbac_rules_template(rules: Iterable[Rule]) -> str:
    """`_rbac-rules.tpl`: one named template per scope, each rule under a comment saying why."""
    rules = list(rules)
    out = [
        f"{{{{- /* Generated by `{GENERATED_BY}` from kvferry.codegen.rbac. Do not edit. */}}}}",
    ]
    for scope in SCOPES:
        out.append("")
        out.append(f'{{{{- define "{TEMPLATE_NAMES[scope]}" }}}}')
        for rule in (r for r in rules if r.scope == scope):
            out += [f"# {line}" for line in textwrap.wrap(" ".join(rule.why.split()), 98)]
            for index, (key, value) in enumerate(rule.policy_rule().items()):
                out.append(f"{'- ' if index == 0 else '  '}{key}: {_flow(value)}")
        out.append("{{- end }}")
    return "\n".join(out) + "\n"
