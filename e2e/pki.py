"""Certificates and keys for the local control plane (Python `cryptography`, ECDSA P-256).

One throwaway CA signs the kube-apiserver serving certificate, an admin client certificate in the
``system:masters`` group, the front-proxy client certificate the API server presents to aggregated
APIs (prometheus-adapter) and the kubelet client certificate it presents to the process nodes' log
endpoints; :func:`issue_serving_cert` signs more serving certificates later (an aggregated API
server's, the process nodes' kubelet endpoint). A separate key pair signs service-account tokens.
All files are PEM.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)
FRONT_PROXY_CLIENT = "front-proxy-client"
KUBELET_CLIENT = "kube-apiserver-kubelet-client"  # the CN the process nodes' log endpoints accept


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files written by :func:`write_pki`."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    front_proxy_cert: Path
    front_proxy_key: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path
    service_account_key: Path
    service_account_public_key: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _sign_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    builder = (
        _builder(subject, ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def write_pki(directory: Path, service_ip: str = "10.0.0.1", extra_ips: tuple[str, ...] = ()) -> Pki:
    """Write a CA, a serving certificate for 127.0.0.1/localhost (and `extra_ips`), an admin client
    certificate (CN=eaas-e2e-admin, O=system:masters) and a service-account signing key pair into
    `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        front_proxy_cert=directory / "front-proxy-client.crt",
        front_proxy_key=directory / "front-proxy-client.key",
        kubelet_client_cert=directory / "apiserver-kubelet-client.crt",
        kubelet_client_key=directory / "apiserver-kubelet-client.key",
        service_account_key=directory / "sa.key",
        service_account_public_key=directory / "sa.pub",
    )

    ca_key = _new_key()
    ca_name = _name("eaas-e2e-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)

    def leaf(
        subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        return _sign_leaf(ca_key, ca_name, subject, usage, sans)

    dns_names = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    serving_sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    serving_sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip, *extra_ips)]
    serving_key, serving_cert = leaf(_name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, serving_sans)
    _write_key(pki.serving_key, serving_key)
    _write_cert(pki.serving_cert, serving_cert)

    admin_subject = _name("eaas-e2e-admin", "system:masters")
    admin_key, admin_cert = leaf(admin_subject, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write_key(pki.admin_key, admin_key)
    _write_cert(pki.admin_cert, admin_cert)

    # What the aggregator presents to aggregated API servers (--proxy-client-cert-file); they trust
    # its X-Remote-User headers because the CA and this CN are in extension-apiserver-authentication.
    proxy_key, proxy_cert = leaf(_name(FRONT_PROXY_CLIENT), ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write_key(pki.front_proxy_key, proxy_key)
    _write_cert(pki.front_proxy_cert, proxy_cert)

    # What the API server presents to a node's kubelet endpoint (--kubelet-client-certificate):
    # `kubectl logs` through pods/log. The process runner's endpoints accept this CN alone.
    kubelet_key, kubelet_cert = leaf(_name(KUBELET_CLIENT), ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write_key(pki.kubelet_client_key, kubelet_key)
    _write_cert(pki.kubelet_client_cert, kubelet_cert)

    sa_key = _new_key()
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_public_key.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def issue_serving_cert(
    pki: Pki, cert: Path, key: Path, dns_names: list[str], ips: tuple[str, ...] = ("127.0.0.1",)
) -> None:
    """A serving certificate for `dns_names` and `ips`, signed by the plane's CA, written to `cert`
    and `key` (an aggregated API server's: the aggregator checks it against the APIService's
    caBundle, i.e. this CA, for the name ``<service>.<namespace>.svc``)."""
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    leaf_key, leaf_cert = _sign_leaf(
        ca_key, ca_cert.subject, _name(dns_names[0]), ExtendedKeyUsageOID.SERVER_AUTH, sans
    )
    _write_key(key, leaf_key)
    _write_cert(cert, leaf_cert)
