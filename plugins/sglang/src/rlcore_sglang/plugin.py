"""Entry point ``sglang``: the ``sglang`` rollout backend and the ``sglang-tensor``,
``sglang-nccl`` and ``sglang-disk`` weight syncs, plus the ``sglang:`` config section.

This module stays cheap to import (``rlcore plugins`` imports it): it imports neither torch nor
SGLang. The factories import the backend and the syncs, which import torch; SGLang itself is
imported only by the in-process Engine mode (``sglang.mode: engine``).
"""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, PluginSettings, RolloutBackendSpec, WeightSyncSpec

from rlcore_sglang.settings import SGLangSettings, check_settings

__all__ = ["PLUGIN_API", "plugin_settings", "rollout_backend", "weight_sync"]

#: what the ``sglang`` backend can do with a server started with the matching flags; an instance
#: reports the subset its server really has (``--enable-memory-saver``,
#: ``--enable-return-routed-experts``, ``--speculative-algorithm``)
BACKEND_CAPABILITIES = frozenset(
    {
        Cap.LOGPROBS,
        Cap.PAUSE,
        Cap.PREFIX_CACHE_RESET,
        Cap.RELEASE_KV_CACHE,
        Cap.RELEASE_WEIGHTS,
        Cap.ROUTED_EXPERTS,
        Cap.SPECULATIVE,
        Cap.ANY_MTP_LAYOUT,  # pushed MTP layers go through SGLang's own loaders for the model's architecture
    }
)


@hookimpl
def plugin_settings():
    return PluginSettings(section="sglang", schema=SGLangSettings, validate=check_settings)


def _build_backend(ctx):
    from rlcore_sglang.backend import build_backend

    return build_backend(ctx)


def _build_tensor(ctx):
    from rlcore_sglang.sync import build_tensor_sync

    return build_tensor_sync(ctx)


def _build_nccl(ctx):
    from rlcore_sglang.sync import build_nccl_sync

    return build_nccl_sync(ctx)


def _build_disk(ctx):
    from rlcore_sglang.sync import build_disk_sync

    return build_disk_sync(ctx)


@hookimpl
def rollout_backend():
    yield RolloutBackendSpec(
        name="sglang",
        factory=_build_backend,
        capabilities=BACKEND_CAPABILITIES,
        description="SGLang server over HTTP (launched or at sglang.url) or in-process sglang.Engine",
    )


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="sglang-tensor",
        factory=_build_tensor,
        capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.CUDA_IPC, Cap.DRAFT_PHASE},
        backends={"sglang"},
        description="colocated: flattened buckets as CUDA-IPC (GPU UUID) or shared-memory handles, "
                    "one payload per TP rank, inside SGLang's weight-update session",
    )
    yield WeightSyncSpec(
        name="sglang-nccl",
        factory=_build_nccl,
        capabilities={Cap.BUCKETED, Cap.VERIFIED, Cap.NCCL, Cap.DRAFT_PHASE},
        backends={"sglang"},
        description="one broadcast per flattened bucket from the trainer (rank 0) to SGLang's ranks",
    )
    yield WeightSyncSpec(
        name="sglang-disk",
        factory=_build_disk,
        capabilities={Cap.BUCKETED, Cap.VERIFIED},
        backends={"sglang"},
        description="safetensors versions the server reloads with update_weights_from_disk",
    )
