"""Serving credentials: a self-signed certificate made at start, or one read from `--cert-path`.

Like the reference EPP, `--cert-path` names a directory holding `tls.crt` and `tls.key`.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import threading
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_log = logging.getLogger("epp.server.tls")


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


class CertReloader:
    """`--enable-cert-reload`: serve `path/tls.crt` and `tls.key` as they are at each new TLS handshake
    (gRPC asks `fetch` before each), so a renewed certificate (a Kubernetes Secret volume swaps its files
    in place) is taken without a restart. Files that change are re-read and checked as at start; a pair that
    does not load (half written, not matching) is logged and the last good pair stays in use."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.certificate_pem, self._key = load_cert_dir(path)  # start fails, as without reload, if bad
        self._stamp = self._stat()
        self.reloads = 0  # pairs taken after the first
        self.failures = 0  # changed pairs that did not load
        self._lock = threading.Lock()  # gRPC calls `fetch` from its own threads, several at once

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for name in ("tls.crt", "tls.key"):
            try:
                st = os.stat(os.path.join(self.path, name))
            except OSError:
                out.append((-1, -1, -1))
            else:
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def credentials(self) -> grpc.ServerCredentials:
        initial = grpc.ssl_server_certificate_configuration([(self._key, self.certificate_pem)])
        return grpc.dynamic_ssl_server_credentials(initial, self.fetch)

    def fetch(self) -> Any:
        """None (keep the current pair) or the new certificate configuration."""
        with self._lock:
            return self._fetch()

    def _fetch(self) -> Any:
        stamp = self._stat()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            crt, key = load_cert_dir(self.path)
        except ValueError as err:
            self.failures += 1
            _log.error("--enable-cert-reload: keeping the current certificate: %s", err)
            return None
        if (crt, key) == (self.certificate_pem, self._key):
            return None
        self.certificate_pem, self._key = crt, key
        self.reloads += 1
        _log.info("--enable-cert-reload: serving the new certificate of %s", self.path)
        return grpc.ssl_server_certificate_configuration([(key, crt)])
