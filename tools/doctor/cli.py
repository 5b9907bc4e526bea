"""`kvferry doctor CR`: what this DisaggregatedInference needs from the cluster, one line per check.

CR is a file (YAML, as for kubectl apply) or the name of a CR in the cluster. Exit 0 when every check
passes, 1 on any gap (each printed with its fix), 2 when the CR cannot be read or is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from kvferry.operator.spec import GROUP, PLURAL, VERSION, SpecError


def _load_cr(ref: str, namespace: str | None, api: Any) -> dict[str, Any]:
    path = Path(ref)
    if path.exists():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        crs = [d for d in docs if d.get("kind") == "DisaggregatedInference"]
        if len(crs) != 1:
            raise ValueError(f"{ref}: expected one DisaggregatedInference, found {len(crs)}")
        cr: dict[str, Any] = crs[0]
        if namespace:
            cr.setdefault("metadata", {})["namespace"] = namespace
        return cr
    from kvferry.tools.doctor.cluster import get

    found: dict[str, Any] = get(
        api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace or 'default'}/{PLURAL}/{ref}"
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry doctor", description=__doc__.split("\n")[0])
    parser.add_argument("cr", help="a CR file, or the name of a DisaggregatedInference in the cluster")
    parser.add_argument("-n", "--namespace", help="the CR's namespace (default: the file's, else default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument(
        "--addons-namespace",
        help="look for the operator, device plugins and schedulers only here (default: every namespace)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON lines")
    args = parser.parse_args(argv)

    from kubernetes.config.config_exception import ConfigException
    from kvferry.tools.doctor import checks, cluster, needs

    try:
        api = cluster.api_client(args.kubeconfig, args.context)
    except (ConfigException, OSError) as exc:
        print(f"kvferry doctor: cannot load the kubeconfig: {exc}", file=sys.stderr)
        return 2
    try:
        cr = _load_cr(args.cr, args.namespace, api)
        wanted = needs.needs_of(cr)
        findings = checks.run_checks(wanted, cluster.snapshot(api, wanted, args.addons_namespace))
    except (ValueError, yaml.YAMLError) as exc:  # SpecError is a ValueError
        kind = "invalid" if isinstance(exc, SpecError) else "cannot read"
        print(f"kvferry doctor: {kind} CR {args.cr}: {exc}", file=sys.stderr)
        return 2
    except cluster.DoctorApiError as exc:  # 403: the kubeconfig's user may not read what the checks need
        print(f"kvferry doctor: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # transport: urllib3 errors (refused, TLS, timeout) name the server
        print(f"kvferry doctor: cannot reach the API server: {exc}", file=sys.stderr)
        return 2
    finally:
        api.close()  # type: ignore[no-untyped-call]
    for f in findings:
        print(json.dumps(f.__dict__) if args.json else f.line())
    gaps = sum(not f.ok for f in findings)
    print(f"{len(findings) - gaps} ok, {gaps} gap(s)", file=sys.stderr)
    return 1 if gaps else 0
