"""`kvferry generate [--check]`: every generated file of the repository, in one run, sources first.

1. crds/*.yaml and docs/api-reference.md from operator/spec/ (codegen/crdgen.py);
2. the chart's CRD templates (from step 1's CRDs, in memory) and RBAC rules (codegen/rbac.py);
3. manifests/install.yaml: the chart as step 2 leaves it, rendered by the real `helm template`;
4. manifests/gitops/argocd-cm.yaml, the Argo CD patch carrying manifests/gitops/argocd-health.lua.

`--check` generates the same in memory (helm renders a temporary copy of the chart) and exits 1 naming
every file that differs, is missing, or is left over. Release artifacts, so this lives in codegen/, not in
the development-only kvferry.local: it runs from a checkout (--root) and in CI (scripts/test.sh).
`--crds` prints step 1's CRDs alone, which needs no checkout: an install from the wheel applies them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from kvferry.codegen import chartgen, crdgen, helm, rbac
from kvferry.operator.render import images

ROOT = Path(__file__).resolve().parents[1]
# Paths relative to the repository root.
CHART = Path("charts/kvferry")
RBAC_TEMPLATE = CHART / "templates" / "_rbac-rules.tpl"
API_REFERENCE = Path("docs/api-reference.md")
INSTALL = Path("manifests/install.yaml")
ARGOCD_HEALTH = Path("manifests/gitops/argocd-health.lua")
ARGOCD_CM = Path("manifests/gitops/argocd-cm.yaml")
# Only this command writes files matching these: one it no longer generates (a CRD dropped) is stale.
OWNED_GLOBS = ("crds/*.yaml", f"{CHART}/templates/crd-*.yaml")

# The namespace manifests/install.yaml installs into (`kubectl apply` has no --create-namespace).
INSTALL_NAMESPACE = "kvferry-system"
INSTALL_HEADER = f"""\
# kvferry: CRD, operator and RBAC for `kubectl apply`, with the registry of the images you pushed:
#   sed "s#{images.PLACEHOLDER_REGISTRY}#$REGISTRY#g" manifests/install.yaml \\
#     | kubectl apply --server-side -f -
# No kvferry image is published: {images.PLACEHOLDER_REGISTRY} is a stand-in that never resolves.
# Generated from charts/kvferry with default values (and image.registry={images.PLACEHOLDER_REGISTRY}) by
# `{crdgen.GENERATED_BY}`. Do not edit: change the chart (or the operator's CRD/RBAC sources) and regenerate.
"""

# Where the chart grants a resource, by watch mode (see chartgen.SCOPES). Anything not listed is
# namespaced and follows the watched namespaces. A cluster-scoped kind missing here would be granted
# only through Roles, where it has no effect: test_install_operator_rbac catches that as a 403.
RESOURCE_SCOPES = {
    # kopf watches CRDs and lists/watches namespaces in both modes (with fixed namespaces it falls
    # back after a 403, but logs it); kopf's own deployment-rbac.yaml grants both cluster-wide.
    ("apiextensions.k8s.io", "customresourcedefinitions"): "cluster",
    ("", "namespaces"): "cluster",
    # kopf peering: cluster-wide operators use ClusterKopfPeering, namespaced ones KopfPeering.
    ("kopf.dev", "clusterkopfpeerings"): "cluster-mode",
    ("kopf.dev", "kopfpeerings"): "namespaces-mode",
    ("", "nodes"): "cluster",
}


def crd_files() -> dict[str, tuple[list[dict[str, Any]], str]]:
    """crds/<file> -> (its CRD documents, the source its header names)."""
    return {
        "disaggregatedinferences.yaml": ([crdgen.crd()], "operator/spec/"),
        "kopf-peerings.yaml": (crdgen.peering_crds(), "codegen/crdgen.py (kopf's peering kinds)"),
    }


def operator_rules() -> list[chartgen.Rule]:
    """The operator's RBAC rules from its one list (kvferry.codegen.rbac.RULES), split by scope."""
    out = []
    for groups, resources, verbs, why in rbac.RULES:
        by_scope: dict[str, list[str]] = {}
        for resource in resources:
            scopes = {RESOURCE_SCOPES.get((group, resource), "namespaced") for group in groups}
            if len(scopes) != 1:
                raise ValueError(f"RBAC rule {groups}/{resource}: groups disagree on the scope")
            by_scope.setdefault(scopes.pop(), []).append(resource)
        for scope, scoped in by_scope.items():
            out.append(chartgen.Rule(tuple(groups), tuple(scoped), tuple(verbs), why, scope))
    return out


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


def argocd_cm(script: str) -> str:
    """A merge patch for Argo CD's argocd-cm carrying the DisaggregatedInference health script."""
    header = (
        f"# Argo CD health check for DisaggregatedInference: the script in argocd-health.lua.\n"
        f"# Generated by `{crdgen.GENERATED_BY}`. Apply as a patch:\n"
        "#   kubectl -n argocd patch configmap argocd-cm --patch-file manifests/gitops/argocd-cm.yaml\n"
    )
    key = "resource.customizations.health.kvferry.io_DisaggregatedInference"
    block = "".join(f"    {line}\n" if line else "\n" for line in script.splitlines())
    return f"{header}data:\n  {key}: |\n{block}"


def render_chart(chart: Path, chart_files: dict[Path, str]) -> str:
    """`helm template` a temporary copy of `chart` with `chart_files` (paths inside it) replaced.

    install.yaml must come from the chart as it will be committed, so `--check` renders the freshly
    generated templates without writing them into the work tree.
    """
    with tempfile.TemporaryDirectory(prefix="kvferry-chart-") as tmp:
        copy = Path(tmp) / chart.name
        shutil.copytree(chart, copy)
        for rel, text in chart_files.items():
            (copy / rel).write_text(text)
        registry = f"image.registry={images.PLACEHOLDER_REGISTRY}"  # the chart requires one
        return helm.template(copy, namespace=INSTALL_NAMESPACE, set_values=[registry])


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's content, keyed by its path relative to `root`, sources before users."""
    wanted: dict[Path, str] = {}
    chart_files: dict[Path, str] = {}  # relative to the chart
    for name, (docs, source) in crd_files().items():
        wanted[Path("crds") / name] = crdgen.dump(docs, source)
        chart_files[Path("templates") / f"crd-{name}"] = chartgen.crd_template(docs, f"crds/{name}")
    wanted[API_REFERENCE] = crdgen.api_reference()
    chart_files[RBAC_TEMPLATE.relative_to(CHART)] = chartgen.rbac_rules_template(operator_rules())
    wanted |= {CHART / rel: text for rel, text in chart_files.items()}
    wanted[INSTALL] = install_yaml(render_chart(root / CHART, chart_files))
    wanted[ARGOCD_CM] = argocd_cm((root / ARGOCD_HEALTH).read_text())
    return wanted


def stale(root: Path, wanted: dict[Path, str]) -> dict[Path, str]:
    """Files under `root` that differ from `wanted`, with why: missing, differs, or left over."""
    out = {}
    for rel, text in wanted.items():
        path = root / rel
        if not path.exists():
            out[rel] = "missing"
        elif path.read_text() != text:
            out[rel] = "differs"
    for pattern in OWNED_GLOBS:
        for path in sorted(root.glob(pattern)):
            if path.relative_to(root) not in wanted:
                out[path.relative_to(root)] = "left over: no longer generated"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale file")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to generate into")
    parser.add_argument(
        "--crds",
        action="store_true",
        help="print the CRDs (crds/*.yaml) and exit; needs no checkout: an install from the wheel applies "
        "them with `kvferry generate --crds | kubectl apply --server-side -f -`",
    )
    args = parser.parse_args(argv)
    if args.crds:
        sys.stdout.write("---\n".join(crdgen.dump(docs, source) for docs, source in crd_files().values()))
        return 0
    root = args.root.resolve()
    if not (root / CHART / "Chart.yaml").exists():
        print(f"kvferry generate: {root} has no {CHART}: run it in a kvferry checkout", file=sys.stderr)
        return 2
    try:
        wanted = generate(root)
    except helm.HelmError as exc:
        print(f"kvferry generate: {exc}", file=sys.stderr)
        return 2
    problems = stale(root, wanted)
    if args.check:
        for rel, why in problems.items():
            print(f"stale: {rel} ({why})", file=sys.stderr)
        if problems:
            print("run `kvferry generate` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    for rel in problems:
        path = root / rel
        if rel in wanted:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[rel])
            print(f"wrote {rel}")
        else:
            path.unlink()
            print(f"removed {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
