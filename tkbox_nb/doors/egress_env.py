"""What the box's environment needs from the egress door, and from the secrets door behind it.

Every HTTP(S) client in the box finds its way out through the proxy variables, which name the agent's forwarder
(guest/forwarder.py) and so lead only to the egress door; NO_PROXY is empty, so nothing goes around it. When secrets
are bound, the box trusts the CA bundle the secrets door (doors/intercept.py) terminates TLS with, under every name
the common clients read, and each binding's name holds its placeholder (never its value). The egress door gives
these as its `env()` (doors/door.py); a binding of a name the policy refuses (`policy/secrets.BOX_ENV`) cannot
override them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tkbox_nb.rules.secrets import Binding

PORT = 3128  # the forwarder's port in the box (guest/forwarder.PORT)
CA_BUNDLE_IN_BOX = "/etc/tkbox/ca-bundle.pem"
CA_NAMES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS")


def egress_env(port: int = PORT) -> dict[str, str]:
    """The box's proxy settings: every HTTP(S) client in the box goes to the forwarder, which leads to the door."""
    url = f"http://127.0.0.1:{port}"
    proxies = {n: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY") for n in (name, name.lower())}
    return {"TKBOX_EGRESS_PORT": str(port), "NO_PROXY": "", "no_proxy": "", **proxies}


def secrets_env(bindings: "list[Binding]") -> dict[str, str]:
    """With bindings: the box's CA bundle under every name the clients read, and each binding's placeholder."""
    if not bindings:
        return {}
    return {**{name: CA_BUNDLE_IN_BOX for name in CA_NAMES}, **{b.name: b.placeholder for b in bindings}}
