"""Certificates step: a throwaway CA, the apiserver's serving cert, client certs and the service-account key.

Everything is generated fresh for each control plane (a second or two) and written to its workdir as PEM
files; nothing is cached or shared between planes. Client identities are Kubernetes users taken from the
cert: CN = user name, O = groups.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = dt.timedelta(days=7)  # a test plane lives minutes; a week tolerates clock skew and long demos
SERVICE_IP = "10.96.0.1"  # first address of the service CIDR: the `kubernetes` Service's ClusterIP
APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClientIdentity:
    name: str  # file stem
    user: str  # CN
    groups: tuple[str, ...] = ()  # O


# Bootstrap RBAC binds the controller-manager and scheduler users by name; kwok stands in for kubelets of
# many nodes, so it gets cluster-admin instead of the per-node `system:node:<name>` identity.
CLIENTS = (
    ClientIdentity("admin", "kvferry-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    ClientIdentity("kwok", "kvferry-kwok", ("system:masters",)),
)


@dataclass(frozen=True)
class PlaneCerts:
    ca: CertPair
    serving: CertPair
    clients: dict[str, CertPair]
    sa_key: Path  # private (signing) key
    sa_pub: Path  # public key the apiserver verifies tokens with


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
    )


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _save(cert: x509.Certificate, key, d: Path, stem: str) -> CertPair:
    pair = CertPair(d / f"{stem}.crt", d / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def _issue(ca_cert, ca_key, subject: x509.Name, usage, sans=None):
    key = _key()
    b = _builder(subject, ca_cert.subject, key.public_key())
    b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def generate(d: Path) -> PlaneCerts:
    """Write the plane's PKI into directory `d` and return the paths."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("kvferry-local-ca")
    ca_b = _builder(ca_name, ca_name, ca_key.public_key())
    ca_b = ca_b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    ca_b = ca_b.add_extension(
        x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
    )
    ca_cert = ca_b.sign(ca_key, hashes.SHA256())
    ca = _save(ca_cert, ca_key, d, "ca")

    sans = [x509.DNSName(n) for n in APISERVER_DNS]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", SERVICE_IP)]
    cert, key = _issue(ca_cert, ca_key, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    serving = _save(cert, key, d, "apiserver")

    clients = {}
    for ident in CLIENTS:
        subject = _name(ident.user, ident.groups)
        cert, key = _issue(ca_cert, ca_key, subject, ExtendedKeyUsageOID.CLIENT_AUTH)
        clients[ident.name] = _save(cert, key, d, f"client-{ident.name}")

    # RSA for service-account tokens (RS256), the algorithm every token consumer accepts.
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_key, sa_pub = d / "sa.key", d / "sa.pub"
    _write_key(sa, sa_key)
    sa_pub.write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return PlaneCerts(ca=ca, serving=serving, clients=clients, sa_key=sa_key, sa_pub=sa_pub)


def issue_serving(ca: CertPair, d: Path, stem: str = "tls") -> CertPair:
    """A 127.0.0.1 serving cert signed by the plane's CA, for a webhook server the API server calls
    (`<stem>.crt`/`<stem>.key` in `d`: controller-runtime reads tls.crt and tls.key from its cert dir)."""
    d.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert, key = _issue(ca_cert, ca_key, _name("kvferry-local-webhook"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    return _save(cert, key, d, stem)
