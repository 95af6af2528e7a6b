"""Fixtures of core's tests. ``gloo_ranks``: trainer ranks (or any code that joins a gloo group) in
processes of their own, started, joined and reported in one place (five tests had a copy each)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


def _rank_entry(target: Callable[..., Any], rank: int, port: int, outcomes: Any, args: tuple) -> None:
    """One spawned rank: ``target(rank, port, *args)``; its outcome (``None``, or the error as
    ``"Type: message"``) goes to the parent with this process's pid. A failed rank exits 1."""
    failed = None
    try:
        target(rank, port, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        failed = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    outcomes.put((rank, os.getpid(), failed))
    outcomes.close()
    outcomes.join_thread()  # the queue's feeder flushes before _exit
    sys.stdout.flush()
    sys.stderr.flush()
    # exit without the interpreter's teardown, where torch's C++ threads once aborted a finished
    # rank ("terminate called without an active exception", exit -6, no Python error; 1 run in
    # about 10 in CI)
    os._exit(1 if failed else 0)


@dataclass
class RankExits:
    """How the ranks ended: ``exitcodes`` (``None``: killed at the timeout), ``outcomes``
    (rank -> ``(pid, None or "Type: message")``, for the ranks that reported)."""

    exitcodes: list[int | None]
    outcomes: dict[int, tuple[int, str | None]]

    @property
    def errors(self) -> list[str]:
        return [f"rank {r}: {what}" for r, (_, what) in sorted(self.outcomes.items()) if what]

    def check(self) -> None:
        """Every rank finished without an error."""
        assert all(code == 0 for code in self.exitcodes), (self.exitcodes, self.errors)


@pytest.fixture
def gloo_ranks() -> Callable[..., RankExits]:
    """``gloo_ranks(target, *args, world=2, timeout=300)``: run ``target(rank, port, *args)`` in
    ``world`` spawned processes (``port``: a free TCP port on 127.0.0.1 for their
    ``init_process_group``), wait for all (a rank still running at ``timeout`` is killed) and
    return their :class:`RankExits`. ``target`` must be a module-level function of the test."""

    def spawn(target: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 300.0) -> RankExits:
        ctx = mp.get_context("spawn")
        outcomes = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_rank_entry, args=(target, r, port, outcomes, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout)
        killed = [p.is_alive() for p in procs]
        for p, kill in zip(procs, killed, strict=True):
            if kill:
                p.kill()
                p.join()
        got: dict[int, tuple[int, str | None]] = {}
        while True:
            try:
                rank, pid, what = outcomes.get(timeout=0.5)
            except queue.Empty:
                break
            got[rank] = (pid, what)
        return RankExits([None if kill else p.exitcode for p, kill in zip(procs, killed, strict=True)], got)

    return spawn


@pytest.fixture
def check_refusal(capsys) -> Callable[..., str]:
    """``check_refusal(config, *overrides)``: ``rlcore check`` refuses in one line (exit code 2,
    no traceback); returns the line."""
    from rlcore.cli import main

    def refused(config: str, *overrides: str) -> str:
        rc = main(["check", config, *overrides])
        out, err = capsys.readouterr()
        assert rc == 2, f"check accepted {overrides}: {out[-400:]}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlcore: error: "), err
        return lines[0]

    return refused
