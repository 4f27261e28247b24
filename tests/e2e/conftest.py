"""Fixtures of the end-to-end tests that boot VMs: the guest image they share, built once and cached across runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tkbox_nb.backends.image import build_image, find_image
from tkbox_nb.errors import TkboxError

TEST_PACKAGES = ["python3", "python3-ipykernel"]
IMAGE_HOME = Path(os.environ.get("TKBOX_TEST_IMAGE_HOME", "/var/tmp/tkbox-test-images"))


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
