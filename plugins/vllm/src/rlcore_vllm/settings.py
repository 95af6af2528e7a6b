"""The ``vllm:`` config section (plain dataclasses: importing this module imports no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError
from rlcore.types import Cap
from rlcore_enginekit.serving import LOOPBACK, check_bind_host

from rlcore_vllm.speculative import check_speculative

MODES = ("offline", "http")
TRANSPORTS = ("auto", "mapped", "shm", "cuda_ipc", "broadcast", "nccl", "ipc")
#: server flags rlcore sets from its own settings; ``engine_args`` may not set them again
OWNED_SERVER_ARGS = {"host": "vllm.host", "port": "vllm.port", "served_model_name": "(rlcore's own name)"}


@dataclass
class VLLMSettings:
    """How the ``vllm`` rollout backend and weight sync run.

    * ``mode``: ``offline`` runs ``vllm.LLM`` under this process (its engine core and workers are
      child processes unless ``multiprocessing`` is false); ``http`` talks to a vLLM OpenAI server
      at ``url``, or launches ``vllm serve`` on ``host:port`` of this machine when ``url`` is
      empty. The server must run with ``VLLM_SERVER_DEV_MODE=1`` (the RL, sleep and RPC routes).
    * ``host``: the address a server rlcore launches listens on. Loopback (``127.0.0.1``) by
      default: the dev-mode routes replace the weights and run RPCs in the workers without
      authentication, so only this machine may reach them. ``0.0.0.0`` exposes them to every
      host that can reach this one; do that only on a network you trust.
    * ``multiprocessing``: vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``. False keeps engine and
      worker in this process (seconds to start instead of ~20 s on a small CPU machine; TRL runs
      vLLM so); the ``mapped`` and ``cuda_ipc`` pushes then hand the worker the trainer's own
      storages, since CUDA cannot open an IPC handle in the process that made it (that path is
      tested on CPU, not yet run on a GPU).
    * ``dtype``: ``auto`` serves in the training engine's dtype (``engine.model.dtype``).
    * ``seeded_requests``: true (default): every prompt's request carries its own seed
      (``rlcore.rollout_seeds``), so a call's samples are reproducible and do not depend on what
      shares the engine's batch. False sends one unseeded SamplingParams: vLLM then samples from
      its engine-wide stream (seeded once by ``vllm.seed``), faster because vLLM's sampler draws a
      seeded request's noise one request at a time, but the samples depend on the batch and a
      resumed run does not repeat them. Partial rollouts (``loop.in_flight: abort``) stay seeded.
    * ``enforce_eager``: vLLM's own flag. Unset (``null``, the default): CUDA graphs on a GPU
      (measured on an H200: generate 3.2 s against 7.3 s eager for 32 x 8 x 256 tokens of a 0.5 B
      model, pushes and sleep mode verified alike: docs/benchmarks/gpu_e2e.md), eager on CPU,
      where vLLM's graph mode is torch.compile at every start. ``true``/``false`` force either.
    * ``kv_cache_gib``: the KV cache size (vLLM's ``kv_cache_memory_bytes``); 0 lets vLLM size it
      from ``gpu_memory_utilization``, which on CPU is a fraction of host RAM.
    * ``transport``: how weights reach the engine. ``shm``: core buckets in shared memory, loaded
      by rlcore's worker extension through vLLM's layerwise reload (works on every platform);
      ``cuda_ipc``: the same worker path and checks (``coverage+exact``), the buckets built on the
      trainer's GPU and opened in vLLM's worker by CUDA IPC (offline engine on the same GPU);
      ``broadcast`` (``cluster.backend: ray`` only): the writer trainer rank broadcasts every
      bucket to all replicas (NCCL from its GPU to theirs, gloo on CPU), and each replica hands it
      to its worker by the ``cuda_ipc`` (GPU: needs ``multiprocessing``) or ``shm`` path, with
      the same checks (``coverage+exact``); for an engine on a GPU of its own
      (:mod:`rlcore_vllm.broadcast`);
      ``nccl`` / ``ipc``: vLLM's native weight-transfer API (GPU only; verified by a probe only);
      ``mapped`` (offline engine on the trainer's machine, an engine that exports its own
      parameters, needs rlcore-ray's transport): the first push goes through vLLM's loaders by
      ``cuda_ipc`` (``shm`` on CPU) and learns where each tensor lands; once that is verified,
      every push is a direct copy out of the trainer's parameters (lent by CUDA IPC, no bucket)
      into those parameter slices, ``coverage+exact`` (:mod:`rlcore_vllm.direct`); where vLLM's
      processing changes the weights (CPU's prepacked GEMMs, quantization) it says why and keeps
      the loaders.
      ``auto``: ``mapped`` when trainer and engine share a GPU and rlcore-ray is installed
      (``cuda_ipc`` with a warning naming the install line otherwise), else ``shm``.
    * ``sleep_for_training``: after every ``generate``, put the engine to sleep (level 1: weights
      to host memory, KV cache released) so that training has the GPU memory; the weights come
      back before the next push, the KV cache after it. The memory freed and the sleep / wake
      seconds are logged (``rollout/sleep_freed_bytes``, ``rollout/sleep_seconds``,
      ``rollout/wake_weights_seconds``, ``rollout/wake_kv_seconds``). Needs sleep mode (GPU).
    * ``release_trainer_cache`` (with ``sleep_for_training``): before the engine wakes, return the
      blocks torch's caching allocator keeps in the trainer's process from training (free, but
      reserved) to the driver, so that vLLM's weights and KV cache reuse that memory instead of
      stacking on top of it; logged as ``rollout/trainer_cache_released_bytes``,
      ``rollout/trainer_peak_allocated_bytes`` (the training's peak since the last wake) and
      ``rollout/trainer_cache_release_seconds``. The next training step allocates them again.
    * ``nccl_master_address`` / ``nccl_master_port``: rendezvous of the ``nccl`` and ``broadcast``
      transports (``broadcast``: the writer rank listens there; replicas on other hosts need its
      host's address).
    * ``draft_phase``: after the target model, push again into the speculative (MTP) draft
      (vLLM's ``start_draft_weight_update``), with the tensors whose names start with one of
      ``draft_weight_prefixes`` (native transports).
    * ``speculative``: ``mtp`` runs vLLM's MTP speculative decoding with the model's own MTP
      layers as the draft (``num_speculative_tokens`` per step); every push then updates and
      verifies target and draft, the draft's weight version is checked after every push and the
      acceptance per draft position is reported each step (:mod:`rlcore_vllm.speculative`).
    * ``min_acceptance_after_push``: with ``speculative``, the first rollout after a push fails
      when its acceptance rate is below this floor (0 = off).
    * ``diagnostic_skip_draft_push_from``: a diagnostic (0 = off): the pushes of weight version
      N and later skip the draft, which keeps version N-1 (the stale-draft failure on purpose, to
      measure it; the run warns every step instead of failing). Never for training runs.
    * ``engine_args``: extra keyword arguments for ``vllm.LLM`` (or ``--key value`` flags of
      ``vllm serve``).
    """

    mode: str = "offline"
    url: str | None = None
    host: str = LOOPBACK
    port: int = 8765
    multiprocessing: bool = True
    dtype: str = "auto"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    enforce_eager: bool | None = None
    seeded_requests: bool = True
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    sleep_for_training: bool = False
    release_trainer_cache: bool = True
    seed: int = 0
    transport: str = "auto"
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29561
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    draft_phase: bool = False
    draft_weight_prefixes: list[str] = field(
        default_factory=lambda: ["model.mtp_layers.", "mtp.", "model.embed_tokens.", "lm_head."])
    speculative: str = ""
    num_speculative_tokens: int = 1
    min_acceptance_after_push: float = 0.0
    diagnostic_skip_draft_push_from: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)


def check_settings(settings: Any, config: Any = None) -> None:
    """Value checks omegaconf's types cannot express; errors name the key. With the whole
    ``config``: what vLLM engines as Ray rollout replicas can run (:func:`check_ray_replicas`)."""
    if settings.mode not in MODES:
        raise ConfigError(f"bad value for config key 'vllm.mode': {settings.mode!r}; choose one of: {', '.join(MODES)}",
                          key="vllm.mode")
    if settings.transport not in TRANSPORTS:
        raise ConfigError(
            f"bad value for config key 'vllm.transport': {settings.transport!r}; choose one of: {', '.join(TRANSPORTS)}",
            key="vllm.transport")
    if settings.tensor_parallel_size < 1:
        raise ConfigError("bad value for config key 'vllm.tensor_parallel_size': must be >= 1",
                          key="vllm.tensor_parallel_size")
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise ConfigError("bad value for config key 'vllm.gpu_memory_utilization': must be in (0, 1]",
                          key="vllm.gpu_memory_utilization")
    if settings.kv_cache_gib < 0:
        raise ConfigError("bad value for config key 'vllm.kv_cache_gib': must be >= 0", key="vllm.kv_cache_gib")
    if settings.transport in ("cuda_ipc", "mapped") and settings.mode != "offline":
        raise ConfigError(f"bad value for config key 'vllm.transport': {settings.transport!r} needs vllm.mode "
                          f"'offline' (the engine on this machine's GPU, colocated); a server receives weights by "
                          f"'shm' or 'nccl'", key="vllm.transport")
    if settings.transport == "mapped" and not mapped_transport_installed():
        raise ConfigError("bad value for config key 'vllm.transport': 'mapped' lends the trainer's parameters "
                          "through rlcore-ray's transport, which is not installed: pip install rlcore-ray",
                          key="vllm.transport")
    if settings.sleep_for_training and not settings.enable_sleep_mode:
        raise ConfigError("bad value for config key 'vllm.sleep_for_training': needs vllm.enable_sleep_mode true",
                          key="vllm.sleep_for_training")
    check_bind_host(settings.host, "vllm.host")
    if not 0 < settings.port < 65536:
        raise ConfigError(f"bad value for config key 'vllm.port': {settings.port}; expected a TCP port in 1..65535",
                          key="vllm.port")
    check_speculative(settings)
    for arg, setting in OWNED_SERVER_ARGS.items():
        if arg in (settings.engine_args or {}):
            raise ConfigError(f"vllm.engine_args sets {arg!r}, which rlcore sets itself from {setting}",
                              key=f"vllm.engine_args.{arg}")
    if config is not None:
        check_ray_replicas(settings, config)


def runs_as_replicas(config: Any) -> bool:
    """Whether ``rollout.backend: vllm`` runs as rollout replicas in processes of their own: the
    launcher declares ``rollout_replicas`` (``cluster.backend: ray``; core copies a launcher's
    capabilities into the resolved config's ``cluster.launcher_capabilities``)."""
    cluster = config.get("cluster") if hasattr(config, "get") else None
    return cluster is not None and Cap.ROLLOUT_REPLICAS in list(cluster.get("launcher_capabilities") or []) \
        and str(config.rollout.backend) == "vllm"


def check_ray_replicas(settings: Any, config: Any) -> None:
    """vLLM engines as Ray rollout replicas (``rlcore_ray.fleet``): weights reach every
    replica through the fleet and the ``shm`` worker path, or by ``broadcast`` (which is for
    replicas only); what is not built for replicas yet is refused here, naming the key, instead of
    running half-wired."""
    if not runs_as_replicas(config):
        if settings.transport == "broadcast":
            raise ConfigError("bad value for config key 'vllm.transport': 'broadcast' feeds vLLM rollout replicas "
                              "under cluster.backend=ray only; one engine of this process takes 'cuda_ipc' or 'shm' "
                              "(or 'auto')", key="vllm.transport")
        return
    if settings.transport not in ("auto", "shm", "broadcast"):
        raise ConfigError(f"bad value for config key 'vllm.transport': {settings.transport!r} with "
                          f"cluster.backend=ray; vLLM rollout replicas receive weights through the Ray fleet, by "
                          f"'broadcast' or the 'shm' transport only (set 'shm', 'broadcast' or 'auto')",
                          key="vllm.transport")
    replica_gpus = float(config.cluster.rollout.resources.num_gpus)
    if settings.transport == "broadcast" and replica_gpus > 0 and not settings.multiprocessing:
        raise ConfigError("bad value for config key 'vllm.multiprocessing': false with vllm.transport 'broadcast' and "
                          "replicas on GPUs: a replica hands each received bucket to vLLM's worker by CUDA IPC, "
                          "which cannot open a buffer in the process that made it (set it true)",
                          key="vllm.multiprocessing")
    if settings.mode != "offline":
        raise ConfigError("bad value for config key 'vllm.mode': 'http' with cluster.backend=ray; vLLM rollout "
                          "replicas run offline engines in their actors (servers as replicas are not built)",
                          key="vllm.mode")
    if settings.speculative:
        raise ConfigError("bad value for config key 'vllm.speculative' with cluster.backend=ray: the draft's "
                          "weight version is not carried through the Ray fleet yet; run MTP speculation with "
                          "cluster.backend=local", key="vllm.speculative")


def mapped_transport_installed() -> bool:
    """Whether rlcore-ray's transport (``rlcore_ray.transport``, no Ray import) can be imported."""
    import importlib.util

    try:
        return importlib.util.find_spec("rlcore_ray.transport") is not None
    except ModuleNotFoundError:
        return False


def choose_transport(settings: Any, config: Any = None) -> str:
    """``vllm.transport`` resolved: ``auto`` is ``shm`` for Ray rollout replicas; otherwise, when the
    trainer runs on a GPU and the engine is offline (colocated), ``mapped`` (``cuda_ipc``, with a
    warning naming the install line, without rlcore-ray), else ``shm``."""
    if settings.transport != "auto":
        return settings.transport
    if config is not None and runs_as_replicas(config):
        return "shm"  # replicas: the Ray fleet's path (check_ray_replicas)
    device = str(config.engine.device) if config is not None else "cpu"
    if settings.mode == "offline" and device in ("cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            if mapped_transport_installed():
                return "mapped"
            _warn_once("vllm.transport 'auto' pushes through vLLM's loaders ('cuda_ipc'): the direct-copy push "
                       "('mapped', several times faster) needs rlcore-ray's transport: pip install rlcore-ray")
            return "cuda_ipc"
    return "shm"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    import warnings

    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
