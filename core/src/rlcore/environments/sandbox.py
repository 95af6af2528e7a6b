"""The code-execution tool ``python``: the model's code in a separate, limited process (off
unless ``environment.code.enable``; limits under ``environment.code``).

Each call starts a fresh ``python -I`` child in a new session (so its whole process group can be
killed) with a scratch directory of its own as working directory; before the model's code runs,
the child (:data:`CHILD`, a self-contained prelude: nothing of rlcore is imported there) fences
itself in:

* **network**: a new, empty network namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``), where
  the kernel allows unprivileged user namespaces; and, with Landlock ABI >= 4, TCP bind and
  connect refused.
* **filesystem**: Landlock (Linux >= 5.13) allows writes only under the scratch directory;
  reading stays allowed (the interpreter reads its standard library).
* **processes**: a seccomp filter (x86_64 and aarch64) refuses ``fork``, ``vfork`` and a
  ``clone`` that is not a thread (``EAGAIN``; ``clone3``: ``ENOSYS``, so libc falls back to
  ``clone``): the code runs in one process, threads allowed. ``RLIMIT_NPROC`` bounds its threads
  too, but not where the child runs as root (a container): root ignores it.
* **resources** (``setrlimit``, set first, so a new user namespace inherits them): CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  processes (``RLIMIT_NPROC``: a fork bomb gets ``EAGAIN``), file size (``RLIMIT_FSIZE``: stdout
  and stderr go to a file in the scratch directory, so a huge output stops at
  ``output_bytes``), open files.
* **wall clock**: the parent kills the child's process group at ``wall_seconds``.

Where the kernel refuses a namespace or Landlock, the child runs without that fence and
:func:`isolation` (and each result's ``isolation`` line) says so: nothing is claimed that does
not hold. The scratch directory is removed after each call.
"""

from __future__ import annotations

import json
import os
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

#: the child's prelude: fences (network, filesystem, resources), then the model's code from stdin
CHILD = r'''
import ctypes, json, os, resource, sys
limits = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
fences = []
import platform  # processes: a seccomp filter refuses fork, vfork, clone3 and a clone that is not a thread
arch = {"x86_64": (0xC000003E, {57, 58}, 56), "aarch64": (0xC00000B7, set(), 220)}.get(platform.machine())
if arch is not None:
    audit, forks, clone = arch
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    ERRNO = lambda e: 0x00050000 | e  # noqa: E731
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, audit), (0x06, 0, 0, KILL), (0x20, 0, 0, 0),
            (0x35, 0, 1, 0x40000000), (0x06, 0, 0, KILL)]  # another ABI's numbers (x32): killed
    for nr in sorted(forks):
        prog += [(0x15, 0, 1, nr), (0x06, 0, 0, ERRNO(11))]
    prog += [(0x15, 0, 1, 435), (0x06, 0, 0, ERRNO(38)),  # clone3: ENOSYS (its flags are out of reach)
             (0x15, 0, 3, clone), (0x20, 0, 0, 16), (0x45, 1, 0, 0x10000), (0x06, 0, 0, ERRNO(11)),
             (0x06, 0, 0, ALLOW)]

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(prog))(*[Insn(*i) for i in prog])
    if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(Prog(len(prog), insns)), 0, 0) == 0:
        fences.append("nofork")
# before the new user namespace, which inherits the RLIMIT_NPROC its creator had
for name, value in (("RLIMIT_CPU", limits["cpu"]), ("RLIMIT_AS", limits["memory"]), ("RLIMIT_NPROC", limits["nproc"]),
                    ("RLIMIT_FSIZE", limits["fsize"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
if libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET: no interfaces but lo (down)
    fences.append("netns")

class Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64)]

class Beneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

libc.syscall.restype = ctypes.c_long
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: ABI version
if abi >= 1:
    write = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make anything
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # refer, truncate
    net = 0b11 if abi >= 4 else 0  # TCP bind and connect
    attr = Ruleset(write, net)
    size = ctypes.sizeof(Ruleset) if net else 8
    rfd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    dfd = os.open(limits["scratch"], os.O_PATH | os.O_DIRECTORY)
    rule = Beneath(write, dfd)
    ok = rfd >= 0 and libc.syscall(445, rfd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) == 0
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, rfd, ctypes.c_uint32(0)) == 0
    os.close(dfd)
    if ok:
        fences.append("landlock" + ("+tcp" if net else ""))
os.chdir(limits["scratch"])
print("\x00fences:" + ",".join(fences), file=sys.stderr, flush=True)
code = sys.stdin.read()
del ctypes, json, libc, limits, resource
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
'''

_FENCES = "\x00fences:"


@dataclass
class RunResult:
    """One run of the model's code: ``output`` (stdout and stderr, at most ``output_bytes``),
    ``exit`` (the return code; negative: killed by that signal), ``timed_out`` (killed at the
    wall-clock limit), ``isolation`` (the fences that held, e.g. ``netns,landlock+tcp``)."""

    output: str
    exit: int
    timed_out: bool
    isolation: str
    seconds: float


def run_code(code: str, *, cpu_seconds: int = 2, memory_mb: int = 256, wall_seconds: float = 5.0,
             max_processes: int = 8, output_bytes: int = 4096) -> RunResult:
    """Run ``code`` in a fenced child (see the module docstring); never raises for what the code does."""
    scratch = tempfile.mkdtemp(prefix="rlcore-code-")
    out_path = os.path.join(scratch, ".output")
    limits = {"scratch": scratch, "cpu": int(cpu_seconds), "memory": int(memory_mb) << 20,
              "nproc": int(max_processes), "fsize": int(output_bytes) + len(_FENCES) + 64}
    t0 = time.perf_counter()
    try:
        with open(out_path, "wb") as out:
            child = subprocess.Popen([sys.executable, "-I", "-c", CHILD, json.dumps(limits)], stdin=subprocess.PIPE,
                                     stdout=out, stderr=out, cwd=scratch, start_new_session=True,
                                     env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            timed_out = False
            try:
                child.stdin.write(code.encode("utf-8", "replace"))  # type: ignore[union-attr]
                child.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:  # the child died before reading its code (a limit at start)
                pass
            try:
                child.wait(timeout=wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(child.pid)  # whatever the code left running (a fork bomb's survivors) goes too
            child.wait()
        with open(out_path, "rb") as f:
            raw = f.read(limits["fsize"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = raw.decode("utf-8", "replace")
    isolation = ""
    if _FENCES in text:
        head, _, rest = text.partition(_FENCES)
        isolation, _, tail = rest.partition("\n")
        text = head + tail
    return RunResult(text[:output_bytes], child.returncode, timed_out, isolation, time.perf_counter() - t0)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@lru_cache(maxsize=1)
def isolation() -> str:
    """The fences a child gets on this machine (``netns``, ``landlock`` or ``landlock+tcp``), by
    running one: what the docs and a run's notes may claim."""
    return run_code("pass").isolation


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
    """The ``python`` tool with ``environment.code``'s ``limits``: runs its argument as a Python
    program and answers with what it printed."""

    def run(code: str) -> str:
        return describe(run_code(code, cpu_seconds=limits.cpu_seconds, memory_mb=limits.memory_mb,
                                 wall_seconds=limits.wall_seconds, max_processes=limits.max_processes,
                                 output_bytes=limits.output_bytes), limits)

    return Tool("python", run, "runs a Python program in a sandbox; answers with its output")
