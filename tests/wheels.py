"""Packages made by hand, byte for byte the same each time: what the package door's tests and `python -m bench
packages` publish on their local index (tests/testnet.py), so no test or benchmark needs PyPI.

`wheel` is a pure-Python wheel; `sdist` a PEP 517 source distribution, and `backend_wheel` the wheel of its build
backend. pip builds an sdist in an isolated environment (its default) and asks the index for the build requirements
the sdist's pyproject.toml names, as it would ask PyPI for setuptools: the test index serves the backend's wheel, so
that request crosses the package door like any other. Not setuptools: the one in the host venv (65.5) builds a
wheel only with the `wheel` distribution, which the venv does not have, and no test may fetch one.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import tarfile
import zipfile

FIXED = (2020, 1, 1, 0, 0, 0)
FIXED_EPOCH = 1577836800  # 2020-01-01T00:00:00Z


def _record(files: dict[str, bytes], info: str) -> bytes:
    return ("".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
                    f",{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n").encode()


def _zip(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(zipfile.ZipInfo(path, date_time=FIXED), data)
    return out.getvalue()


def wheel(name: str, version: str, module: str, generator: str = "tkbox-test") -> bytes:
    """A pure-Python wheel: the module, METADATA, WHEEL and RECORD, written with fixed times (the same bytes each
    time)."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": module.encode(),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: {generator}\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n").encode()}
    files[f"{info}/RECORD"] = _record(files, info)
    return _zip(files)


BACKEND = "tkbox-test-backend"
BACKEND_VERSION = "1.0"

# The build backend (PEP 517's build_wheel hook; pip asks nothing else of it): the wheel of the sdist it runs in,
# named and versioned by its PKG-INFO, holding the package directory next to it. Standard library only.
BACKEND_MODULE = """\
import base64, hashlib, os, zipfile


def _meta():
    fields = dict(line.split(": ", 1) for line in open("PKG-INFO").read().splitlines() if ": " in line)
    return fields["Name"], fields["Version"]


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, version = _meta()
    package = name.lower().replace("-", "_").replace(".", "_")
    info = f"{package}-{version}.dist-info"
    files = {}
    for root, _, names in sorted(os.walk(package)):
        for n in sorted(names):
            if not n.endswith(".pyc"):
                files[os.path.join(root, n).replace(os.sep, "/")] = open(os.path.join(root, n), "rb").read()
    files[info + "/METADATA"] = f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n".encode()
    files[info + "/WHEEL"] = (b"Wheel-Version: 1.0\\nGenerator: tkbox-test-backend\\nRoot-Is-Purelib: true\\n"
                              b"Tag: py3-none-any\\n")
    record = "".join(p + ",sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
                     + f",{len(d)}\\n" for p, d in files.items()) + info + "/RECORD,,\\n"
    files[info + "/RECORD"] = record.encode()
    out = f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, out), "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0)), d)
    return out
"""


def backend_wheel() -> tuple[str, bytes]:
    """(file name, bytes) of the build backend's wheel: project `tkbox-test-backend`, module `tkbox_test_backend`."""
    module = BACKEND.replace("-", "_")
    return f"{module}-{BACKEND_VERSION}-py3-none-any.whl", wheel(module, BACKEND_VERSION, BACKEND_MODULE)


def sdist(name: str, version: str, module: str) -> tuple[str, bytes]:
    """(file name, bytes) of a source distribution as PEP 517 and 625 have it: `{name}-{version}.tar.gz` (the name
    in its normal form, `_` for `-`), one top directory holding PKG-INFO, a pyproject.toml whose build system
    requires `tkbox-test-backend` (backend_wheel) and the package (the name with `_`) with `module` as its
    __init__.py. A gzipped tar with fixed times, owners and order: the same bytes each time."""
    import re
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"
    package = re.sub(r"[-.]+", "_", name).lower()
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        "pyproject.toml": (f'[build-system]\nrequires = ["{BACKEND}"]\nbuild-backend = '
                           f'"{BACKEND.replace("-", "_")}"\n\n[project]\nname = "{name}"\nversion = "{version}"\n'
                           ).encode(),
        f"{package}/__init__.py": module.encode(),
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(f"{stem}/{path}")
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), FIXED_EPOCH, 0o644, "", ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return f"{stem}.tar.gz", out.getvalue()
