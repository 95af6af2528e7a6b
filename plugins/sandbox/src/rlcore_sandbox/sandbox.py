"""The code-execution tool ``python``: the model's code in a fenced, limited process (only where
``plugins:`` lists ``sandbox`` and ``environment.tools`` lists ``python``; limits under ``sandbox:``).

Each call runs a fresh ``python -I`` under `bubblewrap <https://github.com/containers/bubblewrap>`_
(``bwrap``, Debian's ``bubblewrap`` package), the sandbox Flatpak builds on. The fence holds by
construction, not by a list of what the code may not touch:

* **namespaces**: new user, PID, IPC, network, mount, UTS and cgroup namespaces. Inside, the code
  is ``nobody`` (uid 65534) with no capabilities and ``no_new_privs``; it sees only its own
  processes (none of the trainer's can be signalled, reniced or traced), has no network
  interface but a down ``lo``, and its System V IPC objects die with the namespace.
* **filesystem view**: only ``/usr`` (with the ``/bin``, ``/lib`` links), the interpreter's
  prefix and its venv, all read-only; ``/proc`` of its own PID namespace, a minimal ``/dev``;
  the working directory ``/tmp`` and ``/dev/shm`` are size-limited tmpfs (``scratch_mb`` each)
  that vanish with the mount namespace. Nothing else of the machine exists in there: reads are
  fenced like writes.
* **seccomp** (compiled by libseccomp through ``pyseccomp``, loaded by bwrap before the exec):
  every socket (``socket``, ``socketpair``: no family at all, filesystem sockets included),
  metadata changes (``chmod``, ``chown``, ``utime*``, extended attributes, ``mknod``: a device
  node bound into ``/dev`` belongs to the host), ``ptrace`` and cross-process memory, System V
  IPC, io_uring, keyrings, BPF, perf events, ``userfaultfd``, mounts and namespaces are refused
  (``EPERM``); ``fork``, ``vfork`` and a ``clone`` that is not a thread get ``EAGAIN`` and
  ``clone3`` ``ENOSYS`` (libc then falls back to ``clone``): one process, threads allowed.
* **resources** (``setrlimit`` in the prelude, before the code is read): CPU seconds, address
  space, the size of any file written (the output included), open files, no core dumps.
* **wall clock and reaping**: the parent kills bwrap's process group at ``wall_seconds``
  (``--die-with-parent`` takes the namespace's init along, and with it every process inside),
  then waits on a pidfd until the namespace's init is gone: nothing of a call outlives it.
* **output**: stdout and stderr go to an anonymous file the parent opened before the code ran
  (``O_TMPFILE``: no path the code could replace with a link or a FIFO); the parent reads its own
  descriptor. The prelude reports the layers it verified from inside (namespace ids against the
  parent's, ``Seccomp: 2``, ``CapEff: 0``, ``NoNewPrivs: 1``, the root directory's listing) on a
  pipe it closes before the code runs, so the code cannot forge or erase the report.

bwrap and libseccomp are required, never optional: without them (or where the kernel refuses
user namespaces) :func:`require_sandbox` raises a :class:`~rlcore.errors.ConfigError` naming
``environment.tools`` and the install line, and the tool is not built.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rlcore.environments.tools import Tool
from rlcore.errors import ConfigError

#: the layers every call must report from inside, in this order
LAYERS = ("userns", "pidns", "ipcns", "netns", "mntns", "utsns", "fsview", "seccomp", "nocaps", "nnp", "rlimits")
_NAMESPACES = ("user", "pid", "ipc", "net", "mnt", "uts")
INSTALL = "apt-get install bubblewrap (Debian/Ubuntu; dnf install bubblewrap on Fedora)"
#: the config key a sandbox that cannot hold here is reported under: the list that asked for the tool
KEY = "environment.tools"
SANDBOX_UID = 65534  # nobody

#: refused with EPERM: what the code never needs and what could reach outside its namespaces
REFUSED = (
    "socket", "socketpair",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "utimensat", "futimesat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat", "mknod", "mknodat",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "semget", "semop", "semtimedop",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsmount", "fsconfig",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "setpriority", "ioprio_set", "sched_setaffinity", "sched_setscheduler",
    "sched_setattr", "sched_setparam", "migrate_pages", "move_pages",
)
CLONE_THREAD = 0x00010000

#: the prelude run inside the sandbox: limits, the layer report, then the model's code from stdin
CHILD = r'''
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, value in (("RLIMIT_CPU", limits["cpu"]), ("RLIMIT_AS", limits["memory"]), ("RLIMIT_FSIZE", limits["fsize"]),
                    ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
layers = [kind + "ns" for kind, host in limits["host_ns"].items() if os.readlink("/proc/self/ns/" + kind) != host]
if sorted(os.listdir("/")) == sorted(limits["visible"]):
    layers.append("fsview")
if status.get("Seccomp", "").strip() == "2":
    layers.append("seccomp")
if int(status.get("CapEff", "1").strip(), 16) == 0:
    layers.append("nocaps")
if status.get("NoNewPrivs", "").strip() == "1":
    layers.append("nnp")
layers.append("rlimits")
os.write(limits["report_fd"], json.dumps(layers).encode())
os.close(limits["report_fd"])
code = sys.stdin.read()
del json, limits, resource, status, layers
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class RunResult:
    """One run of the model's code: ``output`` (stdout and stderr, at most ``output_bytes``),
    ``exit`` (the return code; negative: killed by that signal), ``timed_out`` (killed at the
    wall-clock limit), ``isolation`` (the layers verified from inside, comma-separated; see
    :data:`LAYERS`)."""

    output: str
    exit: int
    timed_out: bool
    isolation: str
    seconds: float


def bwrap_path() -> str | None:
    """bubblewrap's executable: on ``PATH``, else Debian's ``/usr/bin/bwrap``."""
    found = shutil.which("bwrap")
    if found:
        return found
    return "/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The seccomp filter as a BPF program (libseccomp compiles it; bwrap loads it): see :data:`REFUSED`."""
    import pyseccomp as seccomp  # imported here: it loads the system's libseccomp.so.2 at import

    program = seccomp.SyscallFilter(seccomp.ALLOW)
    arch = seccomp.system_arch()

    def refuse(action: int, name: str, *args: Any) -> None:
        try:
            number = seccomp.resolve_syscall(arch, name)
        except Exception:  # noqa: BLE001 - a call this kernel's ABI (or libseccomp) does not know is no way out
            return
        if number >= 0:
            program.add_rule(action, name, *args)

    for name in REFUSED:
        refuse(seccomp.ERRNO(errno.EPERM), name)
    for name in ("fork", "vfork"):
        refuse(seccomp.ERRNO(errno.EAGAIN), name)
    refuse(seccomp.ERRNO(errno.ENOSYS), "clone3")
    refuse(seccomp.ERRNO(errno.EAGAIN), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    with tempfile.TemporaryFile() as f:
        program.export_bpf(f)
        f.seek(0)
        return f.read()


def _host_namespaces() -> dict[str, str]:
    return {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in _NAMESPACES}


@lru_cache(maxsize=1)
def _filesystem_view() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """bwrap's arguments for the read-only view, and the names ``/`` holds inside."""
    args: list[str] = []
    visible = {"usr", "proc", "dev", "tmp"}
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
        else:
            continue
        visible.add(top[1:])
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
            visible.add(prefix.strip("/").split("/")[0])
    return tuple(args), tuple(sorted(visible))


def _command(limits: dict[str, Any], view: tuple[str, ...], seccomp_fd: int, status_fd: int,
             scratch_bytes: int) -> list[str]:
    return [bwrap_path() or "bwrap",
            "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--cap-drop", "ALL", "--as-pid-1", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp",
            *view, "--proc", "/proc", "--dev", "/dev",
            "--size", str(scratch_bytes), "--tmpfs", "/tmp",
            "--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", "/dev/shm",
            "--chdir", "/tmp", "--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd),
            "--", sys.executable, "-I", "-c", CHILD, json.dumps(limits)]


def run_code(code: str, *, cpu_seconds: int = 2, memory_mb: int = 256, wall_seconds: float = 5.0,
             output_bytes: int = 4096, scratch_mb: int = 16) -> RunResult:
    """Run ``code`` in the sandbox (see the module docstring); never raises for what the code does.

    Raises :class:`~rlcore.errors.ConfigError` when the sandbox itself is missing (no bwrap)."""
    _require_bwrap()
    report_r, report_w = os.pipe()
    status_r, status_w = os.pipe()
    view, visible = _filesystem_view()
    limits = {"cpu": int(cpu_seconds), "memory": int(memory_mb) << 20, "fsize": int(output_bytes) + 1,
              "report_fd": report_w, "host_ns": _host_namespaces(), "visible": list(visible)}
    t0 = time.perf_counter()
    timed_out = False
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as program:
        program.write(seccomp_program())
        program.flush()
        program.seek(0)
        try:
            child = subprocess.Popen(_command(limits, view, program.fileno(), status_w, int(scratch_mb) << 20),
                                     stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True,
                                     pass_fds=(report_w, status_w, program.fileno()), env={"PATH": "/usr/bin:/bin"})
        finally:
            os.close(report_w)
            os.close(status_w)
        try:
            try:
                child.stdin.write(code.encode("utf-8", "replace"))  # type: ignore[union-attr]
                child.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:  # the child died before reading its code (a limit at start)
                pass
            try:
                child.wait(timeout=wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            _kill_group(child.pid)  # bwrap and the namespace's init: --die-with-parent takes the rest
            child.wait()
            status = _read_available(status_r)
            os.close(status_r)
            init_pid = _init_pid(status)
            if init_pid is not None:
                _reap_namespace(init_pid)
            report = _read_available(report_r)
            os.close(report_r)
        raw = os.pread(out.fileno(), int(output_bytes), 0)
    rc = child.returncode
    if rc > 128 and rc - 128 < signal.NSIG:  # bwrap exits 128 + n for a child killed by signal n
        rc = -(rc - 128)
    if timed_out:
        rc = -signal.SIGKILL
    try:
        isolation = ",".join(json.loads(report.decode() or "[]"))
    except ValueError:
        isolation = ""
    return RunResult(raw.decode("utf-8", "replace"), rc, timed_out, isolation, time.perf_counter() - t0)


def _read_available(fd: int) -> bytes:
    """What a pipe holds now, without waiting for writers that may still hold it open."""
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _init_pid(status: bytes) -> int | None:
    for line in status.decode(errors="replace").splitlines():
        try:
            pid = json.loads(line).get("child-pid")
        except ValueError:
            continue
        if pid:
            return int(pid)
    return None


def _reap_namespace(init_pid: int, timeout: float = 5.0) -> None:
    """Wait until the PID namespace's init (and so every process in the namespace) is gone."""
    try:
        pidfd = os.pidfd_open(init_pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([pidfd], [], [], timeout / 2)[0]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if not select.select([pidfd], [], [], timeout / 2)[0]:
                raise RuntimeError(f"the sandbox's PID namespace (init pid {init_pid}) outlived its kill")
    finally:
        os.close(pidfd)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@lru_cache(maxsize=1)
def isolation() -> str:
    """The layers a call gets on this machine, verified from inside by running one (see
    :data:`LAYERS`); ``""`` where bwrap is missing or cannot start."""
    try:
        return run_code("pass").isolation
    except ConfigError:
        return ""


def require_sandbox() -> str:
    """Every layer of :data:`LAYERS`, or a :class:`~rlcore.errors.ConfigError` naming what is missing."""
    _require_bwrap()
    return _probe()


def _require_bwrap() -> None:
    if bwrap_path() is None:
        raise ConfigError(f"environment.tools: the python tool runs code only inside bubblewrap, which is not "
                          f"installed here: {INSTALL}", key=KEY)


@lru_cache(maxsize=1)
def _probe() -> str:
    try:
        seccomp_program()
    except (ImportError, OSError) as err:
        raise ConfigError(f"environment.tools: the python tool's seccomp filter needs libseccomp "
                          f"(pip install pyseccomp; apt-get install libseccomp2): {err}", key=KEY) from err
    probe = run_code("print('ok')")
    held = set(probe.isolation.split(",")) if probe.isolation else set()
    missing = [layer for layer in LAYERS if layer not in held]
    if missing or probe.output.strip() != "ok":
        raise ConfigError(f"environment.tools: the python tool's sandbox does not hold on this machine "
                          f"(missing: {', '.join(missing) or 'none'}; bwrap said: {probe.output.strip()[:200]!r}); "
                          f"bubblewrap needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                          f"or an AppArmor profile for bwrap)", key=KEY)
    return probe.isolation


def describe(result: RunResult, limits: Any) -> str:
    """The observation the model sees for ``result``."""
    if result.timed_out:
        return f"{result.output}\n[killed: wall-clock limit of {limits.wall_seconds:g}s]".strip()
    if result.exit == -signal.SIGXCPU or result.exit == -signal.SIGKILL:
        return f"{result.output}\n[killed: CPU-time limit of {limits.cpu_seconds}s]".strip()
    if result.exit != 0:
        return f"{result.output}\n[exit status {result.exit}]".strip()
    return result.output


def python_tool(limits: Any) -> Tool:
    """The ``python`` tool with the ``sandbox:`` section's ``limits``: runs its argument as a Python
    program and answers with what it printed. Refuses to build where the sandbox does not hold."""
    require_sandbox()

    def run(code: str) -> str:
        return describe(run_code(code, cpu_seconds=limits.cpu_seconds, memory_mb=limits.memory_mb,
                                 wall_seconds=limits.wall_seconds, output_bytes=limits.output_bytes,
                                 scratch_mb=getattr(limits, "scratch_mb", 16)), limits)

    return Tool("python", run, "runs a Python program in a sandbox; answers with its output")
