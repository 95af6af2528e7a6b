"""Two processes of a source-mapped push (:mod:`rlcore_ray.transport.mapped`) in tests and benchmarks:
a channel over a ``multiprocessing`` pipe, a receiving target, and the receiver's process entry
point (importable by spawn children, so they live in the package).

:class:`ParamStore` holds its parameters the way a rollout engine does: some carved out of one flat
buffer (``"flat"``), some allocated one by one (``"own"``), and some that its loader fills (``"loader"``:
not offered as direct destinations, like a fused parameter; it receives them through
``receive_bucket`` into staging, swapped in on commit). Direct destinations are written in place,
so a push that fails after its copies began leaves them torn: ``abort_update`` records that in
``torn`` (a real engine must not generate until a push commits).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rlcore.sync import WeightManifest, tensor_checksum

from rlcore_ray.transport.protocol import ChannelClosed, TransportError


class PipeChannel:
    """A :class:`~rlcore_ray.transport.protocol.Channel` over one end of a ``multiprocessing`` pipe
    (what the two spawned processes of a test or a benchmark share). Messages are pickled, so CUDA
    IPC handles travel as the plain tuples torch's reductions make of them."""

    def __init__(self, conn: Any, peer: str = "peer"):
        self.conn = conn
        self.peer = peer

    def _closed(self, exc: BaseException) -> ChannelClosed:
        return ChannelClosed(f"the {self.peer} closed the channel ({type(exc).__name__}); did it die?")

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, ConnectionResetError, OSError) as exc:
            raise self._closed(exc) from exc

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return bool(self.conn.poll(timeout))
        except (EOFError, OSError) as exc:
            raise self._closed(exc) from exc

    def recv(self, timeout: float | None) -> tuple:
        if timeout is not None and not self.poll(timeout):
            raise TransportError(f"no message from the {self.peer} in {timeout:g} s")
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._closed(exc) from exc

#: (name, shape, dtype name, placement) of the small model the CPU tests use
SPEC: list[tuple[str, tuple[int, ...], str, str]] = [
    ("model.embed_tokens.weight", (64, 32), "float32", "own"),
    *[(f"model.layers.{i}.mlp.experts.{e}.{p}.weight", (8, 16), "bfloat16", "flat")
      for i in range(2) for e in range(6) for p in ("gate_proj", "down_proj")],
    ("model.layers.0.self_attn.qkv_proj.weight", (3, 16, 16), "float32", "loader"),
    ("model.norm.weight", (7,), "float16", "own"),
    ("lm_head.weight", (64, 32), "float32", "own"),
]


def allocate(spec: list, device: torch.device | str = "cpu", shared: bool = False,
             seed: int | None = None) -> dict[str, torch.Tensor]:
    """Tensors of ``spec``: the ``"flat"`` ones as consecutive views of one buffer per dtype (the
    layout of a flat parameter buffer), the others one by one; seeded random values or zeros."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out: dict[str, torch.Tensor] = {}
    flat_sizes: dict[str, int] = {}
    for _, shape, dt, where in spec:
        if where == "flat":
            flat_sizes[dt] = flat_sizes.get(dt, 0) + int(torch.Size(shape).numel())
    flats = {dt: torch.zeros(n, dtype=getattr(torch, dt), device=device) for dt, n in flat_sizes.items()}
    if shared:
        for f in flats.values():
            f.share_memory_()
    cursor = dict.fromkeys(flats, 0)
    for name, shape, dt, where in spec:
        n = int(torch.Size(shape).numel())
        if where == "flat":
            t = flats[dt][cursor[dt]:cursor[dt] + n].view(shape)
            cursor[dt] += n
        else:
            t = torch.zeros(shape, dtype=getattr(torch, dt), device=device)
            if shared:
                t.share_memory_()
        if g is not None:
            t.copy_(torch.randn(shape, generator=g).to(t.dtype))
        out[name] = t
    return out


class ParamStore:
    def __init__(self, spec: list, device: torch.device | str = "cpu", slow_commit: dict[int, float] | None = None,
                 relocate_after: dict[int, str] | None = None):
        self.params = allocate(spec, device)
        self.relocate_after = dict(relocate_after or {})  # version -> name moved to new memory after it
        self.loader_names = {n for n, _, _, where in spec if where == "loader"}
        self.shapes = {n: s for n, s, _, _ in spec}
        self.version = 0
        self.aborted = 0
        self.torn = False
        self.slow_commit = dict(slow_commit or {})
        self._staging: dict[str, torch.Tensor] | None = None

    def weight_manifest(self) -> WeightManifest:
        return WeightManifest(self.shapes)

    def direct_destinations(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.params.items() if n not in self.loader_names}

    def begin_update(self, version: int) -> None:
        self._staging = {}

    def receive_bucket(self, bucket: Any) -> None:
        assert self._staging is not None, "receive_bucket outside begin/commit"
        for name, view in bucket.tensors():
            self._staging[name] = view.clone()

    def commit_update(self, version: int) -> None:
        assert self._staging is not None
        if version in self.slow_commit:
            time.sleep(self.slow_commit[version])
        for name, t in self._staging.items():
            self.params[name].copy_(t)
        self._staging = None
        self.version, self.torn = version, False
        if version in self.relocate_after:  # as an engine that frees and re-allocates its weights
            name = self.relocate_after[version]
            self.params[name] = self.params[name].clone()

    def abort_update(self) -> None:
        self._staging = None
        self.aborted += 1
        self.torn = True  # the direct destinations may hold part of the failed push

    def weight_checksums(self) -> dict[str, int]:
        return {n: tensor_checksum(t) for n, t in self.params.items()}


def mapped_receiver_main(conn: Any, spec: list, slow_commit: dict[int, float] | None = None,
                         timeout: float = 60.0, device: str = "cpu", relocate_after: dict[int, str] | None = None) -> None:
    """Serve mapped pushes into a :class:`ParamStore` until ``("close",)``, then answer
    ``("result", version, checksums, aborted, torn, summaries)`` (or ``("crash", text)``)."""
    from rlcore_ray.transport import MappedReceiver

    torch.set_num_threads(1)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = ParamStore(spec, device=device, slow_commit=slow_commit, relocate_after=relocate_after)
        summaries = MappedReceiver(PipeChannel(conn, "trainer"), timeout=timeout).serve(store)
        conn.send(("result", store.version, store.weight_checksums(), store.aborted, store.torn, summaries))
    except Exception:  # noqa: BLE001
        import traceback

        conn.send(("crash", traceback.format_exc()))
        raise


def start_receiver_process(main: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Spawn ``main(conn, *args, **kwargs)`` (e.g. :func:`mapped_receiver_main`); returns this
    side's end of the pipe and the process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=main, args=(child, *args), kwargs=kwargs, daemon=True)
    proc.start()
    child.close()
    return parent, proc


def finish_receiver_process(conn: Any, proc: Any) -> tuple:
    """Tell a receiver started by :func:`start_receiver_process` to close; its ``("result", ...)``
    answer (an ``AssertionError`` if it crashed or did not answer within 60 s)."""
    conn.send(("close",))
    assert conn.poll(60), "the receiver did not answer"
    res = conn.recv()
    proc.join(30)
    assert res[0] == "result", res[1] if res[0] == "crash" else res
    return res
