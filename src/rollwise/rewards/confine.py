"""Kernel confinement for the sandbox's candidate process: Landlock, seccomp, capabilities,
private mounts and descendant cleanup, through the system calls themselves (ctypes).

Standard library only and no rollwise imports: the sandbox runner (``python -I -S``, no
site-packages) loads this module's compiled code from its stdin. Why not the PyPI bindings
(``pyseccomp``, ``landlock``): the runner cannot import site-packages, and ``pyseccomp``
also needs the system's libseccomp. Everything here is Linux-only; on other
architectures than x86_64 and aarch64 the seccomp filter is reported as unavailable.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

# Architecture: the audit arch seccomp sees, and the numbers of the calls the filter names.
_MACHINE = os.uname().machine
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(_MACHINE)
_CALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "setsid": 112,
        "setpgid": 109, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "bpf": 321, "perf_event_open": 298, "unshare": 272,
        "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323,
        "reboot": 169, "swapon": 167, "swapoff": 168, "sethostname": 170,
        "setdomainname": 171, "acct": 163, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "personality": 135, "quotactl": 179, "vhangup": 153,
        "iopl": 172, "ioperm": 173, "socket": 41, "clone": 56, "ioctl": 16, "capset": 126},
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "setsid": 157,
        "setpgid": 154, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "bpf": 280, "perf_event_open": 241, "unshare": 97,
        "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "userfaultfd": 282,
        "reboot": 142, "swapon": 224, "swapoff": 225, "sethostname": 161,
        "setdomainname": 162, "acct": 89, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "personality": 92, "quotactl": 60, "vhangup": 58,
        "socket": 198, "clone": 220, "ioctl": 29, "capset": 91},
}.get(_MACHINE, {})
# numbered alike on every architecture (added after the tables were unified)
_COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
           "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
           "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438,
           "mount_setattr": 442, "landlock_create_ruleset": 444, "landlock_add_rule": 445,
           "landlock_restrict_self": 446}
# what the candidate may never do: leave its process group (so the group kill reaches every
# descendant), look into or write other processes, touch mounts, namespaces, the kernel
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "setsid",
           "setpgid", "mount", "umount2", "pivot_root", "chroot", "kexec_load",
           "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf",
           "perf_event_open", "unshare", "setns", "keyctl", "add_key", "request_key",
           "userfaultfd", "reboot", "swapon", "swapoff", "sethostname", "setdomainname",
           "acct", "open_by_handle_at", "name_to_handle_at", "personality", "quotactl",
           "vhangup", "iopl", "ioperm", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
           "fspick", "mount_setattr")
_CLONE_NEW_NAMESPACES = 0x7E020080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
_TIOCSTI = 0x5412  # push characters into a terminal's input

PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_SECCOMP = 4, 8, 22
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _call(name: str, *args) -> int:
    number = _CALLS.get(name, _COMMON.get(name))
    if number is None:
        raise OSError(errno.ENOSYS, f"{name}: unknown on {_MACHINE}")
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return result


def prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


# ---------------------------------------------------------------------------------------------
# Landlock: what the candidate may read, write and signal (kernel >= 5.13; rights grow per ABI)

_LL_FS_V1 = (1 << 13) - 1  # execute, write/read file, read dir, remove, make dir/reg/...
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
_LL_FILE_ONLY = (1 << 0) | (1 << 1) | (1 << 2) | _LL_TRUNCATE | _LL_IOCTL_DEV


def landlock_abi() -> int:
    """The Landlock ABI version the kernel offers (0: none)."""
    try:
        return _call("landlock_create_ruleset", None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    except OSError:
        return 0


def landlock_ruleset(read: list[str], write: list[str]) -> tuple[int, int]:
    """A Landlock ruleset that allows reading (and executing) beneath `read`, everything
    beneath `write`, TCP neither way (ABI >= 4), and no signals or abstract sockets past its
    own domain (ABI >= 6): (ruleset fd, ABI). Build it while the paths can still be opened;
    `landlock_enforce` applies it. Paths that do not exist are skipped."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, "Landlock is not available")
    fs = _LL_FS_V1 | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) \
        | (_LL_IOCTL_DEV if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0  # bind and connect TCP, with no rule allowing either
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals
    attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _call("landlock_create_ruleset", buf, ctypes.c_size_t(len(attr)), 0)
    for paths, access in ((read, _LL_READ), (write, fs)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rights = access & fs
                if not os.path.isdir(path):
                    rights &= _LL_FILE_ONLY
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                _call("landlock_add_rule", ruleset, 1, rule, 0)  # LANDLOCK_RULE_PATH_BENEATH
            finally:
                os.close(fd)
    return ruleset, abi


def landlock_enforce(ruleset: int) -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    _call("landlock_restrict_self", ruleset, 0)
    os.close(ruleset)


# ---------------------------------------------------------------------------------------------
# seccomp: a classic BPF filter over the call number and, for three calls, an argument

def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


_LD, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def seccomp_filter() -> bytes:
    """The filter program: refuses (EPERM) the calls in `_DENIED`, clone into new
    namespaces, TIOCSTI and every call of a foreign ABI, and new sockets (EACCES); clone3
    says ENOSYS so the C library falls back to clone, whose flags the filter can see."""
    if _AUDIT_ARCH is None or not _CALLS:
        raise OSError(errno.ENOSYS, f"no seccomp call table for {_MACHINE}")
    refuse = _ERRNO | errno.EPERM
    prog = [_insn(_LD, 4), _insn(_JEQ, _AUDIT_ARCH, 1, 0), _insn(_RET, refuse),
            _insn(_LD, 0)]
    if _MACHINE == "x86_64":  # the x32 ABI sets bit 30 of the call number
        prog += [_insn(_JGE, 0x40000000, 0, 1), _insn(_RET, refuse)]
    for name in _DENIED:
        number = _CALLS.get(name, _COMMON.get(name))
        prog += [_insn(_JEQ, number, 0, 1), _insn(_RET, refuse)]
    prog += [_insn(_JEQ, _COMMON["clone3"], 0, 1), _insn(_RET, _ERRNO | errno.ENOSYS)]
    # every new socket (socketpair, which asyncio's self-pipe uses, stays): no network, and
    # no named unix socket of the host (which Landlock does not cover) either
    prog += [_insn(_JEQ, _CALLS["socket"], 0, 1), _insn(_RET, _ERRNO | errno.EACCES)]
    # (call, offset of the argument's low 32 bits, test): refuse when the test holds
    for name, offset, test in (("ioctl", 24, _insn(_JEQ, _TIOCSTI, 0, 1)),
                               ("clone", 16, _insn(_JSET, _CLONE_NEW_NAMESPACES, 0, 1))):
        prog += [_insn(_JEQ, _CALLS[name], 0, 4), _insn(_LD, offset), test,
                 _insn(_RET, refuse), _insn(_RET, _ALLOW)]
    prog.append(_insn(_RET, _ALLOW))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_enforce(program: bytes) -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0) != 0:  # SECCOMP_MODE_FILTER
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")


# ---------------------------------------------------------------------------------------------
# Capabilities

def drop_capabilities() -> None:
    """Clear every capability of this process (a user namespace's root keeps its uid 0 but
    loses the powers over the namespace: ptrace, reading other processes' /proc, mounts)."""
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)  # v3, self
    data = ctypes.create_string_buffer(bytes(24), 24)  # {effective, permitted, inheritable} x2
    _call("capset", header, data)


# ---------------------------------------------------------------------------------------------
# Mounts (inside a mount namespace: the unshare level)

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 1, 2, 4, 4096, 16384
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE, _OPEN_TREE_CLONE = 1, 0x8000, 1
_MOVE_MOUNT_F_EMPTY_PATH, _AT_EMPTY_PATH, _AT_FDCWD = 4, 0x1000, -100


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    if _libc.mount(*args, ctypes.c_ulong(flags), None if data is None else data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _set_readonly(fd_or_path, recursive: bool = True) -> None:
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_RDONLY, 0, 0, 0), 32)
    if isinstance(fd_or_path, int):
        _call("mount_setattr", fd_or_path, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, attr, 32)
    else:
        _call("mount_setattr", _AT_FDCWD, fd_or_path.encode(),
              _AT_RECURSIVE if recursive else 0, attr, 32)


def private_view(hide: list[str], keep: list[str], writable: str) -> None:
    """In a fresh mount namespace: the whole file system read-only, each directory of `hide`
    (/tmp, the home directory, ...) replaced by an empty tmpfs, and the paths of `keep` (the
    interpreter) read-only and `writable` (the execution's directory) writable at their own
    places again even when they lie beneath a hidden directory."""
    clones = {}
    for path in [*keep, writable]:
        if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hide):
            clones[path] = _call("open_tree", _AT_FDCWD, path.encode(),
                                 _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC)
    writable_fd = clones.pop(writable, None)
    if writable_fd is None:  # not beneath a hidden directory: bind it onto itself, writable
        writable_fd = _call("open_tree", _AT_FDCWD, writable.encode(),
                            _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC)
    _set_readonly("/")
    for path in hide:
        mode = "1777" if path in ("/tmp", "/var/tmp", "/dev/shm") else "755"
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size=64m")
    for path, fd in [*clones.items(), (writable, writable_fd)]:
        os.makedirs(path, mode=0o755, exist_ok=True)
        if path != writable:
            _set_readonly(fd)
        _call("move_mount", fd, b"", _AT_FDCWD, path.encode(), _MOVE_MOUNT_F_EMPTY_PATH)
        os.close(fd)
    os.chdir(writable)  # the old working directory is on the now read-only mount


# ---------------------------------------------------------------------------------------------
# Descendants

def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (the children lists where the kernel keeps
    them, else every process's parent)."""
    parents: dict[int, list[int]] = {}
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = parents.get(parent, []) if parents else _children(parent)
        found += kids
        todo += kids
    return found


def _children(pid: int) -> list[int]:
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return kids


def kill_descendants(pid: int, seconds: float = 2.0) -> None:
    """SIGKILL every descendant of `pid` (this process, a child subreaper: the orphans of a
    double fork are still its descendants) and reap them all, so that no zombie is left to
    an init that may never reap it (a container's) and count against the process limit."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for kid in descendants(pid):
            try:
                os.kill(kid, 9)  # SIGKILL (the signal module costs the runner's start-up)
            except OSError:
                pass
        try:  # killed children die at once; their orphans become our children, reaped next
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
