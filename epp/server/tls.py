"""Serving credentials: a self-signed certificate made at start, or one read from `--cert-path`.

Like the reference EPP, `--cert-path` names a directory holding `tls.crt` and `tls.key`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(common_name: str = "epp", days: int = 3650) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for a fresh P-256 key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(common_name),
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def load_cert_dir(path: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) from `path/tls.crt` and `path/tls.key`, checked to parse."""
    crt_path, key_path = os.path.join(path, "tls.crt"), os.path.join(path, "tls.key")
    try:
        with open(crt_path, "rb") as f:
            crt = f.read()
        with open(key_path, "rb") as f:
            key = f.read()
    except OSError as err:
        raise ValueError(f"--cert-path {path!r}: cannot read {err.filename}: {err.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(crt)
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as err:  # TypeError: an encrypted key (no password is given)
        raise ValueError(f"--cert-path {path!r}: not a PEM certificate and key: {err}") from None
    if _public_der(cert.public_key()) != _public_der(private.public_key()):
        raise ValueError(
            f"--cert-path {path!r}: the certificate {crt_path} and the key {key_path} do not match "
            "(the key is not the certificate's private key)"
        )
    return crt, key


def _public_der(public: Any) -> bytes:
    der: bytes = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return der
