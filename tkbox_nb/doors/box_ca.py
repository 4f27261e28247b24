"""The per-box certificate authority the secrets door terminates TLS with, made with `cryptography`.

One CA per box, made when the box starts, valid for a day. Its key stays in this process's memory and is never
written anywhere, so it never enters the box; its certificate is trusted inside the box (the box's CA bundle is the
system's plus this one). Leaf certificates are made on demand, one per bound host name, and cached for the box's life.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tkbox-nb"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


class BoxCA:
    def __init__(self, box_id: str):
        now = datetime.datetime.now(datetime.timezone.utc)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = _name(f"tkbox box CA {box_id[:16]}")
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self._key, hashes.SHA256()))
        self._contexts: dict[str, ssl.SSLContext] = {}

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def trust_bundle(self) -> bytes:
        """What the box trusts: the system's CAs (for hosts tunnelled untouched) and this box's CA."""
        system = SYSTEM_BUNDLE.read_bytes() if SYSTEM_BUNDLE.exists() else b""
        return system.rstrip(b"\n") + b"\n" + self.pem()

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host`, signed by this CA."""
        if host in self._contexts:
            return self._contexts[host]
        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(host)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        # ssl loads a chain only from files: a private temporary file, removed at once
        with tempfile.NamedTemporaryFile(prefix="tkbox-leaf-", suffix=".pem") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
            f.write(cert.public_bytes(serialization.Encoding.PEM))
            f.flush()
            ctx.load_cert_chain(f.name)
        self._contexts[host] = ctx
        return ctx
