"""Which backends this version has, and `backend = "auto"`: the one module that knows every backend by name.

It sits above the backends (each of which knows only the interface in base.py and the shared helpers below it), so a
new backend is added here and nowhere else. The backends are imported inside the functions, not at the top: a
process that never starts a box (`tkbox verify`, `tkbox replay`) imports this package without loading any VMM code.
"""

from __future__ import annotations

from tkbox_nb.core.errors import TkboxError
from tkbox_nb.backends.base import ISOLATION_LEVELS, Backend

BACKENDS = ("bwrap", "qemu", "firecracker")


def candidates() -> dict[str, type]:
    """Every backend class this version has, by the name a policy's `box.backend` gives."""
    from tkbox_nb.backends.bwrap import BwrapBackend
    from tkbox_nb.backends.firecracker import FirecrackerBackend
    from tkbox_nb.backends.qemu import QemuBackend
    return {"bwrap": BwrapBackend, "qemu": QemuBackend, "firecracker": FirecrackerBackend}


def choose_backend(minimum: str = "namespace", jailer: bool = False) -> tuple[Backend | None, list[str]]:
    """`backend="auto"`: the strongest backend that works here and meets `minimum`, with why each was or was not
    taken. Order: Firecracker, QEMU with KVM, QEMU with TCG where the policy asks for a VM (emulation is slow, so a
    namespace box is preferred when it is enough), then bubblewrap."""
    from tkbox_nb.backends.bwrap import BwrapBackend
    from tkbox_nb.backends.firecracker import FirecrackerBackend
    from tkbox_nb.backends.microvm import kvm_usable
    from tkbox_nb.backends.qemu import QemuBackend
    need = ISOLATION_LEVELS[minimum]
    why: list[str] = []
    kvm, kvm_why = kvm_usable()
    order: list[tuple[str, Backend | None, str]] = [("firecracker", FirecrackerBackend(jailer=jailer), "")]
    if kvm:
        order.append(("qemu (KVM)", QemuBackend(accel="kvm"), ""))
    else:
        order.append(("qemu (KVM)", None, kvm_why))
    if need >= ISOLATION_LEVELS["vm"]:
        order.append(("qemu (TCG)", QemuBackend(accel="tcg"), ""))
    else:
        why_tcg = "emulated VM, slow; taken only when the policy asks for isolation = \"vm\""
        order.append(("qemu (TCG)", None, why_tcg))
    bwrap_why = "" if need <= ISOLATION_LEVELS["namespace"] else "namespace isolation is below the policy's minimum"
    order.append(("bwrap", BwrapBackend() if not bwrap_why else None, bwrap_why))
    for label, backend, reason in order:
        if backend is None:
            why.append(f"{label}: {reason}")
            continue
        ok, reason = backend.available()
        why.append(f"{label}: {reason}")
        if ok:
            return backend, why
    return None, why


def get_backend(name: str, minimum: str = "namespace", jailer: bool = False) -> Backend:
    """The backend `name` ("auto" chooses), refused when its isolation is below `minimum` (never a fallback).
    `jailer` runs Firecracker under its jailer; it is refused for any other backend rather than ignored."""
    if jailer and name not in ("auto", "firecracker"):
        raise TkboxError(f"the jailer is Firecracker's: backend {name!r} cannot use it")
    if name == "auto":
        backend, why = choose_backend(minimum, jailer)
        if jailer and backend is not None and backend.name != "firecracker":
            raise TkboxError(f"the jailer was asked for but Firecracker cannot run here ({why[0]})")
        if backend is None:
            todo = "build the guest image (`tkbox image build`, docs/backends.md) or set [box] isolation = " \
                "\"namespace\" in the policy; " if minimum == "vm" else ""
            raise TkboxError(f"no box with isolation >= {minimum!r} can start here ({'; '.join(why)}): {todo}bundles "
                             "can still be read, verified, replayed and audited")
        return backend
    known = candidates()
    if name not in known:
        raise TkboxError(f"backend {name!r} is not available in this version (built: {', '.join(known)})")
    backend = known[name](jailer=True) if jailer else known[name]()
    if ISOLATION_LEVELS.get(backend.isolation, 0) < ISOLATION_LEVELS[minimum]:
        raise TkboxError(f"backend {name!r} gives {backend.isolation} isolation, below the policy's "
                         f"box.isolation = {minimum!r}: refusing to start")
    return backend
