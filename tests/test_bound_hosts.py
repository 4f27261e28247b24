"""Bound hosts given as IP literals: the per-box CA's leaf names an address as an IP address SAN. The TLS checks are real handshakes (Python's ssl, OpenSSL) over memory BIOs."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509

from fuzz.targets import box_ca_leaf, tls_accepts
from tkbox_nb.doors.box_ca import BoxCA


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


@pytest.mark.parametrize("host", [b"198.18.7.2", b"[2001:db8::1%25eth0]", b"0xc6.0x12.7.2", b"[::ffff:198.18.7.2]",
                                  b"api.example.org"])
def test_the_fuzz_target_holds_for_every_kind_of_bound_host(host):
    """The property the box-ca-leaf target checks under hypothesis and atheris, on the spellings of the issue."""
    box_ca_leaf(host)
