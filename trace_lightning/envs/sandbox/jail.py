"""The bubblewrap jail around model-written code: its command line and its seccomp filter.

The jail (https://github.com/containers/bubblewrap, Debian `bubblewrap`) gives the program:
- a user namespace in which it is uid/gid 65534 with no capabilities. When the trainer is root, bwrap
  itself is started as host uid 65534, so the jail's user is not root outside either: RLIMIT_NPROC
  binds (Linux exempts root from it) and host files are reached, if ever, as `nobody`;
- a fresh mount namespace: an empty read-only root holding `/usr` (read-only; `/usr/local`, `/usr/etc` and
  the Python package folders hidden), the `/bin`, `/lib*` links, a new `/proc` whose host-wide files are
  emptied (`proc_masks`), a minimal read-only `/dev`, the launcher at `/jail/launcher.py` and the only
  writable place, a tmpfs at `/scratch` capped in size and, where the trainer may, in files
  (`cap_scratch_inodes`). No `/etc`, `/home`, `/root`, `/tmp` or checkout;
- new pid, net (a loopback of its own), ipc, uts and cgroup namespaces, `--new-session` (no terminal
  injection), `--die-with-parent`, and no nested user namespaces (`--disable-userns`). The launcher is
  the pid namespace's init (`--as-pid-1`): signals from inside cannot kill or stop it, and when it exits
  the kernel kills every process left in the jail before bwrap itself returns;
- a seccomp filter (built with libseccomp, which apt itself depends on) that answers EPERM to the calls
  that lead back out or into the kernel's soft spots: setns, unshare, mount, ptrace, keyctl, bpf, ... and
  SysV IPC (its segments outlive the processes that made them; the jail's IPC namespace ends them with
  the call, and its `shmmax` is unlimited).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

from trace_lightning.envs.sandbox.mounts import SCRATCH, proc_masks, usr_masks

JAIL_UID = 65534  # `nobody`, inside the jail and, when the trainer is root, outside it too
LAUNCHER = "/jail/launcher.py"
INSTALL_HINT = (
    "install bubblewrap (`apt-get install -y bubblewrap`, or `make system-deps`) or point "
    "env.sandbox.bwrap at its binary; if bwrap is installed but cannot create namespaces, allow "
    "unprivileged user namespaces (`sysctl -w user.max_user_namespaces=10000`; on Debian "
    "`sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu 24.04 "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`), and in Docker run the container with "
    "`--security-opt seccomp=unconfined --security-opt apparmor=unconfined`. Only for trusted code: "
    "env.sandbox.jail=unsafe_no_jail_trusted_code_only runs it with no jail at all"
)

# Denied with EPERM. Unknown names (another architecture, an older libseccomp) are skipped.
# fmt: off
_DENIED_SYSCALLS = (
    "setns", "unshare", "pivot_root", "chroot",  # the way back into (or out to) other namespaces
    "mount", "umount2", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes' memory
    "keyctl", "add_key", "request_key",  # the kernel keyring is not namespaced
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff", "syslog", "acct", "quotactl",
    "iopl", "ioperm", "lookup_dcookie", "fanotify_init",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",  # SysV IPC
    "msgget", "msgsnd", "msgrcv", "msgctl", "ipc",
)
# fmt: on
# clone with any of these flags would make a namespace: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER,
# NEWPID, NEWNET, NEWTIME. clone3 passes its flags in memory a filter cannot read, so it gets ENOSYS and
# glibc falls back to clone.
_NAMESPACE_FLAGS = (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_SCMP_CMP_MASKED_EQ = 7
_EPERM, _ENOSYS = 1, 38


class JailUnavailableError(RuntimeError):
    """No jail can be set up here, so the python tool refuses to run model-written code."""


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@functools.cache
def seccomp_program() -> bytes:
    """The compiled BPF filter bwrap loads with `--seccomp FD` (the same bytes every call)."""
    libseccomp = _load_libseccomp()
    ctx = libseccomp.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise JailUnavailableError("seccomp_init failed: the jail's seccomp filter cannot be built")
    try:
        for name in _DENIED_SYSCALLS:
            _deny(libseccomp, ctx, name, _EPERM)
        _deny(libseccomp, ctx, "clone3", _ENOSYS)
        for flag in _NAMESPACE_FLAGS:
            _deny(libseccomp, ctx, "clone", _EPERM, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        fd = os.memfd_create("trace-seccomp")
        try:
            if libseccomp.seccomp_export_bpf(ctx, fd) != 0:
                raise JailUnavailableError("seccomp_export_bpf failed: the jail's filter cannot be built")
            return os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        libseccomp.seccomp_release(ctx)


def _load_libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise JailUnavailableError(
            "libseccomp is not installed, so the jail's seccomp filter cannot be built: "
            "`apt-get install -y libseccomp2`"
        )
    lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _deny(lib: ctypes.CDLL, ctx: int, name: str, errno: int, condition: _ArgCmp | None = None) -> None:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:  # not a system call on this architecture
        return
    conditions = (1, ctypes.byref(condition)) if condition is not None else (0, None)
    if lib.seccomp_rule_add_array(ctx, _SCMP_ACT_ERRNO | errno, number, *conditions) != 0:
        raise JailUnavailableError(f"seccomp rule for {name} could not be added")


def bwrap_command(bwrap: str, python: str, scratch_bytes: int, fds: dict[str, int]) -> list[str]:
    """bwrap's arguments up to the command; `fds` holds the descriptors of the launcher, the program, the
    seccomp filter, bwrap's info report, the block pipe it waits on before starting the launcher (so the
    trainer can move it into the call's cgroup first), and the empty files masking /proc's host-wide files
    (`mask:<path>`)."""
    return [
        bwrap,
        *("--unshare-all", "--unshare-user", "--disable-userns", "--hostname", "jail"),
        *("--uid", str(JAIL_UID), "--gid", str(JAIL_UID), "--cap-drop", "ALL"),
        # --as-pid-1: the launcher is the pid namespace's init, so the program cannot signal it, and bwrap
        # returns only once it is reaped, after the kernel has killed and reaped all the rest. (With
        # bwrap's own init, bwrap returned while the jail's leftovers were still alive.)
        *("--new-session", "--die-with-parent", "--as-pid-1"),
        *("--ro-bind", "/usr", "/usr", *usr_masks(python)),
        *_root_links(),
        *("--proc", "/proc", *_proc_mask_args(fds), "--dev", "/dev", "--remount-ro", "/dev"),
        *("--size", str(scratch_bytes), "--tmpfs", SCRATCH),
        *("--perms", "0644", "--file", str(fds["program"]), f"{SCRATCH}/main.py"),
        *("--ro-bind-data", str(fds["launcher"]), LAUNCHER),
        *("--remount-ro", "/", "--chdir", SCRATCH),
        *("--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH),
        *("--setenv", "TMPDIR", SCRATCH, "--setenv", "LANG", "C.UTF-8"),
        *("--seccomp", str(fds["seccomp"]), "--info-fd", str(fds["info"]), "--block-fd", str(fds["block"])),
    ]


def _proc_mask_args(fds: dict[str, int]) -> list[str]:
    dirs, files = proc_masks()
    args = [arg for path in dirs for arg in ("--tmpfs", path, "--remount-ro", path)]
    return args + [arg for path in files for arg in ("--ro-bind-data", str(fds[f"mask:{path}"]), path)]


def _root_links() -> list[str]:
    """/bin, /sbin and /lib* as on the host: links into /usr (merged /usr), or read-only binds."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def host_uid() -> int | None:
    """The host uid to start bwrap as: `nobody` when the trainer is root, else None (the trainer's own)."""
    return JAIL_UID if os.geteuid() == 0 else None
