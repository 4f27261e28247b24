"""Fixtures of the end-to-end tests that boot VMs: the guest image they share, built once and cached across runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tkbox_nb import Box
from tkbox_nb.backends.image import build_image, find_image
from tkbox_nb.backends.qemu import QemuBackend
from tkbox_nb.errors import TkboxError

TEST_PACKAGES = ["python3", "python3-ipykernel"]
IMAGE_HOME = Path(os.environ.get("TKBOX_TEST_IMAGE_HOME", "/var/tmp/tkbox-test-images"))


def qemu_box(image, warm: bool = True, **kw) -> Box:
    """A QEMU box on `image` (the test image, not the user's default one): made as a bwrap box, then its backend
    swapped before it starts."""
    box = Box(backend="bwrap", **kw)
    box.backend = QemuBackend(image=image, warm=warm)
    return box


@pytest.fixture(scope="session")
def qemu_image():
    """The test guest image (a smaller package set than the default image): QEMU boots it, and the Firecracker
    backend's tests convert its kernel."""
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
    if not shutil.which("mmdebstrap") and find_image(TEST_PACKAGES, home=IMAGE_HOME) is None:
        pytest.skip("no cached test image and no mmdebstrap to build one (apt-get install mmdebstrap)")
    try:
        image, _ = build_image(TEST_PACKAGES, home=IMAGE_HOME, say=lambda s: None)
    except TkboxError as e:
        pytest.skip(f"the guest image cannot be built here: {e}")
    return image
