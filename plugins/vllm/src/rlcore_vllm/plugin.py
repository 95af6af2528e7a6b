"""The ``vllm`` plugin module (entry point ``vllm = "rlcore_vllm.plugin"``).

It registers the ``vllm`` rollout backend, the ``vllm`` weight sync and the ``vllm:`` config
section. Importing it imports neither vLLM nor torch: the factories do, when a config selects
them, so ``rlcore plugins`` and ``rlcore check`` stay fast and work where vLLM is not installed.
"""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, PluginSettings, RolloutBackendSpec, WeightSyncSpec

from rlcore_vllm.platform import (
    DECLARED_BACKEND_CAPABILITIES,
    DECLARED_SYNC_CAPABILITIES,
    installed_build_note,
    predicted_backend_gaps,
    predicted_sync_gaps,
)
from rlcore_vllm.settings import VLLMSettings, check_settings

__all__ = ["PLUGIN_API", "plugin_settings", "rollout_backend", "weight_sync"]


@hookimpl
def plugin_settings():
    return PluginSettings(section="vllm", schema=VLLMSettings, validate=check_settings)


def _build_backend(ctx):
    from rlcore_vllm.backend import build_backend

    return build_backend(ctx)


def _build_sync(ctx):
    from rlcore_vllm.sync import build_sync

    return build_sync(ctx)


@hookimpl
def rollout_backend():
    yield RolloutBackendSpec(
        name="vllm",
        factory=_build_backend,
        capabilities=DECLARED_BACKEND_CAPABILITIES,
        platform_gaps=predicted_backend_gaps,
        description="vLLM engine (offline LLM or OpenAI server), processed_logprobs; " + installed_build_note(),
    )


@hookimpl
def weight_sync():
    yield WeightSyncSpec(
        name="vllm",
        factory=_build_sync,
        capabilities=DECLARED_SYNC_CAPABILITIES,
        platform_gaps=predicted_sync_gaps,
        backends={"vllm"},
        requires_backend={Cap.LOGPROBS},
        description="core buckets into vLLM: shared memory + layerwise reload (any platform), "
                    "native NCCL/IPC weight transfer (GPU); LoRA adapter pushes into vLLM's LoRA (offline); "
                    "checksums computed in the worker",
    )
