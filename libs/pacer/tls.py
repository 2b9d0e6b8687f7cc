"""A private CA and a server certificate for the embedded nats-server.

``pacer up`` (unless ``PACER_NATS_TLS=0``) makes, once per data dir, a CA
(kept beside the server's config) and a server certificate for
``127.0.0.1`` / ``localhost`` signed by it (its key mode 0600).  nats-server
then requires TLS; services, pods and the CLI verify the server against the
CA named by ``PACER_NATS_CA`` or by ``pacer up``'s context file (read by
``Bus.connect``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the CA certificate clients trust, the server's certificate and key."""

    ca: Path
    cert: Path
    key: Path


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def ensure_server_tls(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                      days: int = 825) -> TlsFiles:
    """The CA and server certificate in ``directory``, made on the first call and reused after."""
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    if files.ca.exists() and files.cert.exists() and files.key.exists():
        return files
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Pacer embedded NATS CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    # The CA key is not kept: nothing else is ever signed with it (delete the directory to re-issue).
    return files


def server_tls_config(files: TlsFiles) -> str:
    """The ``tls { ... }`` block of a nats-server config (clients must use TLS)."""
    return f"tls {{\n  cert_file: {str(files.cert)!r}\n  key_file: {str(files.key)!r}\n  timeout: 2\n}}\n"
