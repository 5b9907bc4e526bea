"""The generated install artifacts and their sources: which file is made from what."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml
from kvferry.local.chart import helm, templates

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvferry"
# crds/<file> (written by `kvferry crd`) -> charts/kvferry/templates/crd-<file>
CRD_FILES = ("disaggregatedinferences.yaml", "kopf-peerings.yaml")
RBAC_TEMPLATE = CHART / "templates" / "_rbac-rules.tpl"
INSTALL = ROOT / "manifests" / "install.yaml"

# The namespace manifests/install.yaml installs into (`kubectl apply` has no --create-namespace).
INSTALL_NAMESPACE = "kvferry-system"
INSTALL_HEADER = f"""\
# kvferry: CRD, operator and RBAC for `kubectl apply -f manifests/install.yaml`.
# Generated from charts/kvferry with default values by `{templates.GENERATED_BY}`. Do not edit:
# change the chart (or the operator's CRD/RBAC sources) and regenerate.
"""


def operator_rules() -> list[templates.Rule]:
    """The operator's RBAC rules, from its one list (kvferry.operator.rbac)."""
    from kvferry.operator import rbac  # imported late: the operator package may not be installed

    return [templates.Rule(**dict(rule)) for rule in rbac.RULES]


def load_crds(name: str) -> list[dict]:
    """The CRD documents of crds/<name>, as `kvferry crd` wrote them."""
    path = ROOT / "crds" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: generate it with `kvferry crd`")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def install_yaml(rendered: str) -> str:
    """manifests/install.yaml: the namespace, then the chart rendered with default values."""
    namespace = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": INSTALL_NAMESPACE, "labels": {"app.kubernetes.io/part-of": "kvferry"}},
        },
        sort_keys=False,
    )
    return f"{INSTALL_HEADER}---\n{namespace}{rendered}"


def render_chart(chart_files: dict[Path, str], **template_args) -> str:
    """`helm template` a temporary copy of the chart with `chart_files` (paths inside CHART) replaced.

    install.yaml must come from the chart as it will be committed, so `check` renders the freshly
    generated templates without writing them into the work tree.
    """
    with tempfile.TemporaryDirectory(prefix="kvferry-chart-") as tmp:
        copy = Path(tmp) / CHART.name
        shutil.copytree(CHART, copy)
        for path, text in chart_files.items():
            (copy / path.relative_to(CHART)).write_text(text)
        return helm.template(copy, namespace=INSTALL_NAMESPACE, **template_args)


def render_all() -> dict[Path, str]:
    """Every generated file's wanted content, keyed by its path in the repository."""
    wanted = {
        CHART / "templates" / f"crd-{name}": templates.crd_template(load_crds(name), f"crds/{name}")
        for name in CRD_FILES
    }
    wanted[RBAC_TEMPLATE] = templates.rbac_rules_template(operator_rules())
    wanted[INSTALL] = install_yaml(render_chart(wanted))
    return wanted


def stale(wanted: dict[Path, str]) -> list[Path]:
    return [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
