"""Pure-Python wheels made by hand, byte for byte the same each time: what the package door's tests and
`python -m bench packages` publish on their local index (tests/testnet.py), so no test or benchmark needs PyPI."""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile


def wheel(name: str, version: str, module: str, generator: str = "tkbox-test") -> bytes:
    """A pure-Python wheel: the module, METADATA, WHEEL and RECORD, written with fixed times (the same bytes each
    time)."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": module.encode(),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: {generator}\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n").encode()}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
                     f",{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return out.getvalue()
