"""The environment manifest (bundle/environment.py) without a box: RECORD digests, the cache keyed by the site
directories' state, a VM image's root, a bundle's manifest read strictly, an old bundle without one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tkbox_nb.bundle import environment as env
from tkbox_nb.backends.image import ENVIRONMENT, Image
from tkbox_nb.backends.qemu import QemuBackend

from conftest import run_cli

DATA = Path(__file__).parent / "data"
RECORD = (b"pkg/__init__.py,sha256=AAAA,10\npkg/mod.py,sha256=BBBB,20\npkg/__pycache__/mod.pyc,,\n"
          b"pkg-1.0.dist-info/RECORD,,\n")


def dist(site: Path, name: str, version: str, record: bytes = RECORD) -> Path:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nName: not-this\n")
    (d / "RECORD").write_bytes(record)
    return d


def test_record_digests_use_the_records_own_hashes_in_any_order():
    a = env.record_digests(RECORD)
    assert a["files"] == 4 and a["hashed"] == 2 and a["record_digest"] == env._sha(RECORD)
    reordered = b"\n".join(reversed(RECORD.split(b"\n")))
    assert env.record_digests(reordered)["files_digest"] == a["files_digest"]
    assert env.record_digests(reordered)["record_digest"] != a["record_digest"]
    assert env.record_digests(RECORD.replace(b"BBBB", b"CCCC"))["files_digest"] != a["files_digest"]


def test_a_distribution_names_its_version_location_and_digests_or_says_it_has_no_record(tmp_path):
    d = dist(tmp_path / "site", "Alpha", "1.2")
    item = env.distribution(d, "/box/site")
    assert (item["name"], item["version"], item["location"], item["dist_info"]) == \
        ("Alpha", "1.2", "/box/site", "Alpha-1.2.dist-info")
    assert item["files_digest"] == env.record_digests(RECORD)["files_digest"]
    (d / "RECORD").unlink()
    assert env.distribution(d, "/box/site")["record_digest"] is None


def test_the_cache_follows_installs_upgrades_and_removals(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "cache"
    dist(site, "alpha", "1.0")
    view = {str(tmp_path): "/opt/tkbox"}
    first = json.loads(env.host_python(view, cache, tmp_path / "no-status", dirs=[site]))
    assert [(d["name"], d["version"], d["location"]) for d in first["distributions"]] == \
        [("alpha", "1.0", "/opt/tkbox/site")]
    assert first["paths"] == ["/opt/tkbox/site"] and first["debian"] == {"unavailable": "no dpkg status on the host"}
    assert len(list(cache.iterdir())) == 1
    t = time.perf_counter()
    assert json.loads(env.host_python(view, cache, tmp_path / "no-status", dirs=[site])) == first
    assert time.perf_counter() - t < 0.05
    dist(site, "beta", "2.0")  # an install
    names = [(d["name"], d["version"]) for d in json.loads(env.host_python(view, cache, tmp_path / "no-status",
                                                                           dirs=[site]))["distributions"]]
    assert names == [("alpha", "1.0"), ("beta", "2.0")]
    (site / "alpha-1.0.dist-info").rename(site / "alpha-1.1.dist-info")  # an upgrade, as pip moves it
    (site / "alpha-1.1.dist-info" / "METADATA").write_text("Name: alpha\nVersion: 1.1\n")
    names = [(d["name"], d["version"]) for d in json.loads(env.host_python(view, cache, tmp_path / "no-status",
                                                                           dirs=[site]))["distributions"]]
    assert names == [("alpha", "1.1"), ("beta", "2.0")]


def test_a_directory_the_box_does_not_see_is_left_out(tmp_path):
    dist(tmp_path / "a", "alpha", "1.0")
    dist(tmp_path / "b", "beta", "1.0")
    got = json.loads(env.host_python({str(tmp_path / "a"): "/a"}, None, tmp_path / "none",
                                     dirs=[tmp_path / "a", tmp_path / "b"]))
    assert [d["name"] for d in got["distributions"]] == ["alpha"] and got["paths"] == ["/a"]


def test_a_name_that_is_not_utf8_is_recorded_as_text(tmp_path):
    """os.listdir keeps such a name as surrogates, which no UTF-8 manifest can hold: it is shown with U+FFFD."""
    site = tmp_path / "s\udcffite"
    d = dist(site, "odd", "1.0").rename(site / "odd\udcff-1.0.dist-info")
    got = env.parse(env.manifest(env.host_python({str(tmp_path): "/b"}, None, tmp_path / "none", dirs=[site]),
                                 "bwrap", "none"))
    [item] = got["environment"]["distributions"]
    assert item["dist_info"] == "odd\ufffd-1.0.dist-info" and item["location"] == "/b/s\ufffdite"
    assert d.is_dir()


def test_dpkg_status_lists_only_installed_packages():
    status = ("Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36-9\n\n"
              "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n\n"
              "Package: python3.11-minimal\nStatus: install ok installed\nArchitecture: amd64\nVersion: 3.11.2-6\n")
    assert env.dpkg_packages(status) == [{"name": "libc6", "version": "2.36-9", "architecture": "amd64"},
                                         {"name": "python3.11-minimal", "version": "3.11.2-6", "architecture": "amd64"}]


def built_root(tree: Path, dpkg: bool = True) -> Path:
    """A root as an image build leaves it before mke2fs: a dpkg status and Debian's and pip's site directories."""
    if dpkg:
        (tree / "var/lib/dpkg").mkdir(parents=True)
        (tree / "var/lib/dpkg/status").write_text(
            "Package: python3.11-minimal\nStatus: install ok installed\nArchitecture: amd64\n"
            "Version: 3.11.2-6+deb12u1\n\n"
            "Package: python3-pandas\nStatus: install ok installed\nArchitecture: all\nVersion: 1.5.3+dfsg-2\n")
    dist(tree / "usr/lib/python3/dist-packages", "pandas", "1.5.3")
    dist(tree / "usr/local/lib/python3.11/dist-packages", "scikit-learn", "1.5.0")
    return tree


def test_an_image_root_names_its_python_distributions_and_debian_packages(tmp_path):
    got = env.image_python(built_root(tmp_path / "root"))
    assert got["interpreter"]["version"] == "3.11.2"
    assert [(d["name"], d["version"], d["location"]) for d in got["distributions"]] == [
        ("scikit-learn", "1.5.0", "/usr/local/lib/python3.11/dist-packages"),
        ("pandas", "1.5.3", "/usr/lib/python3/dist-packages")]
    assert [p["name"] for p in got["debian"]["packages"]] == ["python3-pandas", "python3.11-minimal"]
    bare = env.image_python(built_root(tmp_path / "bare", dpkg=False))
    assert bare["debian"] == {"unavailable": "the image keeps no dpkg status"}


def test_a_vm_box_discloses_its_images_manifest_or_says_the_image_has_none(tmp_path):
    image = tmp_path / "image"
    image.mkdir()
    backend = QemuBackend()
    backend._image = Image("ab" * 16, image)
    old = env.parse(backend.environment(tmp_path / "cache"))
    assert "tkbox image build --force" in old["unavailable"] and old["backend"] == "qemu"
    (image / ENVIRONMENT).write_text(json.dumps(env.image_python(built_root(tmp_path / "root"))))
    m = env.parse(backend.environment(tmp_path / "cache"))
    assert m["image_digest"] == "tkbox-image:" + "ab" * 16 and m["backend"] == "qemu"
    assert ("pandas", "1.5.3") in [(d["name"], d["version"]) for d in m["environment"]["distributions"]]


def good_manifest() -> dict:
    return json.loads(env.manifest({"interpreter": {"implementation": "cpython", "version": "3.11.7",
                                                    "platform": "linux-x86_64", "executable": "/usr/bin/python3"},
                                    "paths": [], "distributions": [
                                        {"name": "a", "version": "1", "location": "/x", "dist_info": "a-1.dist-info",
                                         "record_digest": None}],
                                    "debian": {"unavailable": "none"}}, "bwrap", "none"))


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(format="other/1"), "is not tkbox-environment/1"),
    (lambda m: m.update(environment=[]), "environment is not an object"),
    (lambda m: m["environment"].update(interpreter="cpython"), "interpreter is not an object"),
    (lambda m: m["environment"].update(paths="/usr"), "paths is not a list"),
    (lambda m: m["environment"]["distributions"].append("a"), "distribution 1 is not an object"),
    (lambda m: m["environment"]["distributions"][0].update(version=3), "distribution 0 version"),
    (lambda m: m["environment"]["distributions"][0].update(files_digest="md5:00"), "files_digest is not a sha256"),
    (lambda m: m["environment"]["distributions"][0].update(name="x" * 1001), "distribution 0 name"),
    (lambda m: m["environment"].update(debian={"packages": [{"name": "a"}]}), "debian.packages"),
    (lambda m: m["environment"].update(distributions=[{}] * (env.MAX_ITEMS + 1)), "at most 20000"),
])
def test_a_bundles_manifest_is_read_strictly(change, why):
    m = good_manifest()
    env.parse(env.canonical(m))
    change(m)
    with pytest.raises(ValueError, match=why):
        env.parse(env.canonical(m))
    with pytest.raises(ValueError, match="not JSON"):
        env.parse(b"\xff{")
    with pytest.raises(ValueError, match="over 8 MiB"):
        env.parse(b" " * (env.MAX_BYTES + 1))


def test_the_spliced_manifest_is_the_canonical_encoding():
    """A warm start splices the cached bytes in; the result is byte for byte what canonical() gives."""
    m = good_manifest()
    assert env.manifest(env.canonical(m["environment"]), "bwrap", "none") == env.canonical(m)
    assert env.manifest(m["environment"], "bwrap", "none") == env.canonical(m)


def test_a_bundle_made_before_environments_still_verifies_and_says_it_has_none():
    """tests/data/workspace-tree1.tkb was made by a tkbox that recorded no environment."""
    r = run_cli("verify", str(DATA / "workspace-tree1.tkb"), "--trust", str(DATA / "workspace-tree1.trust.json"))
    assert r.returncode == 0 and r.stdout.startswith("VALID"), r.stdout + r.stderr
    r = run_cli("show", str(DATA / "workspace-tree1.tkb"), "--environment")
    assert r.returncode == 0 and "no environment recorded" in r.stdout, r.stdout + r.stderr
