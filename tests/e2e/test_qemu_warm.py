"""Warm starts of QEMU boxes (tkbox_nb/backends/warm_start.py): each box restored from one template's saved state
is its own box (randomness, clock, config, workspace), its first kernel (the zygote) is the kernel a cold box would
have, and its run names the state it started from."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import pytest

from tkbox_nb import Box, Policy
from tkbox_nb.backends.qemu import QemuBackend
from tkbox_nb.backends.warm_start import WarmState, find_state, state_key, warm_state
from tkbox_nb.bundle.verify import verify_bundle

from .conftest import qemu_box

pytestmark = pytest.mark.slow

PROBE = r"""
import json, os, random, sys, time
print(json.dumps({"urandom": os.urandom(16).hex(), "random": random.random(), "time": time.time(),
  "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(), "cwd": os.getcwd(),
  "env": sorted(os.environ), "box_id": os.environ.get("TKBOX_BOX_ID"), "seed": sorted(os.listdir("/workspace")),
  "ws_kib": os.statvfs("/workspace").f_blocks * os.statvfs("/workspace").f_frsize // 1024}))
"""
KERNEL_PROBE = r"""
import json, os, random, sys
print(json.dumps({"path": sys.path, "cwd": os.getcwd(), "env": sorted(os.environ), "random": random.random(),
                  "pid": os.getpid(), "argv": sys.argv}))
"""


def _box(image, tmp_path: Path, name: str, warm: bool = True, **kw) -> Box:
    return qemu_box(image, warm, bundle_path=tmp_path / f"{name}.tkb", **kw)


def _cell_json(box: Box, code: str) -> dict:
    r = box.execute(code)
    assert r.status == "ok", r
    return json.loads("".join(o.get("text", "") for o in r.outputs if o.get("output_type") == "stream"))


def _boot_fact(bundle: Path) -> str:
    with zipfile.ZipFile(bundle) as z:
        return json.loads(z.read("box/manifest.json")).get("boot")


@pytest.fixture(scope="module")
def state(signer, qemu_image) -> WarmState:
    backend = QemuBackend(image=qemu_image)
    default = Policy.coerce(None)
    return warm_state(backend, default.get("box", "memory_mib"), default.get("box", "cpus"), 300)


def test_warm_boxes_are_each_their_own(signer, qemu_image, state, tmp_path):
    """Two boxes restored from one saved state: fresh randomness (kernel, Python, boot id), the host's time, and
    each its own config disk (environment, workspace seed and size) despite the template's cached blocks."""
    seen = []
    for i, ws_mib in enumerate((64, 96)):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        (ws / f"only-in-{i}.txt").write_text(str(i))
        policy = Policy.from_toml(f"[box]\nworkspace_mib = {ws_mib}\n")
        t = time.monotonic()
        with _box(qemu_image, tmp_path, f"w{i}", policy=policy, workspace=ws) as box:
            r = box.run(["python3", "-c", PROBE])
            took = time.monotonic() - t
            assert r.exit_code == 0, r.stderr
            probe = json.loads(r.stdout)
        seen.append(probe)
        assert probe["seed"] == [f"only-in-{i}.txt"] and probe["box_id"] == box.box_id
        assert ws_mib * 1024 * 0.9 < probe["ws_kib"] <= ws_mib * 1024
        assert abs(probe["time"] - time.time()) < 60, "the guest's clock is the host's, not the template's"
        assert took < 60
        assert _boot_fact(tmp_path / f"w{i}.tkb") == state.boot_fact
        assert verify_bundle(tmp_path / f"w{i}.tkb").valid
    for key in ("urandom", "random", "boot_id"):
        assert seen[0][key] != seen[1][key], f"{key} is the same in two warm boxes"


def test_a_warm_first_kernel_is_the_kernel_a_cold_box_has(signer, qemu_image, state, tmp_path):
    """The zygote made ahead in the template and a kernel started cold see the same sys.path, directory and
    environment; two warm boxes' first kernels draw different random numbers."""
    with _box(qemu_image, tmp_path, "k1") as b1:
        warm1 = _cell_json(b1, KERNEL_PROBE)
    with _box(qemu_image, tmp_path, "k2") as b2:
        warm2 = _cell_json(b2, KERNEL_PROBE)
    with _box(qemu_image, tmp_path, "kc", warm=False) as bc:
        cold = _cell_json(bc, KERNEL_PROBE)
    assert _boot_fact(tmp_path / "kc.tkb") == "cold"
    assert _boot_fact(tmp_path / "k1.tkb") == state.boot_fact
    for key in ("path", "cwd", "env"):
        assert warm1[key] == cold[key], (key, warm1[key], cold[key])
    assert warm1["argv"][:2] == cold["argv"][:2]  # the launcher, -f (then each box's own connection file)
    assert warm1["random"] != warm2["random"]


def test_a_state_file_that_is_not_whole_or_not_private_is_not_used(qemu_image, state, tmp_path):
    """find_state takes a saved state only at its recorded size and mode 0600: a torn or widened file is made again
    rather than restored."""
    import shutil
    from tkbox_nb.backends.image import Image
    image = Image(qemu_image.digest, tmp_path / "img")
    (image.path / "warm").mkdir(parents=True)
    key = state.path.stem
    shutil.copy(state.path, image.path / "warm" / f"{key}.vmstate")
    shutil.copy(state.path.with_suffix(".json"), image.path / "warm" / f"{key}.json")
    os.chmod(image.path / "warm" / f"{key}.vmstate", 0o600)
    assert find_state(image, key) is not None
    os.chmod(image.path / "warm" / f"{key}.vmstate", 0o644)
    assert find_state(image, key) is None
    os.chmod(image.path / "warm" / f"{key}.vmstate", 0o600)
    os.truncate(image.path / "warm" / f"{key}.vmstate", state.path.stat().st_size // 2)
    assert find_state(image, key) is None
    assert state_key(qemu_image, 2048, 1, "tcg", "/usr/bin/qemu-system-x86_64") != \
        state_key(qemu_image, 2048, 2, "tcg", "/usr/bin/qemu-system-x86_64")


def test_making_a_state_leaves_no_template_running(signer, qemu_image, tmp_path):
    """A new machine size makes a new saved state: the template VM is gone afterwards and the file is private."""
    backend = QemuBackend(image=qemu_image)
    made = warm_state(backend, 320, 1, 300)
    assert made.path.stat().st_mode & 0o777 == 0o600
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_template(pid)]


def _is_template(pid: str) -> bool:
    try:
        return b"tkbox-tpl-" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_state_that_does_not_restore_is_set_aside_and_made_again(signer, qemu_image, state, tmp_path):
    """A saved state QEMU cannot load (here its stream header is damaged) fails that one box with QEMU's reason, is
    set aside, and the next box makes a new state and starts."""
    from tkbox_nb.core.errors import TkboxError
    # no QEVM magic: QEMU refuses the stream
    image, copy, key = _image_with_a_changed_state(qemu_image, state, tmp_path, lambda data: b"\0" * 8 + data[8:])
    assert find_state(image, key) is not None
    box = _box(image, tmp_path, "bad")
    with pytest.raises(TkboxError, match="saved state is set aside.*(migration|magic|load)"):
        box.start()
    box.stop()
    assert find_state(image, key) is None and (copy / "warm" / f"{key}.vmstate.bad").exists()
    with _box(image, tmp_path, "again") as again:
        assert again.run(["echo", "ok"]).stdout == b"ok\n"
    assert find_state(image, key) is not None
    assert _boot_fact(tmp_path / "again.tkb") == find_state(image, key).boot_fact


def test_a_state_whose_bytes_are_not_those_recorded_fails_before_the_go_and_is_set_aside(signer, qemu_image, state,
                                                                                         tmp_path):
    """The run signs `warm:sha256:` of the state as it was made; a state changed since (same size, owner, mode: the
    checks find_state makes) is hashed as QEMU reads it, and the box fails before the GO, naming both hashes."""
    from tkbox_nb.core.errors import TkboxError
    # the stream's last byte: QEMU may still load it; the hash cannot match
    image, copy, key = _image_with_a_changed_state(qemu_image, state, tmp_path,
                                                   lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert find_state(image, key) is not None  # size, owner and mode all pass
    box = _box(image, tmp_path, "changed")
    with pytest.raises(TkboxError, match=f"not those recorded.*recorded {state.sha256[:16]}"):
        box.start()
    box.stop()
    assert find_state(image, key) is None and (copy / "warm" / f"{key}.vmstate.bad").exists()
    assert "not those recorded" in open_run_reason(tmp_path / "changed.tkb")


def _image_with_a_changed_state(qemu_image, state: WarmState, tmp_path: Path, change) -> tuple:
    """(image, its folder, the state's key): a copy of the image (its files linked) whose saved state is `state`'s
    stream passed through `change`, with the mode and record find_state checks as they were made."""
    from tkbox_nb.backends.image import Image
    copy = tmp_path / "img"
    (copy / "warm").mkdir(parents=True)
    for f in ("vmlinuz", "initrd.img", "root.img", "manifest.json"):
        (copy / f).symlink_to(qemu_image.path / f)
    key = state.path.stem
    changed = copy / "warm" / f"{key}.vmstate"
    changed.write_bytes(change(state.path.read_bytes()))
    os.chmod(changed, 0o600)
    (copy / "warm" / f"{key}.json").write_bytes(state.path.with_suffix(".json").read_bytes())
    return Image(qemu_image.digest, copy), copy, key


def open_run_reason(bundle: Path) -> str:
    from tkbox_nb.bundle.read_back import open_run
    return open_run(bundle).box["end_reason"]
