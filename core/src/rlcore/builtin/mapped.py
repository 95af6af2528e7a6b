"""Built-in plugin ``mapped``: the writer trainer rank lends its parameters to colocated rollout
replicas (CUDA IPC on a GPU, shared memory on CPU); each replica copies straight out of them."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, WeightSyncSpec

__all__ = ["PLUGIN_API", "weight_sync"]


def _build(ctx):
    from rlcore.mapped_sync import build_mapped

    return build_mapped(ctx)


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="mapped",
        factory=_build,
        capabilities={Cap.VERIFIED, Cap.ATOMIC, Cap.CUDA_IPC, Cap.FEEDS_REPLICAS, Cap.LENDS_STORAGE},
        requires_backend={Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS},
        description="cluster.backend=ray, colocated replicas: parameters lent by storage, one copy per replica",
    )
