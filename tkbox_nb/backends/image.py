"""Guest images for the QEMU backend: a Debian cloud kernel, an initramfs, and a read-only ext4 root, cached by digest.

An image is three files under $TKBOX_HOME/images/<digest>/ (vmlinuz, initrd.img, root.img) and a manifest. The digest
names every input (Debian suite and mirror, package list, kernel package, the guest agent's source, the init script
and this builder's version), so an unchanged image is never rebuilt and a run names exactly what it booted. Two
decisions shaped it: nothing is ever mounted on the host (the root is made by `mke2fs -d` from a directory that
mmdebstrap filled), and the guest agent lives in the initramfs rather than the root, so an agent change rebuilds a
few hundred kilobytes instead of the whole root (roots are cached apart, under images/roots/, by their own digest).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tkbox_nb.core.errors import TkboxError
# CONFIG_LABEL, MOUNT_LABEL and DOOR_NAME too: the VM backends take them from here, with the image they name
from tkbox_nb.backends.initramfs import (CONFIG_LABEL, DOOR_NAME, INIT, MODULES, MOUNT_LABEL,  # noqa: F401
                                         MOUNT_MODULES, MOUNT_SERIAL, ROOT_LABEL, VSOCK_MODULES, agent_digest,
                                         is_static, make_initramfs)

BUILDER_VERSION = "2"  # bump when the way a root is made changes
SUITE = "bookworm"
DEFAULT_PACKAGES = ("python3", "python3-ipykernel", "python3-numpy", "python3-pandas", "python3-matplotlib")
KERNEL_PACKAGE = "linux-image-cloud-amd64"
# debugpy: ipykernel imports it when present (seconds under TCG), and no debug request is forwarded to a box
REMOVE = ("usr/lib/python3/dist-packages/debugpy",)
PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}$")  # a Debian package name
ENVIRONMENT = "environment.json"  # the image's environment manifest part (bundle/environment.py), made from its root
TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt", "var/lib/apt/lists",
        "var/log")


@dataclass(frozen=True)
class Image:
    """A built guest image: where its files are and the digest that names it."""

    digest: str
    path: Path

    @property
    def kernel(self) -> Path:
        return self.path / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.path / "initrd.img"

    @property
    def root(self) -> Path:
        return self.path / "root.img"

    def size_bytes(self) -> int:
        """Disk space the image's files take (the root is sparse: its blocks, not its length)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.iterdir() if f.is_file())

    def manifest(self) -> dict:
        return json.loads((self.path / "manifest.json").read_text())


def images_dir(home: Path | None = None) -> Path:
    from tkbox_nb.core.home import default_home
    return Path(home or default_home()) / "images"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources), else deb.debian.org."""
    texts = []
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if f.is_file() and f.suffix in (".list", ".sources"):
            with contextlib.suppress(OSError):
                texts.append(f.read_text())
    for text in texts:
        for m in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            uri = m.group(1).rstrip("/")
            if uri.startswith("http") and not uri.endswith("-security") and "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


PIP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}(\[[A-Za-z0-9,._-]{1,100}\])?"
                    r"((==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!-]{1,50})?$")  # name[extras] and one version clause


def check_pip(requirements: list[str]) -> list[str]:
    bad = [r for r in requirements if not PIP_RE.match(r)]
    if bad:
        raise TkboxError(f"not a pip requirement this builder takes (NAME[extras] and one version clause): {bad[0]!r}")
    return sorted(set(requirements))


def check_packages(packages: list[str]) -> list[str]:
    bad = [p for p in packages if not PACKAGE_RE.match(p)]
    if bad:
        raise TkboxError(f"not a Debian package name: {bad[0]!r}")
    return sorted(set(packages))


def inputs(packages: list[str] | None = None, kernel: str = KERNEL_PACKAGE, pip: list[str] | None = None
           ) -> tuple[dict, dict]:
    """(root inputs, all inputs): what the root's digest and the image's digest are computed over."""
    pip = check_pip(list(pip or []))
    pkgs = check_packages(list(packages if packages is not None else DEFAULT_PACKAGES)
                          + (["python3-pip"] if pip else []))
    check_packages([kernel])
    root = {"builder": BUILDER_VERSION, "suite": SUITE, "mirror": debian_mirror(), "packages": pkgs,
            "trim": list(TRIM), "remove": list(REMOVE)}
    if pip:  # only then, so that images without pip packages keep their digests
        root["pip"] = pip
    full = {**root, "root": _sha(json.dumps(root, sort_keys=True).encode()), "kernel": kernel,
            "modules": list(MODULES + VSOCK_MODULES + MOUNT_MODULES), "init": _sha(INIT.encode()),
            "agent": agent_digest()}
    return root, full


def digest_of(obj: dict) -> str:
    return _sha(json.dumps(obj, sort_keys=True).encode())[:32]


def current_image(home: Path | None = None) -> Image | None:
    """The image `tkbox image build` built or found last (what a qemu box boots), else the default inputs' image."""
    base = images_dir(home)
    try:
        digest = (base / "current").read_text().strip()
    except OSError:
        digest = ""
    if re.fullmatch(r"[0-9a-f]{32}", digest) and (base / digest / "manifest.json").is_file():
        return Image(digest, base / digest)
    return find_image(home=home)


def find_image(packages: list[str] | None = None, kernel: str = KERNEL_PACKAGE, home: Path | None = None,
               pip: list[str] | None = None) -> Image | None:
    """The cached image for these inputs, or None when it has not been built."""
    _, full = inputs(packages, kernel, pip)
    d = digest_of(full)
    path = images_dir(home) / d
    return Image(d, path) if (path / "manifest.json").is_file() else None


class _Progress:
    def __init__(self, say: Callable[[str], None]):
        self.say, self.t0 = say, time.monotonic()

    def step(self, text: str) -> None:
        self.say(f"[{time.monotonic() - self.t0:6.1f}s] {text}")


def _run(argv: list[str], progress: _Progress, what: str, stream: bool = False, **kw) -> str:
    """Run a build tool; with `stream`, pass its lines on as progress. A failure is one line naming the tool."""
    if not shutil.which(argv[0]):
        raise TkboxError(f"image build needs {argv[0]} (apt-get install {TOOLS.get(argv[0], argv[0])})")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            **kw)
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if stream and line:
            progress.step(f"  {line[:160]}")
    if proc.wait() != 0:
        last = next((t for t in reversed(tail) if t.strip()), "no output")
        raise TkboxError(f"image build: {what} failed ({argv[0]} exit {proc.returncode}): {last[:300]}")
    return "\n".join(tail)


TOOLS = {"mmdebstrap": "mmdebstrap", "mke2fs": "e2fsprogs", "apt-get": "apt", "dpkg-deb": "dpkg",
         "apt-cache": "apt"}


def _du(path: Path) -> tuple[int, int]:
    total = files = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            files += 1
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total, files


def make_ext4(src: Path, out: Path, label: str, slack_mib: int = 16, uuid: str | None = None) -> None:
    """An ext4 image of `src`, made without mounting (`mke2fs -d`), sized to its content plus room for metadata.
    With `uuid`, the file system's UUID and its directory hash seed are that one (not random) and mke2fs's own clock
    is fixed (E2FSPROGS_FAKE_TIME), so two makes of the same content differ at most in the inodes' times, which
    `-d` copies from the files it reads (their change times cannot be set)."""
    used, files = _du(src)
    size_kib = (used * 11 // 10 + (files + 1024) * 256 + (slack_mib << 20)) // 1024  # + inode tables
    fixed, env = [], None
    if uuid is not None:
        fixed, env = ["-U", uuid, "-E", f"root_owner=0:0,hash_seed={uuid}"], {**os.environ, "E2FSPROGS_FAKE_TIME": "1"}
    _run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", label, "-N", str(files + 1024), "-m", "0",
          "-O", "^has_journal", *(fixed or ["-E", "root_owner=0:0"]), "-d", str(src), str(out), f"{size_kib}K"],
         _Progress(lambda s: None), f"making {label}", env=env)


def ext4_uuid(image: Path) -> str:
    """The UUID of the ext4 file system in `image` (one this host made), as `findfs UUID=` in the guest spells it."""
    with open(image, "rb") as f:
        f.seek(1024 + 56)
        magic = f.read(2)
        f.seek(1024 + 104)
        raw = f.read(16)
    if magic != b"\x53\xef" or len(raw) != 16:
        raise TkboxError(f"{image} is not an ext4 image")
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _build_root(root_inputs: dict, out: Path, progress: _Progress, work: Path) -> dict:
    tree = work / "root"
    progress.step(f"root: mmdebstrap {SUITE} from {root_inputs['mirror']} with {', '.join(root_inputs['packages'])}")
    excludes = [f"--dpkgopt=path-exclude=/{p}/*" for p in ("usr/share/doc", "usr/share/man", "usr/share/info",
                                                              "usr/share/locale")]
    _run(["mmdebstrap", "--variant=essential", "--mode=root" if os.geteuid() == 0 else "--mode=unshare",
          "--include=" + ",".join(root_inputs["packages"]), *excludes, "--aptopt=APT::Install-Recommends \"false\"",
          "--dpkgopt=path-include=/usr/share/doc/*/copyright",
          *_pip_hook(root_inputs.get("pip", [])), SUITE, str(tree), root_inputs["mirror"]], progress, "mmdebstrap",
         stream=True)
    for rel in TRIM:
        p = tree / rel
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
    for rel in REMOVE:
        shutil.rmtree(tree / rel, ignore_errors=True)
    for rel in ("workspace", "opt/tkbox", "run", "tmp"):
        (tree / rel).mkdir(parents=True, exist_ok=True)
    etc_tkbox = tree / "etc" / "tkbox"
    if etc_tkbox.exists() or etc_tkbox.is_symlink():
        shutil.rmtree(etc_tkbox, ignore_errors=True) if etc_tkbox.is_dir() else etc_tkbox.unlink()
    etc_tkbox.symlink_to("/run/tkbox/config")  # the per-box CA bundle arrives on the config disk
    (tree / "etc" / "hostname").write_text("tkbox\n")
    (tree / "etc" / "hosts").write_text("127.0.0.1 localhost tkbox\n::1 localhost\n")
    (tree / "etc" / "resolv.conf").unlink(missing_ok=True)
    (tree / "etc" / "resolv.conf").write_text("# no name servers in a box: names are resolved on the host\n")
    versions = {}
    status = tree / "var" / "lib" / "dpkg" / "status"
    if status.is_file():
        for block in status.read_text(errors="replace").split("\n\n"):
            name = re.search(r"^Package: (\S+)", block, re.M)
            ver = re.search(r"^Version: (\S+)", block, re.M)
            if name and ver and name.group(1) in root_inputs["packages"]:
                versions[name.group(1)] = ver.group(1)
    from tkbox_nb.bundle.environment import image_python  # from the root as built, before it becomes an ext4 image
    (work / ENVIRONMENT).write_text(json.dumps(image_python(tree), sort_keys=True))
    used, files = _du(tree)
    progress.step(f"root: {used >> 20} MiB in {files} files; mke2fs -d (no mount)")
    make_ext4(tree, out, ROOT_LABEL, slack_mib=32)
    shutil.rmtree(tree, ignore_errors=True)
    return versions


def _pip_hook(requirements: list[str]) -> list[str]:
    """pip packages, installed in the chroot by mmdebstrap's customize hook (the one step that reaches PyPI)."""
    if not requirements:
        return []
    import shlex
    args = " ".join(shlex.quote(r) for r in requirements)
    # pip in the chroot trusts what the host trusts for HTTPS (a site's own CA, an inspecting proxy's), and takes
    # nothing else from this process's environment but the proxy settings: the image must not depend on our PIP_*.
    ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("REQUESTS_CA_BUNDLE"),
                           os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt")
               if c and os.path.isfile(c)), None)
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in os.environ.items()
                   if k.lower() in ("http_proxy", "https_proxy", "no_proxy"))
    hooks = []
    cert = ""
    if ca:
        hooks.append(f'--customize-hook=cp {shlex.quote(ca)} "$1/tmp/tkbox-pip-ca.pem"')
        cert = "--cert /tmp/tkbox-pip-ca.pem "
    hooks.append(f'--customize-hook=chroot "$1" env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp {env} '
                 f'python3 -m pip install --no-cache-dir --break-system-packages --no-warn-script-location '
                 f'--progress-bar off --disable-pip-version-check {cert}{args}')
    hooks.append('--customize-hook=rm -f "$1/tmp/tkbox-pip-ca.pem"')
    return hooks


def _fetch_kernel(kernel: str, work: Path, progress: _Progress) -> tuple[Path, Path, str]:
    """Download the kernel package (and the versioned package a metapackage names) with apt; extract, no install."""
    name = kernel
    dep = subprocess.run(["apt-cache", "depends", "--important", kernel], capture_output=True, text=True)
    for m in re.finditer(r"Depends: (linux-image-\S+)", dep.stdout):
        name = m.group(1)
    progress.step(f"kernel: apt-get download {name}")
    dl = work / "deb"
    dl.mkdir()
    os.chmod(dl, 0o777)
    _run(["apt-get", "download", "-q", name], progress, f"downloading {name} (apt-get update may help)", cwd=dl)
    debs = list(dl.glob("*.deb"))
    if len(debs) != 1:
        raise TkboxError(f"image build: apt-get download {name} gave no single package")
    version = debs[0].name.split("_")[1]
    x = work / "kernel"
    _run(["dpkg-deb", "-x", str(debs[0]), str(x)], progress, "extracting the kernel")
    vmlinuz = sorted((x / "boot").glob("vmlinuz-*"))
    mods = sorted((x / "lib" / "modules").glob("*"))
    if not vmlinuz or not mods:
        raise TkboxError(f"image build: {name} holds no vmlinuz or modules")
    return vmlinuz[0], mods[0], f"{name} {version}"


def build_image(packages: list[str] | None = None, kernel: str = KERNEL_PACKAGE, home: Path | None = None,
                say: Callable[[str], None] | None = None, force: bool = False, pip: list[str] | None = None,
                make_current: bool = False) -> tuple[Image, bool]:
    """Build (or find) the image for these inputs. Returns (image, built): built is False when the cache had it.
    `make_current`: qemu boxes boot this image from now on (`tkbox image build` does this)."""
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    progress = _Progress(say)
    root_inputs, full = inputs(packages, kernel, pip)
    digest = digest_of(full)
    base = images_dir(home)
    base.mkdir(parents=True, exist_ok=True)
    final = base / digest
    with open(base / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time per cache: a second caller finds the first's image
        if (final / "manifest.json").is_file() and not force:
            if make_current:
                _set_current(base, digest)
            return Image(digest, final), False
        work = Path(tempfile.mkdtemp(prefix=f".build-{digest[:8]}-", dir=base))
        os.chmod(work, 0o755)  # apt's download user must reach it
        try:
            roots = base / "roots"
            roots.mkdir(exist_ok=True)
            root_digest = digest_of(root_inputs)
            root_img = roots / f"{root_digest}.img"
            root_meta = roots / f"{root_digest}.json"
            root_env = roots / f"{root_digest}.{ENVIRONMENT}"
            if root_img.is_file() and root_meta.is_file() and not force:
                progress.step(f"root: cached ({root_img})")
                versions = json.loads(root_meta.read_text())
            else:
                versions = _build_root(root_inputs, work / "root.img", progress, work)
                os.replace(work / ENVIRONMENT, root_env)
                os.replace(work / "root.img", root_img)
                root_meta.write_text(json.dumps(versions, sort_keys=True))
            vmlinuz, modules, kernel_version = _fetch_kernel(kernel, work, progress)
            busybox = Path(shutil.which("busybox") or "/bin/busybox")
            if not busybox.is_file() or not is_static(busybox):
                raise TkboxError("image build needs a static busybox (apt-get install busybox-static)")
            progress.step("initramfs: busybox, virtio modules, guest agent")
            out = work / "image"
            out.mkdir()
            (out / "initrd.img").write_bytes(make_initramfs(modules, busybox))
            shutil.copy2(vmlinuz, out / "vmlinuz")
            os.link(root_img, out / "root.img")
            if root_env.is_file():  # a root built before environments were recorded has none: its boxes say so
                shutil.copyfile(root_env, out / ENVIRONMENT)
            manifest = {"digest": digest, "inputs": full, "kernel_package": kernel_version, "versions": versions,
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(out, final)
            if make_current:
                _set_current(base, digest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    image = Image(digest, final)
    progress.step(f"image {digest}: {image.size_bytes() / 2**20:.0f} MiB in {final}")
    return image, True


def prune(home: Path | None = None, keep: set[str] | None = None) -> tuple[int, int]:
    """Remove every cached image but the current one (and `keep`), then every root no image links to any more.
    Returns (images removed, bytes freed). Never touches a build in progress (its lock is held)."""
    base = images_dir(home)
    if not base.is_dir():
        return 0, 0
    current = current_image(home)
    keep = set(keep or ()) | ({current.digest} if current else set())
    removed = freed = 0
    with open(base / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for d in base.iterdir():
            if d.is_dir() and re.fullmatch(r"[0-9a-f]{32}", d.name) and d.name not in keep:
                freed += sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file() and f.stat().st_nlink == 1)
                shutil.rmtree(d)
                removed += 1
        for img in (base / "roots").glob("*.img") if (base / "roots").is_dir() else []:
            if img.stat().st_nlink == 1:  # no image directory holds a link to it
                freed += img.stat().st_blocks * 512
                img.unlink()
                img.with_suffix(".json").unlink(missing_ok=True)
    return removed, freed


def _set_current(base: Path, digest: str) -> None:
    tmp = base / f".current-{os.getpid()}"
    tmp.write_text(digest + "\n")
    os.replace(tmp, base / "current")
