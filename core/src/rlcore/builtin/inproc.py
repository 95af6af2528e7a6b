"""Built-in plugin ``inproc``: flattened buckets into an in-process receiver. ``sync.delta`` (send
only what changed, :mod:`rlcore.delta`) needs a sync that declares ``delta`` and a backend that
declares ``receive_deltas`` (:data:`DELTA_SYNC`, :data:`DELTA_RECEIVER`), and, with replicas in
processes of their own, a launcher that declares ``receive_deltas`` too (:data:`DELTA_REPLICAS`):
``inproc`` into ``local`` in one process; ``disk`` or another backend is refused naming ``sync.delta``."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, RequiresCapability, WeightSyncSpec

__all__ = ["PLUGIN_API", "constraints", "weight_sync"]

DELTA_SYNC = RequiresCapability(
    role="weight_sync", capability=Cap.DELTA, when=lambda cfg: bool(cfg.sync.delta),
    reason="sync.delta=true sends only what changed since the receiver's version; this sync sends every tensor: "
           "use sync.name=inproc or leave sync.delta at false",
)
DELTA_RECEIVER = RequiresCapability(
    role="rollout_backend", capability=Cap.RECEIVE_DELTAS, when=lambda cfg: bool(cfg.sync.delta),
    reason="sync.delta=true pushes encoded deltas that the backend applies to the version it holds; leave "
           "sync.delta at false for this backend",
)

#: replicas in other processes are fed through the launcher's fleet, which must forward deltas
DELTA_REPLICAS = RequiresCapability(
    role="launcher", capability=Cap.RECEIVE_DELTAS,
    when=lambda cfg: bool(cfg.sync.delta) and Cap.ROLLOUT_REPLICAS in cfg.cluster.launcher_capabilities,
    reason="sync.delta=true with rollout replicas in processes of their own: the launcher's fleet must forward "
           "delta pushes; leave sync.delta at false",
)


def _build(ctx):
    from rlcore.weight_sync import build_inproc

    return build_inproc(ctx)


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="inproc",
        factory=_build,
        capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.ATOMIC, Cap.FEEDS_REPLICAS, Cap.DELTA},
        requires_backend={Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS},
        description="core bucket builder -> BucketReceiver, checksum-verified, staged and swapped",
    )


@hookimpl
def constraints():
    yield DELTA_SYNC
    yield DELTA_RECEIVER
    yield DELTA_REPLICAS
