"""The per-box certificate authority the secrets door terminates TLS with, made with `cryptography`.

One CA per box, made when the box starts, valid for a day. Its key stays in this process's memory and is never
written anywhere, so it never enters the box; its certificate is trusted inside the box (the box's CA bundle is the
system's plus this one). Leaf certificates are made on demand, one per bound host, and cached for the box's life.

A leaf names its host the way a client checks it (RFC 6125): a name as a DNS name SAN, an IP literal as an IP address
SAN and never as a DNS name or a common name, since Python's ssl and curl check an address only against IP address
SANs. The host is read by `hostnames.check_host`, so every spelling the egress door accepts (`[2001:db8::1%25eth0]`,
`0xc6.18.7.2`) gets the leaf of the one address the door dialled. Both certificates carry key identifiers: Python
3.13's clients verify strictly (VERIFY_X509_STRICT) and refuse a leaf without an authority key identifier.
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

from tkbox_nb.rules.hostnames import check_host

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
                     .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
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

    def leaf(self, host: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        """A new key and a certificate for `host` (a name or an IP literal the door accepts), signed by this CA;
        HostError for anything else."""
        kind, value = check_host(host)
        san = x509.IPAddress(value) if kind == "ip" else x509.DNSName(value)
        # no common name: a client that fell back to it would take an address for a DNS name, and a name over 64
        # characters does not fit in one
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tkbox-nb")])
        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([san]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        return key, cert

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for `host`, cached by the address or name it stands for."""
        canonical = str(check_host(host)[1])
        if canonical in self._contexts:
            return self._contexts[canonical]
        key, cert = self.leaf(canonical)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        # ssl loads a chain only from files: a private temporary file, removed at once
        with tempfile.NamedTemporaryFile(prefix="tkbox-leaf-", suffix=".pem") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
            f.write(cert.public_bytes(serialization.Encoding.PEM))
            f.flush()
            ctx.load_cert_chain(f.name)
        self._contexts[canonical] = ctx
        return ctx
