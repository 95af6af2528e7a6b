"""The ``broadcast`` transport of a Ray fleet of vLLM replicas (``vllm.transport: broadcast``).

The writer trainer rank and every replica actor form one collective group of their own (not the
trainer ranks' torch.distributed world): NCCL when the writer's buckets are on a GPU, gloo on CPU.
Each bucket's bytes go to every replica by one broadcast from the writer (rank 0), straight into
the replica's GPU (or, on CPU, into the shared-memory segment its vLLM workers map); only the
bucket's names, shapes and offsets travel through Ray. The replica then hands the bytes to vLLM's
worker by the path the colocated pushes use (CUDA IPC on a GPU, the segment on CPU), so the checks
are the same: ``coverage`` in the workers, ``exact`` from the checksums they compute of the bytes
they loaded and read back from the model.

Rendezvous: the writer opens a ``torch.distributed.TCPStore`` on
``vllm.nccl_master_address:nccl_master_port`` at its first push, writes the group's size and
backend there, and each replica takes the next rank from it when the first bucket reaches it (a
replica does not know its index or the fleet's size). Replicas on other hosts need the writer's
host address in ``vllm.nccl_master_address``.
"""

from __future__ import annotations

import datetime
from typing import Any

#: keys in the rendezvous store (under one prefix, so a reused port never mixes two groups' keys)
PREFIX = "rlcore-vllm-broadcast"


def tensors_extent(metas: Any) -> int:
    """Bytes from the bucket's start to the end of its last tensor: what is broadcast (a bucket's
    buffer may end in padding nobody reads)."""
    return max((int(m.offset) + int(m.nbytes) for m in metas), default=0)


class BroadcastGroup:
    """One side of the group: ``BroadcastGroup.serve`` on the writer, ``BroadcastGroup.join`` in a
    replica. ``broadcast(tensor)`` sends (rank 0) or receives (every other rank) into ``tensor``."""

    def __init__(self, store: Any, rank: int, world: int, backend: str, timeout_s: float):
        import torch.distributed as dist

        self.store, self.rank, self.world, self.backend = store, rank, world, backend
        timeout = datetime.timedelta(seconds=float(timeout_s))
        prefixed = dist.PrefixStore(PREFIX, store)
        if backend == "nccl":
            # made lazily by NCCL at the first broadcast, on the device of the tensor it is given
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        else:  # gloo connects every pair here: all ranks must be constructing at the same time
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)

    @classmethod
    def open_store(cls, address: str, port: int, replicas: int, backend: str, timeout_s: float) -> Any:
        """The writer's rendezvous store, with the group's size and backend for the replicas."""
        import torch.distributed as dist

        store = dist.TCPStore(address, int(port), replicas + 1, True,
                              timeout=datetime.timedelta(seconds=float(timeout_s)), wait_for_workers=False)
        store.set(f"{PREFIX}/world", str(replicas + 1))
        store.set(f"{PREFIX}/backend", backend)
        return store

    @classmethod
    def join(cls, address: str, port: int, timeout_s: float) -> BroadcastGroup:
        """A replica's side: connect to the writer's store, take the next rank, build the group."""
        import torch.distributed as dist

        store = dist.TCPStore(address, int(port), None, False, timeout=datetime.timedelta(seconds=float(timeout_s)))
        world = int(store.get(f"{PREFIX}/world"))
        backend = store.get(f"{PREFIX}/backend").decode()
        rank = int(store.add(f"{PREFIX}/ranks", 1))
        if not 0 < rank < world:
            raise RuntimeError(f"broadcast group at {address}:{port}: this replica took rank {rank} of a group of "
                               f"{world} (more replicas joined than the writer expects: is another run using "
                               f"vllm.nccl_master_port {port}?)")
        return cls(store, rank, world, backend, timeout_s)

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            import torch

            # NCCL ran on its own stream; the bytes are complete for any later reader (another
            # process opening them by CUDA IPC included) once this stream has caught up
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Drop this side of the group without waiting for the others. NCCL's orderly shutdown
        waits for every rank to shut down too, and the writer and the replicas close at different
        times (the writer waits for the replicas' own shutdown first): that deadlocked on two H100s.
        An abort is local."""
        if self.backend == "nccl":
            abort = getattr(self.pg, "abort", None) or getattr(self.pg, "_abort", None)
            if callable(abort):
                try:
                    abort()
                except Exception:  # noqa: BLE001 - closing on the way out; nothing to report to
                    pass
        self.pg = None
