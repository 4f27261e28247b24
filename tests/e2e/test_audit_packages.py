"""Two real bubblewrap boxes install one project through the package door, the index moving from 1.0 to 2.0 between
them: each bundle records what came in (`Run.installs`, `Run.environment`), and the audit names the difference by
package (`tinypkg: 1.0 in A, 2.0 in B`), while the environment both started with, the same host venv, is equal."""

from __future__ import annotations

import pytest
from testnet import NamespaceNet, available

from tests.e2e.test_packages import publish, sha
from wheels import wheel
from tkbox_nb import Box, Policy, open_run
from tkbox_nb.audit.compare import audit
from tkbox_nb.audit.report import readable
from tkbox_nb.backends.bwrap import BwrapBackend

pytestmark = [pytest.mark.skipif(not BwrapBackend().available()[0], reason=BwrapBackend().available()[1]),
              pytest.mark.skipif(not available()[0], reason=available()[1])]

NET_INDEX = 39  # 198.18.39.0/24: no other test module uses it
ONE, TWO = wheel("tinypkg", "1.0", "VALUE = 1\n"), wheel("tinypkg", "2.0", "VALUE = 2\n")


def test_two_boxes_that_installed_different_versions_are_named_package_by_package(private_signer, tmp_path):
    with NamespaceNet(index=NET_INDEX) as net:
        policy = Policy.from_toml(f'[packages]\nindex = ["http://{net.web}:8080/simple/"]\nallow = ["tinypkg"]\n'
                                  'allow_cidrs = ["198.18.0.0/15"]\n')
        paths = []
        for name, (version, data) in (("a", ("1.0", ONE)), ("b", ("2.0", TWO))):
            publish(net, "tinypkg", f"tinypkg-{version}-py3-none-any.whl", data)  # the index moves on
            paths.append(tmp_path / f"{name}.tkb")
            with Box(backend="bwrap", policy=policy, home=private_signer.home, bundle_path=paths[-1]) as b:
                r = b.run(["python", "-m", "pip", "install", "--no-color", "tinypkg"], timeout=180)
                assert r.exit_code == 0, r.stderr.decode()[-800:]
    a, b = (open_run(p) for p in paths)
    assert a.installs[["project", "version", "sha256", "decision"]].values.tolist() == [
        ["tinypkg", "1.0", sha(ONE), "allow"]]
    env = b.environment
    assert env[env["kind"] == "installed"][["name", "version", "digest"]].values.tolist() == [
        ["tinypkg", "2.0", f"sha256:{sha(TWO)}"]]
    report = audit(*paths)
    kinds = {d.kind for d in report.differences}
    assert "environment" not in kinds  # both started in the same host venv
    pkg = next(d for d in report.differences if d.kind == "packages")
    assert pkg.what == "packages tinypkg #2" and readable(pkg)[0] == "tinypkg: 1.0 in A, 2.0 in B", report.table()
    assert "tinypkg: 1.0 in A, 2.0 in B" in report.table()
