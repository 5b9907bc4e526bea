"""Pure parts of the local control plane: node shapes, CLI parsing, pins, kubeconfig reading, certs."""

from __future__ import annotations

import pytest
from cryptography import x509
from kvferry.local.controlplane import build, certs, kubeconfig, nodes, versions
from kvferry.local.controlplane.cli import parse_counts


def test_gpu_node_shape_matches_p5en():
    node = nodes.manifest(nodes.P5EN, 0)
    assert node["metadata"]["name"] == "p5en-0"
    assert node["metadata"]["labels"][nodes.INSTANCE_TYPE] == "p5en.48xlarge"
    assert node["metadata"]["annotations"] == {nodes.KWOK_ANNOTATION: nodes.KWOK_VALUE}
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["status"]["allocatable"][nodes.GPU] == "8"
    assert node["status"]["allocatable"][nodes.EFA] == "16"
    assert node["spec"]["taints"] == [{"key": nodes.GPU, "value": "true", "effect": "NoSchedule"}]


def test_cpu_nodes_can_be_left_to_another_agent():
    specs = nodes.manifests({"trn2": 1, "cpu": 2}, kwok_cpu=False)
    by_name = {s["metadata"]["name"]: s for s in specs}
    assert sorted(by_name) == ["cpu-0", "cpu-1", "trn2-0"]
    assert by_name["trn2-0"]["metadata"]["annotations"] == {nodes.KWOK_ANNOTATION: nodes.KWOK_VALUE}
    assert by_name["cpu-0"]["metadata"]["annotations"] == {}
    assert by_name["cpu-0"]["spec"]["taints"] == []


def test_unknown_shape_and_bad_counts_are_named():
    with pytest.raises(ValueError, match="unknown node shape 'p4d'"):
        nodes.manifests({"p4d": 1})
    with pytest.raises(ValueError, match="expected shape=count, got 'p5en'"):
        parse_counts("p5en")
    with pytest.raises(ValueError, match="unknown node shape 'gpu'"):
        parse_counts("gpu=1")
    assert parse_counts("p5en=2, cpu=0") == {"p5en": 2, "cpu": 0}


def test_staging_modules_follow_the_kubernetes_release():
    minor, patch = versions.KUBERNETES.split(".")[1:]
    assert versions.staging_version() == f"v0.{minor}.{patch}"
    assert f"-X k8s.io/component-base/version.gitVersion=v{versions.KUBERNETES}" in build._kube_ldflags()


def test_certs_carry_identities_and_loopback_san(tmp_path):
    pki = certs.generate(tmp_path)
    serving = x509.load_pem_x509_certificate(pki.serving.cert.read_bytes())
    san = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    admin = x509.load_pem_x509_certificate(pki.clients["admin"].cert.read_bytes())
    orgs = [a.value for a in admin.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    assert oct(pki.sa_key.stat().st_mode & 0o777) == "0o600"


def test_kubeconfig_round_trip_and_missing_ca_is_named(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nx\n")
    path = kubeconfig.write(tmp_path / "k", kubeconfig.render("https://127.0.0.1:1", ca, "u", token="t"))
    assert kubeconfig.read_server_and_ca(path) == ("https://127.0.0.1:1", ca.read_bytes())
    path.write_text(path.read_text().replace("certificate-authority-data", "insecure-skip"))
    with pytest.raises(ValueError, match="has no embedded CA"):
        kubeconfig.read_server_and_ca(path)
