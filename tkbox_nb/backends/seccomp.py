"""The system calls a bubblewrap box may not make, as the classic BPF program `bwrap --seccomp` loads.

A namespace box shares the host's kernel, so every system call it can make is kernel code it can reach. This filter
refuses (EPERM) the calls a program in a box has no use for and that kernel escapes have gone through: loading
kernel code or BPF, keyrings, io_uring, perf events, userfaultfd, mounting and namespaces, handles to host files,
the clock and the machine. clone(2) asking for a new namespace (any CLONE_NEW* flag) is refused with EPERM like
unshare(2), so no user namespace can be made where bubblewrap cannot disable them (before 0.8), and clone3(2), whose
flags sit in memory a filter cannot read, answers ENOSYS: libc then falls back to clone(2). It allows the rest,
ptrace within the box included (debuggers). A call of another architecture's ABI (32-bit `int 0x80`, x32) is refused
too, or it would pass under other numbers. Pure: the bytes depend only on the tables here, so they are tested as
bytes and in a real box.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
CLONE, CLONE3 = 56, 435
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET (CLONE_NEWTIME,
# 0x80, is clone3's and unshare's only: in clone(2)'s flags those bits are the exit signal)
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
ARG0_LOW = 16  # offsetof(struct seccomp_data, args[0]), little-endian: its low 32 bits, where the flags are

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl)
REFUSED_X86_64 = {
    "uselib": 134, "ustat": 136, "sysfs": 139, "vhangup": 153, "pivot_root": 155, "_sysctl": 156, "adjtimex": 159,
    "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "create_module": 174, "init_module": 175,
    "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179, "nfsservctl": 180,
    "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "quotactl_fd": 443,
}


def supported() -> bool:
    """Whether this module has the system call numbers of the host's architecture (only x86_64 here)."""
    return platform.machine() in ("x86_64", "AMD64")


def program(refused: dict[str, int] = REFUSED_X86_64) -> bytes:
    """The filter as `struct sock_filter` records (little-endian): the architecture checked first, the x32 ABI and
    each refused number answered EPERM, clone(2) with a CLONE_NEW* flag EPERM, clone3(2) ENOSYS, everything else
    allowed."""
    numbers = sorted(set(refused.values()))
    # the tail, at fixed places from its start: allow, clone's flags, allow, ENOSYS, EPERM
    n_head = 5 + len(numbers) + 2
    clone_at, enosys, eperm = n_head + 1, n_head + 4, n_head + 5  # n_head: allow
    insns = [(LD_W_ABS, 0, 0, 4),                       # 0: seccomp_data.arch
             (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),          # 1: x86_64: on to 3
             (RET_K, 0, 0, RET_KILL_PROCESS),           # 2: any other ABI
             (LD_W_ABS, 0, 0, 0),                       # 3: seccomp_data.nr
             (JGE_K, eperm - 5, 0, X32_SYSCALL_BIT)]    # 4: x32
    for i, nr in enumerate(numbers, start=5):
        insns.append((JEQ_K, eperm - (i + 1), 0, nr))
    insns.append((JEQ_K, clone_at - (len(insns) + 1), 0, CLONE))
    insns.append((JEQ_K, enosys - (len(insns) + 1), 0, CLONE3))
    insns += [(RET_K, 0, 0, RET_ALLOW),                 # allow
              (LD_W_ABS, 0, 0, ARG0_LOW),               # clone: its flags
              (JSET_K, eperm - (clone_at + 2), 0, CLONE_NEW_FLAGS),
              (RET_K, 0, 0, RET_ALLOW),
              (RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
              (RET_K, 0, 0, RET_ERRNO | errno.EPERM)]
    assert len(insns) == eperm + 1 and all(0 <= jt <= 255 for _, jt, _, _ in insns)
    return b"".join(struct.pack("<HBBI", *insn) for insn in insns)
