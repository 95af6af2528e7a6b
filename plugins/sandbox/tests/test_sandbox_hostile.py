"""Hostile code in the ``python`` tool's sandbox (issue 38 item 1): whatever the model's code tries
(signals, renice and affinity, sockets of every family, metadata changes, links and special files,
shared memory, ptrace, descriptor tricks, escape calls), the trainer lives and nothing outside the
call changed: a bystander process of the same user, files visible inside and outside, host shared
memory, listening sockets, temporary directories, the trainer's own descriptors and threads, and
the isolation report. Hypothesis draws programs of several hostile actions; one test runs every
action once and checks what each one met."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlcore_sandbox import sandbox
from rlcore_sandbox.sandbox import run_code

LIMITS = dict(cpu_seconds=2, memory_mb=192, wall_seconds=4.0, output_bytes=8192)
#: POSIX shared memory as shm_open makes it (multiprocessing's tracker would need a fork), filled
SHM_FILL = ("import _posixshmem, mmap\nfd = _posixshmem.shm_open('/{name}', os.O_CREAT | os.O_RDWR, 0o600)\n"
            "os.ftruncate(fd, {size})\nm = mmap.mmap(fd, {size})\nm[:] = b'x' * {size}")
PRELUDE_MARK = "limits = json.loads(sys.argv[1])"  # in every sandbox prelude's command line


class Host:
    """What lives outside the sandbox, and what must not change."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"],
                                          start_new_session=True)
        self.canary = os.path.join(tmp, "canary.txt")
        with open(self.canary, "w") as f:
            f.write("canary")
        os.chmod(self.canary, 0o644)
        self.secret = os.path.join(tmp, "secret.txt")
        with open(self.secret, "w") as f:
            f.write("TOP-SECRET-TRAINER-FILE")
        os.chmod(self.secret, 0o600)
        self.unix_path = os.path.join(tmp, "trainer.sock")
        self.listeners = []
        for family, address in ((socket.AF_UNIX, self.unix_path), (socket.AF_UNIX, "\0rlcore-hostile"),
                                (socket.AF_INET, ("127.0.0.1", 0))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(address)
            s.listen(8)
            s.setblocking(False)
            self.listeners.append(s)
        self.tcp_port = self.listeners[2].getsockname()[1]
        self.watched = [self.canary, self.secret, self.unix_path, "/dev/null", "/dev/zero", "/usr/bin/env",
                        os.path.realpath(sys.executable), tmp]

    def snapshot(self) -> dict:
        def meta(path: str):
            st_ = os.lstat(path)
            try:
                xattrs = sorted(os.listxattr(path, follow_symlinks=False))
            except OSError:
                xattrs = None
            return (st_.st_mode, st_.st_uid, st_.st_gid, st_.st_mtime_ns, st_.st_size, xattrs)

        with open("/proc/sysvipc/shm") as f:
            sysv = len(f.read().splitlines())
        return {"files": {p: meta(p) for p in self.watched}, "tmp": sorted(os.listdir(self.tmp)),
                # the names a call could leave: the old sandbox's scratch directories, the hostile programs' shm
                "tempdir": sorted(n for n in os.listdir(tempfile.gettempdir()) if n.startswith("rlcore-code-")),
                "dev_shm": sorted(n for n in os.listdir("/dev/shm") if n.startswith("rlcore_")),
                "sysv_shm": sysv, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
                "priority": os.getpriority(os.PRIO_PROCESS, 0), "affinity": os.sched_getaffinity(0),
                "bystander_affinity": os.sched_getaffinity(self.bystander.pid),
                "bystander_priority": os.getpriority(os.PRIO_PROCESS, self.bystander.pid)}

    def no_connection_arrived(self) -> bool:
        for s in self.listeners:
            try:
                conn, _ = s.accept()
            except BlockingIOError:
                continue
            conn.close()
            return False
        return True

    def close(self) -> None:
        self.bystander.kill()
        self.bystander.wait()
        for s in self.listeners:
            s.close()


@pytest.fixture(scope="module")
def host():
    with tempfile.TemporaryDirectory(prefix="rlcore-hostile-host-") as tmp:
        h = Host(tmp)
        yield h
        h.close()


def _sandbox_processes() -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if PRELUDE_MARK in cmd:
            found.append(int(pid))
    return found


def actions(h: Host) -> dict[str, str]:
    """Each hostile action as code; each catches its own error and prints what it met."""
    me, by = os.getpid(), h.bystander.pid
    targets = [by, me, -1, 0, 1, os.getpgid(by)]
    paths = [h.canary, h.secret, "/dev/null", "/usr/bin/env", os.path.realpath(sys.executable), "/proc/self/fd/1",
             "/tmp", "/dev/shm", "/proc/1/exe"]
    a: dict[str, str] = {}
    for t in targets:
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
            a[f"kill {t} {sig.name}"] = f"os.kill({t}, {int(sig)})"
        a[f"killpg {t}"] = f"os.killpg({abs(t)}, 9)"
        a[f"renice {t}"] = f"os.setpriority(os.PRIO_PROCESS, {t}, 19)"
        a[f"affinity {t}"] = f"os.sched_setaffinity({t}, {{0}})"
        a[f"ptrace {t}"] = (f"import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                            f"r = l.ptrace(16, {t}, 0, 0)\nif r < 0: raise OSError(ctypes.get_errno(), 'ptrace')")
        a[f"procmem {t}"] = f"open('/proc/{t}/mem', 'r+b').write(b'x')"
        a[f"pidfd {t}"] = f"fd = os.pidfd_open({t}); signal.pidfd_send_signal(fd, 9)"
    a["renice user"] = "os.setpriority(os.PRIO_USER, 0, 19)"
    a["renice pgrp"] = "os.setpriority(os.PRIO_PGRP, 0, 19)"
    families = {"unix": "socket.AF_UNIX", "inet": "socket.AF_INET", "inet6": "socket.AF_INET6",
                "netlink": "socket.AF_NETLINK", "packet": "socket.AF_PACKET", "vsock": "40", "alg": "38",
                "bluetooth": "31", "can": "29", "tipc": "30", "rds": "21", "xdp": "44", "key": "15"}
    for name, fam in families.items():
        for kind in ("socket.SOCK_STREAM", "socket.SOCK_DGRAM", "socket.SOCK_RAW", "socket.SOCK_SEQPACKET"):
            a[f"socket {name} {kind}"] = f"socket.socket({fam}, {kind})"
    a["connect unix file"] = f"s = socket.socket(socket.AF_UNIX); s.connect({h.unix_path!r})"
    a["connect unix abstract"] = "s = socket.socket(socket.AF_UNIX); s.connect('\\0rlcore-hostile')"
    a["connect tcp"] = f"s = socket.create_connection(('127.0.0.1', {h.tcp_port}), timeout=1)"
    a["socketpair"] = "socket.socketpair()"
    a["x32 socket"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); l.syscall.restype = ctypes.c_long; "
                       "r = l.syscall(0x40000000 | 41, 1, 1, 0)\nif r < 0: raise OSError(ctypes.get_errno(), 'x32')")
    for p in paths:
        a[f"chmod {p}"] = f"os.chmod({p!r}, 0o4777)"
        a[f"chown {p}"] = f"os.chown({p!r}, 1, 1)"
        a[f"utime {p}"] = f"os.utime({p!r}, (1, 1))"
        a[f"setxattr {p}"] = f"os.setxattr({p!r}, 'user.rlcore', b'x')"
        a[f"truncate {p}"] = f"os.truncate({p!r}, 0)"
        a[f"read {p}"] = f"print('READ', open({p!r}, 'rb').read(64))"
        a[f"symlink {p}"] = f"os.symlink({p!r}, 'link'); print(open('link', 'rb').read(32))"
        a[f"hardlink {p}"] = f"os.link({p!r}, 'hard')"
    a["fchmod stdout"] = "os.fchmod(1, 0o4777)"
    a["mkfifo"] = "os.mkfifo('fifo'); os.mkfifo('.output')"
    a["mknod"] = "os.mknod('node', 0o600 | 0o020000, os.makedev(1, 3))"
    a["shm open"] = SHM_FILL.format(name="rlcore_keep", size=1 << 20)
    a["shm then killed"] = SHM_FILL.format(name="rlcore_left", size=8 << 20) + "\nwhile True: pass"
    a["sysv shm"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); r = l.shmget(0, 1 << 20, 0o1000 | 0o666); "
                     "\nif r < 0: raise OSError(ctypes.get_errno(), 'shmget')")
    a["memfd big"] = "fd = os.memfd_create('x'); os.ftruncate(fd, 1 << 34)"
    a["dup over stdout"] = "fd = os.open('/tmp/fake', os.O_CREAT | os.O_WRONLY); os.dup2(fd, 1); print('X')"
    a["forge report"] = ('print("\\x00fences:netns,landlock"); '
                         'print(\'["userns","pidns","ipcns","netns","mntns","utsns","fsview","seccomp"]\')')
    a["write other fds"] = "\n".join(["for fd in range(3, 64):", "    try:", "        os.write(fd, b'[\"forged\"]')",
                                      "    except OSError:", "        pass"])
    a["truncate stdout"] = "os.ftruncate(1, 1 << 33)"
    a["reopen stdout"] = "f = open('/proc/self/fd/1', 'w'); f.write('again')"
    a["fork"] = "os.fork()"
    a["spawn"] = "import subprocess; subprocess.run(['/bin/true'])"
    a["unshare"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); r = l.unshare(0x10000000); "
                    "\nif r != 0: raise OSError(ctypes.get_errno(), 'unshare')")
    a["setns"] = "os.setns(os.open('/proc/1/ns/mnt', os.O_RDONLY), 0)"
    a["chroot"] = "os.chroot('/tmp')"
    a["mount"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                  "r = l.mount(b'none', b'/usr', None, 32 | 4096, None)\nif r != 0: raise OSError(ctypes.get_errno(), 'mount')")
    a["io_uring"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); l.syscall.restype = ctypes.c_long; "
                     "p = ctypes.create_string_buffer(120); r = l.syscall(425, 8, p)\nif r < 0: raise OSError(ctypes.get_errno(), 'io_uring')")
    a["keyctl"] = ("import ctypes; l = ctypes.CDLL(None, use_errno=True); l.syscall.restype = ctypes.c_long; "
                   "r = l.syscall(250, 0, -3, 0, 0, 0)\nif r < 0: raise OSError(ctypes.get_errno(), 'keyctl')")
    return a


def _program(names: list[str], table: dict[str, str]) -> str:
    lines = ["import os, signal, socket, sys"]
    for name in names:
        body = "\n".join("    " + line for line in table[name].split("\n"))
        lines += ["try:", body, f"    print('DONE', {name!r}, flush=True)", "except BaseException as e:",
                  f"    print('REFUSED', {name!r}, type(e).__name__, e, flush=True)"]
    return "\n".join(lines)


def _violations(h: Host, before: dict, result) -> list[str]:
    """What the call changed or reached outside (empty: nothing)."""
    found = []
    if h.bystander.poll() is not None:
        found.append("the bystander process was killed")
    after = h.snapshot()
    found += [f"{key} changed: {before[key]} -> {after[key]}" for key in before if after[key] != before[key]]
    if not h.no_connection_arrived():
        found.append("a listening socket of the trainer got a connection")
    if _sandbox_processes():
        found.append("a process of the call outlived it")
    if "TOP-SECRET" in result.output:
        found.append("the code read a file of the trainer's")
    layers = getattr(sandbox, "LAYERS", None)
    if layers is None or result.isolation != ",".join(layers):
        found.append(f"isolation report: {result.isolation!r}")
    return found


def _assert_nothing_outside_changed(h: Host, before: dict, result) -> None:
    found = _violations(h, before, result)
    assert not found, f"{found}\n{result.output}"


def must_be_refused(name: str, h: Host) -> bool:
    """The actions that must fail inside (the rest must merely leave the outside alone: reading the
    read-only interpreter, signalling itself, writing its own output)."""
    outside = (str(h.bystander.pid), str(os.getpid()), str(os.getpgid(h.bystander.pid)))
    if name.startswith(("socket ", "connect ", "socketpair", "x32 ", "fork", "spawn", "chmod ", "chown ", "utime ",
                        "setxattr ", "ptrace ", "fchmod", "mknod", "sysv shm", "unshare", "setns", "chroot", "mount",
                        "io_uring", "keyctl", "renice ", "affinity ")):
        return True
    if name.startswith(("kill ", "killpg ", "procmem ", "pidfd ")):
        return name.split()[1] in outside
    if name.startswith(("read ", "truncate ", "symlink ", "hardlink ")):
        return name.split()[1] in (h.canary, h.secret)
    return False


def test_every_hostile_action_is_contained(host):
    table = actions(host)
    went_through, changed = [], {}
    for name in sorted(table):
        before = host.snapshot()
        r = run_code(_program([name], table), **{**LIMITS, "cpu_seconds": 1})
        found = _violations(host, before, r)
        if found:
            changed[name] = found
        if f"DONE {name!r}" in r.output and must_be_refused(name, host):
            went_through.append(name)
        if host.bystander.poll() is not None:
            break
    assert not changed, f"changed or reached outside the sandbox: {changed}"
    assert not went_through, f"went through inside the sandbox: {went_through}"


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_hostile_programs_leave_the_trainer_and_the_machine_alone(host, data):
    table = actions(host)
    names = data.draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=6), label="actions")
    before = host.snapshot()
    r = run_code(_program(names, table), **LIMITS)
    _assert_nothing_outside_changed(host, before, r)


def test_a_killed_call_leaves_no_shared_memory_behind(host):
    """The CPU limit kills the code after it filled shared memory: each call's /dev/shm and IPC
    objects die with its namespaces, so nothing grows from call to call."""
    with open("/proc/meminfo") as f:
        shmem_before = next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))
    code = "import os\n" + SHM_FILL.format(name="rlcore_left", size=12 << 20) + "\nwhile True:\n    pass"
    for _ in range(6):
        # an output limit above the segment's size: RLIMIT_FSIZE would refuse the segment otherwise
        r = run_code(code, **{**LIMITS, "cpu_seconds": 1, "output_bytes": 16 << 20})
        assert r.exit < 0 and not r.output, r  # killed at its CPU limit, with the shared memory still mapped
    with open("/proc/meminfo") as f:
        shmem_after = next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))
    assert "rlcore_left" not in os.listdir("/dev/shm")
    # 6 calls x 12 MiB left behind would be 72 MiB; other processes of the machine move Shmem by far less
    assert shmem_after - shmem_before < 32 << 10, (shmem_before, shmem_after)
