"""The system-call filter of the python tool's sandbox: one process, no way to make another.

A classic BPF program in the form ``bwrap --seccomp FD`` loads (the kernel's ``struct
sock_filter`` array). It lets threads be made (``clone`` with ``CLONE_THREAD``) and refuses:

- every other ``clone``, ``fork`` and ``vfork`` (EPERM), and ``clone3`` (ENOSYS, so the C
  library falls back to ``clone`` for threads, where the flags can be read): the sandboxed
  program is the sandbox's only process, so its CPU-time, address-space and file-size limits
  are the whole sandbox's, and nothing it starts can outlive it;
- entering or making namespaces, mounting, tracing or reading other processes' memory, the
  kernel keyring, eBPF, perf events, userfaultfd and io_uring (EPERM): kernel surface a Python
  program has no use for.

- ``socket`` of any family but ``AF_UNIX`` ends the process (SIGSYS): the sandbox has no
  network to reach, and a program that asks for one without Python's ``socket`` module (which
  the sandbox's courtesy hook refuses with a message) gets no answer but its end.

System calls of another ABI than the machine's own (32-bit calls on x86_64, x32) end the
process too. Supported machines: x86_64 and aarch64 (:data:`ARCHES`).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
_LD_W_ABS = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_KILL_PROCESS = 0x80000000
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian machines)
CLONE_THREAD = 0x00010000
AF_UNIX = 1
_X32_BIT = 0x40000000


# Refused with EPERM (by name; each architecture's numbers below, from its unistd table).
DENIED = (
    "fork", "vfork", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "add_key", "request_key", "keyctl",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register",
)  # fmt: skip
_NEWER = {  # numbered alike on every architecture (the common table, 424 onwards)
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "clone3": 435, "mount_setattr": 442,
}  # fmt: skip


@dataclass(frozen=True)
class Arch:
    audit: int  # AUDIT_ARCH_*
    numbers: dict[str, int]  # system call name -> number
    x32: bool = False  # the x32 ABI can be entered with bit 30 of the number set


ARCHES: dict[str, Arch] = {
    "x86_64": Arch(
        audit=0xC000003E,
        numbers=_NEWER | {
            "socket": 41, "clone": 56, "fork": 57, "vfork": 58, "ptrace": 101, "pivot_root": 155,
            "chroot": 161, "mount": 165, "umount2": 166, "add_key": 248, "request_key": 249,
            "keyctl": 250, "unshare": 272, "perf_event_open": 298, "setns": 308,
            "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321, "userfaultfd": 323,
        },
        x32=True,
    ),
    "aarch64": Arch(  # the generic table: no fork or vfork (clone does both)
        audit=0xC00000B7,
        numbers=_NEWER | {
            "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51, "unshare": 97,
            "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220,
            "socket": 198, "perf_event_open": 241, "setns": 268, "process_vm_readv": 270,
            "process_vm_writev": 271, "bpf": 280, "userfaultfd": 282,
        },
    ),
}  # fmt: skip


def machine_arch() -> str:
    """This machine's architecture, as :data:`ARCHES` names them."""
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def single_process_filter(arch: str | None = None) -> bytes:
    """The filter's bytes for ``arch`` (default: this machine's); ValueError for another one."""
    name = arch or machine_arch()
    if name not in ARCHES:
        raise ValueError(
            f"no system-call filter for the {name} architecture (known: {', '.join(ARCHES)})"
        )
    a = ARCHES[name]
    deny = _RET, _ERRNO | errno.EPERM
    # Each rule is a jump-if-equal to a return that follows it: (nr, action) pairs.
    rules = [(a.numbers[call], deny) for call in DENIED if call in a.numbers]
    rules.append((a.numbers["clone3"], (_RET, _ERRNO | errno.ENOSYS)))
    prog = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ, a.audit, jt=1),  # the machine's own ABI: go on
        _insn(_RET, _KILL_PROCESS),
        _insn(_LD_W_ABS, _NR),
    ]
    if a.x32:
        prog += [_insn(_JGE, _X32_BIT, jf=1), _insn(_RET, _KILL_PROCESS)]
    for nr, (code, k) in rules:
        prog += [_insn(_JEQ, nr, jf=1), _insn(code, k)]
    # socket: AF_UNIX only; clone: threads only (both read their first argument)
    prog += [
        _insn(_JEQ, a.numbers["socket"], jf=4),  # not socket: on to clone
        _insn(_LD_W_ABS, _ARG0_LOW),
        _insn(_JEQ, AF_UNIX, jt=1),
        _insn(_RET, _KILL_PROCESS),
        _insn(_RET, _ALLOW),
        _insn(_JEQ, a.numbers["clone"], jf=3),  # not clone: allowed
        _insn(_LD_W_ABS, _ARG0_LOW),
        _insn(_JSET, CLONE_THREAD, jt=1),
        _insn(*deny),
        _insn(_RET, _ALLOW),
    ]
    return b"".join(prog)
