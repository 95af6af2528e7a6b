"""One rank of the gather-per-bucket check (run by torchrun from test_gather_per_bucket.py).

It loads an HF directory into the megatron engine with TP or EP = 2, then exports the weights
twice through the sync's bucket builder (:func:`rlcore.sync.iter_buckets`, as a push does):
grouped (``gather_bytes`` = the bucket size, a quarter of the model's gathered bytes, so several
groups) and per tensor (``gather_bytes=1``). It counts the collectives by wrapping
``torch.distributed``'s gather functions, and tracks, at each collective, how many earlier gather
buffers are still alive (weak references to their storages). Rank 0 saves the counts and both
exports. Arguments: the model directory, the result file, tp, ep."""

from __future__ import annotations

import gc
import sys
import time
import weakref

import torch

GATHER_INTO = ("all_gather_single", "all_gather_into_tensor")


class CollectiveCounter:
    """Wraps ``dist.all_gather`` and the gather-into-tensor function of this torch; ``calls``
    counts each, ``sizes`` the bytes each gather-into produced, ``max_alive`` the most gather
    buffers alive at once (the new one included)."""

    def __init__(self, dist) -> None:
        self.dist = dist
        self.into = next(n for n in GATHER_INTO if hasattr(dist, n))
        self.calls = {"into": 0, "list": 0}
        self.sizes: list[int] = []
        self.alive: list[weakref.ref] = []
        self.max_alive = 0
        self.saved = {n: getattr(dist, n) for n in (self.into, "all_gather")}

    def __enter__(self) -> CollectiveCounter:
        real_into, real_list = self.saved[self.into], self.saved["all_gather"]

        def into(output, inp, *args, **kwargs):
            self.calls["into"] += 1
            self.sizes.append(output.numel() * output.element_size())
            self.alive = _still_alive(self.alive) + [weakref.ref(output.untyped_storage())]
            self.max_alive = max(self.max_alive, len(self.alive))
            return real_into(output, inp, *args, **kwargs)

        def gather_list(*args, **kwargs):
            self.calls["list"] += 1
            return real_list(*args, **kwargs)

        setattr(self.dist, self.into, into)
        self.dist.all_gather = gather_list
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def _still_alive(buffers: list[weakref.ref], patience_s: float = 2.0) -> list[weakref.ref]:
    """The buffers among ``buffers`` still alive, after giving other threads up to ``patience_s``
    to let go of them. gloo's worker thread can hold a finished collective's work, and with it
    the output tensor, for a moment after ``wait()`` returns (seen once on a loaded 2-core CI
    machine). Python code of this process cannot release anything while this call waits, since
    the export is suspended inside it, so a buffer the export itself keeps stays alive."""
    deadline = time.monotonic() + patience_s
    while True:
        gc.collect()  # only references decide what is alive, not the collector's timing
        alive = [w for w in buffers if w() is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def _kept(stream, into: dict[str, torch.Tensor]):
    """``stream`` as it is, a copy of each tensor kept in ``into`` (the bucket builder drops them)."""
    for name, t in stream:
        into[name] = t.clone()
        yield name, t


def run(model_dir: str, result_path: str, tp: int, ep: int) -> None:
    import torch.distributed as dist
    from rlcore.sync import iter_buckets
    from rlcore_megatron.engine import HFSource, MegatronEngine
    from rlcore_megatron.settings import MegatronSettings
    from rlcore_megatron.weights import _gather_kind, export_hf

    engine = MegatronEngine(HFSource.from_dir(model_dir),
                            MegatronSettings(tensor_parallel_size=tp, expert_parallel_size=ep))
    params = engine.named_parameters()
    gathered = [_gather_kind(engine.names(n), p.detach(), engine.par)[1] for n, p in params]
    bucket_bytes = sum(gathered) // 4
    result = {"bucket_bytes": bucket_bytes, "sharded": sum(1 for b in gathered if b),
              "largest_gather": max(gathered)}
    for label, gather_bytes in (("grouped", bucket_bytes), ("per_tensor", 1)):
        exported: dict[str, torch.Tensor] = {}
        with CollectiveCounter(dist) as counter:
            stream = export_hf(params, engine.names, gather_bytes=gather_bytes)
            buckets = sum(1 for _ in iter_buckets(_kept(stream, exported), bucket_bytes))
        result[label] = {"collectives": dict(counter.calls), "sizes": counter.sizes, "max_alive": counter.max_alive,
                         "buckets": buckets, "export": exported}
    if dist.get_rank() == 0:
        torch.save(result, result_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
