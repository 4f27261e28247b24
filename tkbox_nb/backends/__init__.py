"""Box backends: one module per backend behind the interface in base.py, chosen by name or `auto` in registry.py.

The order inside this package, from the bottom: base (the interface), image and linux_kernel (the guest image),
microvm (what the VM backends share, with `kvm_usable`), warm_start (QEMU's saved states), the backends (bwrap,
qemu, firecracker; none imports another), then registry (which knows them all).
"""

from tkbox_nb.backends.base import Backend, BoxSpec  # noqa: F401
from tkbox_nb.backends.registry import BACKENDS, choose_backend, get_backend  # noqa: F401
