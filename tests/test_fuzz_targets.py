"""Every fuzz target (fuzz/targets.py) as a hypothesis property, seeded with real inputs, in seconds; and every crash
the fuzzers found, kept as a regression input (fuzz/regressions/TARGET-*) and as a plain test of the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.targets import TARGETS

REGRESSIONS = Path(__file__).resolve().parent.parent / "fuzz" / "regressions"
SLOW = {"bundle-verify": 150, "bundle-view": 150}


def test_there_is_a_target_for_each_parser_of_box_and_bundle_input():
    assert len(TARGETS) >= 14
    assert all(t.doc and t.seeds() for t in TARGETS.values())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_pass(name):
    for data in TARGETS[name].seeds():
        TARGETS[name].fn(data)


def _splice(args):
    seed, at, insert, cut = args
    at %= len(seed) + 1
    return seed[:at] + insert + seed[at + cut:]


def inputs(name):
    seeds = TARGETS[name].seeds()
    return st.one_of(st.sampled_from(seeds), st.binary(max_size=600),
                     st.tuples(st.sampled_from(seeds), st.integers(0, 1 << 16), st.binary(max_size=48),
                               st.integers(0, 12)).map(_splice))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target_property(name):
    """The target's contract holds on seeds, random bytes and seeds with bytes spliced in."""
    @settings(max_examples=SLOW.get(name, 300), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(inputs(name))
    def prop(data):
        TARGETS[name].fn(data)
    prop()


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("*")) if REGRESSIONS.is_dir() else [],
                         ids=lambda p: p.name)
def test_fuzz_regression_inputs(path):
    """Each input a fuzzer once crashed on, through its target again."""
    name = path.name.split("--", 1)[0]
    TARGETS[name].fn(path.read_bytes())


# -- what the fuzzers found, each fixed in its parser -----------------------------------------------------------------
def test_a_bracketed_proxy_target_that_is_not_ipv6_is_a_400_not_a_crash():
    from tkbox_nb.rules.proxy_request import ProxyRequestError, ProxyRequestParser
    for head in (b"GET http://[]/ HTTP/1.1\r\nHost: x\r\n\r\n", b"GET http://[zz/ HTTP/1.1\r\nHost: x\r\n\r\n"):
        with pytest.raises(ProxyRequestError) as e:
            ProxyRequestParser().feed(head)
        assert e.value.status == 400


@pytest.mark.parametrize("body", [b'{"text": "\\ud800"}', b'{"text": "x\\uDC80"}', b'{"n": NaN}', b'{"n": -Infinity}',
                                  b'{"n": 1e999}', b'{"n": [-2.5e400]}'])
def test_a_kernel_message_the_host_could_not_write_out_again_ends_the_box(body):
    """A lone surrogate would break the host kernel's send to the frontend (and the signer's UTF-8); NaN is not JSON,
    nor is a number that overflows to infinity (the host would write it out again as `Infinity`)."""
    from tkbox_nb.guest import protocol as p
    with pytest.raises(p.ProtocolError):
        p.MessageReader().feed(p.MSG_HEADER.pack(len(body)) + body)
    with pytest.raises(p.ProtocolError):
        p.Session(is_host=True).receive(p.OPEN, 2, body)
    pair = b'{"text": "\\ud83d\\ude00 \\\\ud800"}'  # a valid pair and an escaped backslash pass
    assert p.MessageReader().feed(p.MSG_HEADER.pack(len(pair)) + pair) == [{"text": "\U0001F600 \\ud800"}]
    big = b'{"n": 1.5e308, "m": -2e-400}'  # large but finite, and an underflow to 0.0, are numbers
    assert p.MessageReader().feed(p.MSG_HEADER.pack(len(big)) + big) == [{"n": 1.5e308, "m": -0.0}]


@pytest.mark.parametrize("data", [b'{"a": 1e999}', b'[1, -1E+400]', b'{"a": NaN}', b'{"a": 1, "a": 2}'])
def test_a_bundle_file_with_a_number_json_cannot_hold_is_refused(data):
    """A bundle's JSON is read as strictly as the box's: an overflowed number would be written out as `Infinity`."""
    from tkbox_nb.bundle.archive import loads_json
    from tkbox_nb.core.errors import BundleError
    with pytest.raises(BundleError):
        loads_json(data, "x.json")
    assert loads_json(b'{"a": 1e308}', "x.json") == {"a": 1e308}


def test_verify_reports_a_disclosure_whose_arguments_are_not_an_object():
    from fuzz import seeds
    from fuzz.targets import mutated_bundle
    from tkbox_nb.bundle.verify import verify_bytes
    from tkbox_nb.bundle.verify_report import EXIT_INVALID, VerifyReport
    _, raw = mutated_bundle((REGRESSIONS / "bundle-verify--disclosed-args-not-an-object").read_bytes())
    report = verify_bytes(raw, VerifyReport(path="x", trust_path=str(seeds.SEED_TRUST), trust_source="given"))
    assert report.exit_code == EXIT_INVALID
    assert any("not an object" in c.detail for c in report.checks if not c.ok)


@pytest.mark.parametrize("line", ["x\t\\1", "x\t\\g<name>", "x\t\\c", "(\tX"])
def test_a_sanitizer_file_with_a_bad_pattern_or_replacement_is_one_error(line, tmp_path):
    from tkbox_nb.core.errors import TkboxError
    from tkbox_nb.audit.compare import parse_sanitizers
    with pytest.raises(TkboxError, match="x|\\("):
        parse_sanitizers(line + "\n")


def test_headers_without_a_placeholder_pass_byte_for_byte():
    from fuzz.targets import BINDINGS
    from tkbox_nb.rules.secrets import rewrite_request
    ph = BINDINGS[0].placeholder.encode()
    rw = rewrite_request("api.example.org", b"/", [(b"X-Name", b"caf\xe9"), (b"Authorization", b"\xe9 " + ph)],
                         BINDINGS, tls=True)
    assert rw.headers == [(b"X-Name", b"caf\xe9"), (b"Authorization", b"\xe9 " + BINDINGS[0].value.encode())]


def test_a_zip_entry_whose_name_is_cut_to_nothing_is_refused_by_name():
    """zipfile cuts a name at its first NUL; an entry named "\\0..." then made its is_dir raise IndexError."""
    from tkbox_nb.bundle.archive import read_entries
    from tkbox_nb.core.errors import BundleError
    with pytest.raises(BundleError, match="NUL|empty"):
        read_entries((REGRESSIONS / "bundle-reader--entry-with-an-empty-name").read_bytes())


def test_a_run_whose_disclosed_arguments_are_not_objects_is_still_shown():
    from fuzz.targets import mutated_bundle
    from tkbox_nb.bundle.archive import parse
    from tkbox_nb.bundle.read_back import Run
    files, _ = mutated_bundle((REGRESSIONS / "bundle-view--disclosed-args-not-an-object").read_bytes())
    run = Run("x.tkb", parse(files))
    assert all(c.args is None or isinstance(c.args, dict) for c in run.crossings())
    assert len(run.to_dataframe()) == len(run.crossings()) > 0


@pytest.mark.parametrize("spelling,address", [("0x7f.", "0.0.0.127"), ("0x7f000001.", "127.0.0.1"),
                                              ("0177.0.0.1.", "127.0.0.1"), ("127.1.", "127.0.0.1")])
def test_an_ip_literal_behind_a_trailing_dot_is_judged_as_the_address(spelling, address):
    """The door resolves a name without its trailing dot, where the C library reads "0x7f" as 0.0.0.127: such a
    spelling was passed as a name; it is judged as the address it is."""
    import ipaddress

    from tkbox_nb.rules.addresses import classify
    from tkbox_nb.rules.hostnames import check_host
    kind, value = check_host(spelling)
    assert (kind, value) == ("ip", ipaddress.ip_address(address)) and classify(value)[0] == "always"


def test_a_request_to_a_bound_host_without_host_is_refused_as_the_box_s_error():
    """h11 asks for Host only in HTTP/1.1; the upstream request is 1.1, so h11's *local* error surfaced mid-relay."""
    import h11

    from tkbox_nb.doors.intercept import read_request
    chunks = iter([b"GET / HTTP/1.0\r\nAuthorization: x\r\n\r\n", b""])
    with pytest.raises(h11.RemoteProtocolError, match="Host"):
        read_request(lambda: next(chunks), h11.Connection(h11.SERVER))


@pytest.mark.parametrize("nest", ["[", "{x="])
def test_a_policy_nested_too_deeply_is_a_policy_error_also_inside_a_bundle(nest, tmp_path):
    """tomllib recurses per level: a deep policy raised RecursionError, in `tkbox verify` too (box/policies/ of a
    hostile bundle are parsed, named by their own hash)."""
    import hashlib
    import io
    import zipfile

    from fuzz import seeds
    from fuzz.targets import seed_files
    from tkbox_nb.core.errors import PolicyError
    from tkbox_nb.policy import Policy
    from tkbox_nb.bundle.verify import verify_bytes
    from tkbox_nb.bundle.verify_report import VerifyReport
    source = "a = " + nest * 3000
    with pytest.raises(PolicyError, match="nested too deeply"):
        Policy.from_toml(source)
    files = dict(seed_files())
    files[f"box/policies/{hashlib.sha256(source.encode()).hexdigest()}.toml"] = source.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    report = verify_bytes(buf.getvalue(), VerifyReport(path="x", trust_path=str(seeds.SEED_TRUST),
                                                       trust_source="given"))
    assert not report.valid and any("nested too deeply" in c.detail for c in report.checks)
