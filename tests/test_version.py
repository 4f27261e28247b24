"""The version in tkbox_nb/_version.py is the one the package is built with (pyproject.toml), and the package
gives the same: it is kept in a leaf module so the recorder and the kernel can read it without the package."""

import tomllib
from pathlib import Path

import tkbox_nb
from tkbox_nb._version import __version__


def test_the_leaf_version_is_the_built_version_and_the_package_s():
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert __version__ == pyproject["project"]["version"] == tkbox_nb.__version__
