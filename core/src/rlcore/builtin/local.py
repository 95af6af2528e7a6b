"""Built-in plugin ``local``: the in-process rollout backend."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, RolloutBackendSpec

__all__ = ["PLUGIN_API", "rollout_backend"]


def _build(ctx):
    from rlcore.rollout_local import build_local_rollout

    return build_local_rollout(ctx)


@hookimpl
def rollout_backend():
    yield RolloutBackendSpec(
        name="local",
        factory=_build,
        capabilities={Cap.LOGPROBS, Cap.PAUSE, Cap.RELEASE_KV_CACHE, Cap.ROUTED_EXPERTS, Cap.RECEIVE_BUCKETS,
                      Cap.RECEIVE_DISK, Cap.WEIGHT_CHECKSUMS, Cap.SPECULATIVE, Cap.REPLICA, Cap.STAGED_LOAD},
        description="in-process sampler over a copy of the policy (transformers, KV cache; MTP speculative drafts)",
    )
