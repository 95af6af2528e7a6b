"""Process entry points and a plain receiving target for :mod:`rlcore.transport` tests and
benchmarks (importable by ``multiprocessing`` spawn children, so they live in the package).

:class:`TensorStore` is the smallest honest :class:`rlcore.types.BucketReceiver`: it holds named
tensors, stages a push by copying every delivered tensor, and swaps it in on commit. A ``delay``
makes it a slow receiver that sleeps *before* reading each bucket, the case in which a sender
that reuses a buffer too early would be caught.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlcore.sync import WeightManifest, tensor_checksum


class TensorStore:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, delay: float = 0.0,
                 device: torch.device | str | None = None):
        self.tensors = dict(tensors or {})
        self.delay = delay
        self.device = device
        self.version = 0
        self._staging: dict[str, torch.Tensor] | None = None
        self.aborted = 0

    def begin_update(self, version: int) -> None:
        self._staging = {}

    def receive_bucket(self, bucket: Any) -> None:
        assert self._staging is not None, "receive_bucket outside begin/commit"
        if self.delay:
            time.sleep(self.delay)
        for name, view in bucket.tensors():
            dst = self.tensors.get(name)
            if dst is not None and dst.shape == view.shape and dst.dtype == view.dtype:
                # reuse last version's storage for the staging copy only when it is not live
                self._staging[name] = view.to(dst.device, copy=True)
            else:
                self._staging[name] = view.to(self.device or view.device, copy=True)

    def commit_update(self, version: int) -> None:
        assert self._staging is not None
        self.tensors.update(self._staging)
        self._staging = None
        self.version = version

    def abort_update(self) -> None:
        self._staging = None
        self.aborted += 1

    def weight_checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        keys = list(names) if names is not None else list(self.tensors)
        return {n: tensor_checksum(self.tensors[n]) for n in keys if n in self.tensors}


def receiver_main(conn: Any, plane_kind: str, manifest_shapes: dict | None = None, delay: float = 0.0,
                  dist_init: dict | None = None, result_conn: Any = None) -> None:
    """Serve pushes (over ``conn``, or a TCP channel when ``conn`` is ``("tcp", address, authkey)``)
    until the sender sends ``("close",)``, then answer on ``result_conn``
    (default: ``conn``) with ``("result", version, checksums, aborted, summaries)`` (or
    ``("crash", text)``). ``dist_init``: join a gloo world (``init_method``, ``rank``,
    ``world_size``), create ``groups`` (lists of ranks, in the trainers' order) and receive over
    ``groups[data_group]`` from ``src`` when the plane is ``dist``."""
    from rlcore.transport import PipeChannel, WeightReceiver, receiver_plane_for

    torch.set_num_threads(1)
    if isinstance(conn, tuple) and conn[0] == "tcp":  # ("tcp", address, authkey): a ChannelListener
        from rlcore.transport import connect_channel

        conn = connect_channel(conn[1], conn[2], "trainer").conn
    result_conn = result_conn if result_conn is not None else conn
    store = TensorStore(delay=delay)
    try:
        kwargs: dict[str, Any] = {}
        if dist_init is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=dist_init["init_method"], rank=dist_init["rank"],
                                    world_size=dist_init["world_size"])
            groups = [dist.new_group(ranks) for ranks in dist_init.get("groups", [])]
            if plane_kind == "dist":
                kwargs = {"src": dist_init["src"], "group": groups[dist_init["data_group"]] if groups else None}
        manifest = WeightManifest(manifest_shapes) if manifest_shapes is not None else None
        receiver = WeightReceiver(PipeChannel(conn, "trainer"), receiver_plane_for(plane_kind, **kwargs),
                                  manifest=manifest, timeout=120)
        summaries = []
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                break
            if msg[0] == "abort":  # follows a push this side already failed
                conn.send(("aborted", msg[1]))
                continue
            try:
                summaries.append(receiver.serve_one(store, msg))
            except Exception as exc:  # noqa: BLE001 - reported to the test, then keep serving
                summaries.append({"error": f"{type(exc).__name__}: {exc}"})
        if dist_init is not None:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
        result_conn.send(("result", store.version, store.weight_checksums(), store.aborted, summaries))
    except Exception:  # noqa: BLE001
        import traceback

        result_conn.send(("crash", traceback.format_exc()))
        raise


def start_receiver_process(main: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Spawn ``main(conn, *args, **kwargs)`` (a receiver entry point such as :func:`receiver_main`
    or :func:`rlcore.testing.mapped.mapped_receiver_main`); returns this side's end of the pipe and
    the process."""
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


def peak_rss_reset() -> bool:
    """Reset this process's peak RSS (``VmHWM``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_kib(field: str = "VmHWM") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def sharded_export(shards: list[tuple[str, torch.Tensor, int]], group: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A tensor-parallel export: each rank holds ``shard`` of every weight, split along ``dim``;
    every weight is all-gathered as it is reached (one full tensor at a time, as
    rlcore-megatron's ``export_hf`` does) and yielded."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    for name, shard, dim in shards:
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        yield name, torch.cat(parts, dim=dim)
        del parts


def make_shards(num: int, rows: int, cols: int, rank: int, size: int, seed: int = 0) -> list[tuple[str, torch.Tensor, int]]:
    """Rank ``rank``'s shards of ``num`` fp32 ``[rows, cols]`` weights split by rows (the full
    tensor is the same on every rank: seeded per weight)."""
    out = []
    for i in range(num):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        full = torch.randn(rows, cols, generator=g)
        out.append((f"model.layers.{i}.mlp.weight", full.chunk(size, dim=0)[rank].clone(), 0))
    return out


def full_checksums(num: int, rows: int, cols: int, seed: int = 0) -> dict[str, int]:
    return {n: tensor_checksum(t) for n, t, _ in make_shards(num, rows, cols, 0, 1, seed)}


def trainer_rank_main(conn: Any, result_conn: Any, rank: int, world: int, init_method: str, plane_kind: str,
                      num: int, rows: int, cols: int, slot_bytes: int, versions: int) -> None:
    """Ranks 0..world-2 hold TP shards; rank 0 sends to the receiver over ``conn``, the others
    drain; the receiver is rank ``world - 1`` (it joins the world so that a gloo data plane can
    reach it; groups: ``[tp ranks], [0, world - 1]``). Rank 0 answers on ``result_conn`` with
    ``("sent", reports, extra_peak_kib, model_bytes, reset_ok)``."""
    import torch.distributed as dist

    from rlcore.transport import DistPlane, PipeChannel, ShmPlane, WeightSender, drain

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    tp = dist.new_group(list(range(world - 1)))
    data = dist.new_group([0, world - 1])  # every rank creates every group, in the same order
    shards = make_shards(num, rows, cols, rank, world - 1)
    reports = []
    try:
        if rank == 0:
            plane = DistPlane(src=0, group=data) if plane_kind == "dist" else ShmPlane()
            sender = WeightSender(PipeChannel(conn, "rollout"), plane, slot_bytes, num_slots=2, timeout=120)
            extra, reset_ok = [], True
            for v in range(1, versions + 1):
                base = rss_kib("VmRSS")
                reset_ok = peak_rss_reset() and reset_ok
                reports.append(sender.send(sharded_export(shards, tp), version=v))
                extra.append(rss_kib("VmHWM") - base)
            # a push the receiver refuses at its first bucket (an unknown name): the sender must
            # still drain the export, whose gathers the other ranks are in
            stream = sharded_export(shards, tp)
            bad = ((f"{n}.unknown" if i == 0 else n, t) for i, (n, t) in enumerate(stream))
            try:
                sender.send(bad, version=versions + 1)
                refused = "not refused"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                refused = f"{type(exc).__name__}: {exc}"
            drain(stream)
            conn.send(("close",))
            sender.close()
            result_conn.send(("sent", [(r.version, r.num_tensors, r.num_buckets, r.bytes, r.details) for r in reports],
                              extra, num * rows * cols * 4, reset_ok, refused))
        else:
            for _ in range(versions + 1):
                drain(sharded_export(shards, tp))
    finally:
        dist.barrier()
        dist.destroy_process_group()
