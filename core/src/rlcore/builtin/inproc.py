"""Built-in plugin ``inproc``: flattened buckets into an in-process receiver."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, WeightSyncSpec

__all__ = ["PLUGIN_API", "weight_sync"]


def _build(ctx):
    from rlcore.weight_sync import build_inproc

    return build_inproc(ctx)


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="inproc",
        factory=_build,
        capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.ATOMIC, Cap.FEEDS_REPLICAS},
        requires_backend={Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS},
        description="core bucket builder -> BucketReceiver, checksum-verified, staged and swapped",
    )
