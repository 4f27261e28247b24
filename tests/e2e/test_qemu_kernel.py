"""The Tracekit Box Jupyter kernel with its cells in a QEMU VM: the frontend features of test_kernel.py (results,
errors, stdin, completion and inspection, interrupt) hold when the box is a VM, not only a namespace.

The kernel is a separate process that boots the image its $TKBOX_HOME calls current; here that is the tests' image,
linked into the session's home for the duration of the test only.
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest

from tkbox_nb.bundle.verify import verify_bundle

from .test_kernel import Client, check_input_and_getpass, kernel_env, only_bundle  # noqa: F401 -- kernel_env is a fixture used here

pytestmark = pytest.mark.slow
FIRST_CELL_S = 420  # a VM boot and `import ipykernel` under TCG on a loaded 2-CPU host


@pytest.fixture
def test_image_is_current(tkbox_home, qemu_image):
    images = Path(tkbox_home) / "images"
    images.mkdir(exist_ok=True)
    link = images / qemu_image.digest
    made = not link.exists()
    if made:
        link.symlink_to(qemu_image.path, target_is_directory=True)
    current = images / "current"
    before = current.read_text() if current.exists() else None
    current.write_text(qemu_image.digest + "\n")
    yield qemu_image
    if before is None:
        current.unlink()
    else:
        current.write_text(before)
    if made:
        link.unlink()


def test_cells_stdin_completion_and_interrupt_in_a_vm(kernel_env, test_image_is_current):  # noqa: F811
    client = Client()
    try:
        reply, _ = client.run('%%box_policy\n[box]\nbackend = "qemu"\nmemory_mib = 768\n')
        assert reply["status"] == "ok"
        reply, outs = client.run("import platform\nx = 41\nprint('in', platform.node())\nplatform.release()",
                                 timeout=FIRST_CELL_S)
        assert reply["status"] == "ok", outs
        assert ("stream", {"name": "stdout", "text": "in tkbox\n"}) in outs
        assert any(t == "execute_result" and "cloud-amd64" in c["data"]["text/plain"] for t, c in outs)

        check_input_and_getpass(client)

        client.kc.complete("platform.rel", 12)
        matches = client.kc.get_shell_msg(timeout=60)["content"]["matches"]
        assert any(m in ("release", "platform.release") for m in matches), matches
        client.kc.inspect("x", 1)
        assert "int" in client.kc.get_shell_msg(timeout=60)["content"]["data"]["text/plain"]

        msg_id = client.kc.execute("import time; time.sleep(120)")
        time.sleep(3)
        t = time.monotonic()
        client.km.interrupt_kernel()
        reply = client.kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - t < 30
        for _ in range(5):  # ipykernel aborts what reaches it while it still flushes after an error (stop_on_error)
            reply, outs = client.run("x + 1", timeout=120)
            if reply["status"] != "aborted":
                break
            time.sleep(1)
        assert any(k == "execute_result" and c["data"]["text/plain"] == "42" for k, c in outs), (reply, outs)
        reply, outs = client.run("1 / 0", timeout=120)
        assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    finally:
        client.stop()
    bundle = only_bundle(kernel_env)
    assert verify_bundle(bundle).valid
    with zipfile.ZipFile(bundle) as z:
        manifest = json.loads(z.read("box/manifest.json"))
    assert manifest["backend"] == "qemu" and manifest["image_digest"] == f"tkbox-image:{test_image_is_current.digest}"
