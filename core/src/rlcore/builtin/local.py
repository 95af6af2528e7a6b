"""Built-in plugin ``local``: the in-process rollout backend. The settings it reads in core's
``rollout:`` section (``draft_depths``, ``local_update``) need a backend that declares reading them
(:data:`DRAFTS_WITH_POLICY_MTP`, :data:`LOADS_IN_PLACE`): another backend has its own."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, RequiresCapability, RolloutBackendSpec

__all__ = ["PLUGIN_API", "constraints", "rollout_backend"]

DRAFTS_WITH_POLICY_MTP = RequiresCapability(
    role="rollout_backend", capability=Cap.POLICY_MTP_DRAFTS, when=lambda cfg: cfg.rollout.draft_depths > 0,
    reason=lambda cfg: (f"rollout.draft_depths={cfg.rollout.draft_depths} drafts with the policy's own MTP layers; "
                        f"a backend without it has its own speculative settings"),
)
LOADS_IN_PLACE = RequiresCapability(
    role="rollout_backend", capability=Cap.IN_PLACE_LOAD, when=lambda cfg: cfg.rollout.local_update == "in_place",
    reason="rollout.local_update='in_place' loads each pushed bucket into the live weights; a backend without it "
           "loads pushes its own way: leave rollout.local_update at 'staged'",
)


def _gaps(config):
    """``staged_load`` is how the local rollout loads by default; ``rollout.local_update: in_place``
    writes each bucket straight into the live weights instead, so a sync that lends its storages
    (which needs a staged copy) cannot feed it then."""
    if config.rollout.local_update == "in_place":
        return {Cap.STAGED_LOAD: "rollout.local_update='in_place' loads each bucket into the live weights, "
                                 "without a staged copy"}
    return {}


def _build(ctx):
    from rlcore.rollout_local import build_local_rollout

    return build_local_rollout(ctx)


@hookimpl
def rollout_backend():
    yield RolloutBackendSpec(
        name="local",
        factory=_build,
        capabilities={Cap.LOGPROBS, Cap.PAUSE, Cap.RELEASE_KV_CACHE, Cap.ROUTED_EXPERTS, Cap.RECEIVE_BUCKETS,
                      Cap.RECEIVE_DISK, Cap.WEIGHT_CHECKSUMS, Cap.SPECULATIVE, Cap.REPLICA, Cap.STAGED_LOAD,
                      Cap.IN_PLACE_LOAD, Cap.POLICY_MTP_DRAFTS, Cap.RECEIVE_DELTAS,
                      Cap.RECEIVE_ADAPTERS},
        description="in-process sampler over a copy of the policy (transformers, KV cache; MTP speculative drafts)",
        platform_gaps=_gaps,
    )


@hookimpl
def constraints():
    yield DRAFTS_WITH_POLICY_MTP
    yield LOADS_IN_PLACE
