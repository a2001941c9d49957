"""Certificates for TLS tests, made with the `cryptography` package: a CA, and a broker certificate it
signs, as PEM files for clients and a PKCS12 keystore for the broker."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class CA:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    pem: Path  # the CA certificate, for ssl cafile


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2)))


def make_ca(directory: Path, name: str) -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    pem = directory / f"{name}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(cert, key, pem)


def make_keystore(directory: Path, ca: CA, hosts: list[str], password: str) -> Path:
    """A PKCS12 keystore with a key and a certificate for `hosts` (DNS names or IPs) signed by `ca`."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (_builder(hosts[0], ca.cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    p12 = pkcs12.serialize_key_and_certificates(
        b"broker", key, cert, [ca.cert], serialization.BestAvailableEncryption(password.encode()))
    path = directory / "broker.p12"
    path.write_bytes(p12)
    return path
