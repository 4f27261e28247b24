"""[signer]: a central Tracekit signer over HTTPS (tkbox_nb/signing/central.py) instead of this machine's. Not a door:
it names who signs, so it has settings and checks but no decision."""

from __future__ import annotations

from typing import Any

from tkbox_nb.core.errors import PolicyError

SCHEMA: dict[str, type | tuple[type, ...]] = {
    "url": str, "token_file": str, "ca": str, "trust": str, "store_dsn_file": str}
# url = "": the machine signer
DEFAULTS: dict[str, Any] = {"url": "", "token_file": "", "ca": "", "trust": "", "store_dsn_file": ""}


def validate(signer: dict[str, Any], name: str) -> None:
    """[signer]: a central Tracekit signer over HTTPS (tkbox_nb/signing/central.py); absent, the machine signer."""
    from urllib.parse import urlsplit
    url = signer.get("url", "")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        raise PolicyError(f"{name}: signer.url {url!r} is not a URL") from None
    if u.scheme != "https" or not u.hostname or u.username or u.password or u.path not in ("", "/") or u.query \
            or u.fragment or port == 0:
        raise PolicyError(f"{name}: signer.url must be https://HOST[:PORT] (no path, user, query or fragment)")
    for key in ("token_file", "ca", "store_dsn_file"):
        if not signer.get(key):
            raise PolicyError(f"{name}: signer.{key} is required with signer.url")
    for key in ("token_file", "ca", "store_dsn_file", "trust"):
        value = signer.get(key)
        if value and ("\x00" in value or not value.startswith("/")):
            raise PolicyError(f"{name}: signer.{key} must be an absolute path (the file's path on the box's host)")
