"""The box side of a central signer without one running: the policy's [signer] section is checked strictly, a
signer that does not answer refuses the box before anything runs, and the CLI answers bad use in one line."""

from __future__ import annotations

import socket

import pytest

from tkbox_nb.signing.central import CentralSigner, signer_for
from tkbox_nb.rules.box_ca import BoxCA
from tkbox_nb.core.errors import PolicyError, SignerError
from tkbox_nb.policy import Policy
from tkbox_nb.signing.signer import MachineSigner

from conftest import run_cli

GOOD = """
[signer]
url = "https://signer.internal:8443"
token_file = "/etc/tkbox/token"
ca = "/etc/tkbox/signer-ca.pem"
store_dsn_file = "/etc/tkbox/store.dsn"
"""


@pytest.mark.parametrize("change, message", [
    (('url = "https://signer.internal:8443"', 'url = "http://signer.internal:8443"'), "must be https://"),
    (('url = "https://signer.internal:8443"', 'url = "https://signer.internal:8443/rpc"'), "must be https://"),
    (('url = "https://signer.internal:8443"', 'url = "https://u:p@signer.internal"'), "must be https://"),
    (('url = "https://signer.internal:8443"', 'url = "https://signer.internal:0"'), "must be https://"),
    (('url = "https://signer.internal:8443"', 'url = "https://signer.internal:70000"'), "is not a URL"),
    (('url = "https://signer.internal:8443"', 'url = ""'), "must be https://"),
    (('token_file = "/etc/tkbox/token"', 'token_file = "token"'), "signer.token_file must be an absolute path"),
    (('ca = "/etc/tkbox/signer-ca.pem"', ''), "signer.ca is required"),
    (('store_dsn_file = "/etc/tkbox/store.dsn"', ''), "signer.store_dsn_file is required"),
    (('ca = "/etc/tkbox/signer-ca.pem"', 'ca = "/etc/tkbox/signer-ca.pem"\ntrust = "trust.json"'),
     "signer.trust must be an absolute path"),
    (('ca = "/etc/tkbox/signer-ca.pem"', 'ca = "/etc/tkbox/signer-ca.pem"\ntoken = "abc"'), "unknown key signer.token"),
    (('ca = "/etc/tkbox/signer-ca.pem"', 'ca = 3'), "signer.ca must be"),
])
def test_a_bad_signer_section_is_one_clear_error(change, message):
    text = GOOD.replace(*change)
    with pytest.raises(PolicyError, match=message.replace(".", r"\.").replace("/", "/")):
        Policy.from_toml(text, "p.toml")


def test_the_signer_section_picks_the_signer(tmp_path):
    assert isinstance(signer_for(Policy.default(), tmp_path), MachineSigner)
    central = signer_for(Policy.from_toml(GOOD, "p.toml"), tmp_path)
    assert isinstance(central, CentralSigner) and central.url == "https://signer.internal:8443"
    # its runs' spools are apart from the machine signer's: recovery never hands one signer's run to the other
    assert central.runs_dir != MachineSigner(tmp_path).runs_dir and central.runs_dir.is_relative_to(tmp_path)


def _unreachable_policy(tmp_path) -> Policy:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "ca.pem").write_bytes(BoxCA("test").trust_bundle())
    (tmp_path / "token").write_text("tk_nothing\n")
    (tmp_path / "store.dsn").write_text("host=/nonexistent\n")
    return Policy.from_toml(GOOD.replace("signer.internal:8443", f"127.0.0.1:{port}").replace(
        "/etc/tkbox/signer-ca.pem", str(tmp_path / "ca.pem")).replace("/etc/tkbox/token", str(tmp_path / "token"))
        .replace("/etc/tkbox/store.dsn", str(tmp_path / "store.dsn")), "central.toml")


def test_a_central_signer_that_does_not_answer_refuses_the_box_before_anything_runs(tmp_path):
    policy = _unreachable_policy(tmp_path)
    signer = CentralSigner.from_policy(policy, tmp_path / "home")
    assert not signer.answering()
    with pytest.raises(SignerError, match="does not answer"):
        signer.ensure(timeout=2)
    assert not any(signer.runs_dir.iterdir())


def test_the_cli_answers_central_signer_misuse_in_one_line(tmp_path):
    policy = _unreachable_policy(tmp_path)
    (tmp_path / "central.toml").write_text(policy.source)
    env = {"TKBOX_HOME": str(tmp_path / "home")}
    for args, want in ((("signer", "start"), "is its operator's to start"),
                       (("signer", "stop"), "is its operator's to stop"),
                       (("trust", "-o", str(tmp_path / "t.json")), "does not answer"),
                       (("export", "../x", "-o", str(tmp_path / "x.tkb")), "is not a run id"),
                       (("export", "abc", "-o", str(tmp_path / "x.tkb")), "no run abc was boxed on this host")):
        r = run_cli(*args, "--policy", str(tmp_path / "central.toml"), env=env)
        assert r.returncode != 0 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    r = run_cli("signer", "status", "--policy", str(tmp_path / "central.toml"), env=env)
    assert r.returncode == 1 and "not answering" in r.stdout
    (tmp_path / "bad.toml").write_text('[signer]\nurl = "http://x"\n')
    r = run_cli("signer", "status", "--policy", str(tmp_path / "bad.toml"), env=env)
    assert r.returncode != 0 and "must be https://" in r.stderr and len(r.stderr.strip().splitlines()) == 1
