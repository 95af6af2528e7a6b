"""Built-in plugin ``disk``: safetensors in HF names, then a reload by the receiver."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, WeightSyncSpec

__all__ = ["PLUGIN_API", "weight_sync"]


def _build(ctx):
    from rlcore.weight_sync import build_disk

    return build_disk(ctx)


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="disk",
        factory=_build,
        capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.ATOMIC, Cap.FEEDS_REPLICAS},
        requires_backend={Cap.RECEIVE_DISK, Cap.WEIGHT_CHECKSUMS},
        description="safetensors shards (HF names) under the output dir, reloaded by the backend",
    )
