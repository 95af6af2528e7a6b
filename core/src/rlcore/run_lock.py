"""One process per run directory: an OS lock on ``RUN/run.lock``.

Two processes writing one run (a second ``--resume`` while the first still runs) interleave
``metrics.jsonl`` and race on the checkpoints. The writer takes :func:`fcntl.flock` on the lock
file before it touches anything in the directory and holds it until the run ends; the kernel
drops it when the process dies, however it dies, so there is never a stale lock to clear by
hand. The holder writes its pid (and host) into the file so that a refused process can name it.
The file itself stays: deleting a lock file while another process may have opened it would let
two processes hold "the" lock on two different files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rlcore.errors import RunOutputError

LOCK_FILE = "run.lock"


def _describe(fd: int) -> str:
    """What the holder wrote about itself: ``pid N on HOST since T`` (best effort)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        where = f" on {info['host']}" if info.get("host") and info["host"] != socket.gethostname() else ""
        return f"pid {int(info['pid'])}{where}, running since {info.get('since', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown: it has not written it yet"


class RunLock:
    """The held lock; :meth:`release` (or the end of the process) gives it up."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        path = Path(out) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunOutputError(f"cannot create the lock file {path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _describe(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunOutputError(f"cannot lock {path}: {exc.strerror or exc}") from exc
            raise RunOutputError(
                f"{out} is in use by another rlcore process ({holder}): two processes on one run directory "
                f"would interleave its metrics and checkpoints. Wait for it to end or stop it, or choose another "
                f"--output") from None
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
        except OSError:  # the lock holds without the note; a refused process says "pid unknown"
            pass
        return cls(path, fd)

    @staticmethod
    def holder(out: Path) -> str | None:
        """Who holds the lock of ``out`` now (``None``: nobody), without creating anything."""
        try:
            fd = os.open(Path(out) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except OSError:
            return _describe(fd)
        finally:
            os.close(fd)  # also drops the shared lock taken above

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:  # a lock nobody releases is released with its owner
        self.release()
