"""The bubblewrap box's seccomp filter as bytes (tkbox_nb/backends/seccomp.py), run through a classic-BPF
interpreter written here from the kernel's definition: what each system call of each ABI gets back."""

from __future__ import annotations

import struct

import pytest

from tkbox_nb.backends import seccomp


def run_filter(program: bytes, nr: int, arch: int = seccomp.AUDIT_ARCH_X86_64, arg0: int = 0) -> int:
    data = struct.pack("<iIQQ", nr & 0xFFFFFFFF if nr < 0 else nr, arch, 0, arg0) + bytes(40)
    insns = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == seccomp.LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == seccomp.JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == seccomp.JGE_K:
            pc += 1 + (jt if acc >= k else jf)
        elif code == seccomp.JSET_K:
            pc += 1 + (jt if acc & k else jf)
        elif code == seccomp.RET_K:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x} at {pc}")


EPERM = seccomp.RET_ERRNO | 1
ENOSYS = seccomp.RET_ERRNO | 38


@pytest.mark.parametrize("name", sorted(seccomp.REFUSED_X86_64))
def test_each_refused_call_gets_eperm(name):
    assert run_filter(seccomp.program(), seccomp.REFUSED_X86_64[name]) == EPERM


@pytest.mark.parametrize("nr", [0, 1, 2, 39, 56, 57, 59, 101, 231, 257, 451])  # read ... clone, ..., ptrace
def test_the_calls_programs_make_are_allowed(nr):
    assert run_filter(seccomp.program(), nr) == seccomp.RET_ALLOW


def test_another_abi_cannot_reach_a_refused_call_under_other_numbers():
    """x32 numbers (bit 30 set) are refused; a 32-bit (int 0x80) call, whose numbers differ, ends the process."""
    assert run_filter(seccomp.program(), seccomp.X32_SYSCALL_BIT | 250) == EPERM
    assert run_filter(seccomp.program(), seccomp.X32_SYSCALL_BIT | 39) == EPERM
    assert run_filter(seccomp.program(), 250, arch=0x40000003) == seccomp.RET_KILL_PROCESS  # AUDIT_ARCH_I386
    assert run_filter(seccomp.program(), 39, arch=0x40000003) == seccomp.RET_KILL_PROCESS


@pytest.mark.parametrize("flag", [0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000])
def test_clone_making_a_namespace_gets_eperm_and_clone3_enosys(flag):
    """clone(2) with any CLONE_NEW* flag is refused as unshare(2) is (a user namespace where bubblewrap before 0.8
    cannot disable them); clone3(2), whose flags the filter cannot read, answers ENOSYS so libc falls back to
    clone(2); forks and threads still pass."""
    assert run_filter(seccomp.program(), 56, arg0=flag | 17) == EPERM
    assert run_filter(seccomp.program(), 56, arg0=flag | 0x3D0F00) == EPERM
    assert run_filter(seccomp.program(), 435, arg0=0) == ENOSYS
    assert run_filter(seccomp.program(), 56, arg0=17) == seccomp.RET_ALLOW  # fork: SIGCHLD
    assert run_filter(seccomp.program(), 56, arg0=0x3D0F00) == seccomp.RET_ALLOW  # pthread_create's flags
