"""The ``megatron:`` config section, its checks, and the engine's declared capabilities
(importing this module imports no engine).

:func:`validate_settings` is the section's ``PluginSettings.validate``: everything the engine
would refuse when it is built (settings megatron-core rejects, devices a setting needs, an HF
config megatron-core cannot express, parallel sizes the model cannot be split by) is refused by
``rlcore check`` first, naming the key. The engine runs the same checks (:func:`check_values`,
:func:`check_device`, :func:`check_model`) when it is built outside a config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlcore.errors import ConfigError
from rlcore.types import Cap

from rlcore_megatron.hf_config import ModelSpec, model_spec_from_hf

#: what the ``megatron`` engine declares (its EngineSpec) and what the engine object reports
ENGINE_CAPABILITIES = frozenset(
    {Cap.MOE, Cap.MTP, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES, Cap.DATA_PARALLEL, Cap.TENSOR_PARALLEL,
     Cap.EXPERT_PARALLEL, Cap.PIPELINE_PARALLEL, Cap.VALUE_MODEL, Cap.ENGINE_MODEL, Cap.MOE_MTP}
)


@dataclass
class MegatronSettings:
    """``megatron:`` section.

    * ``tensor_parallel_size`` / ``expert_parallel_size``: model split over ranks; every rank
      runs the same step. ``rlcore train`` runs the ranks with ``cluster.backend=ray``, where
      ``cluster.trainer.tp`` / ``ep`` decide these (:func:`resolve_parallel`); a bare engine
      (tests) may run under torchrun with them set here.
    * ``pipeline_parallel_size`` (``cluster.trainer.pp`` under Ray): the decoder's layers cut
      into stages run one after another inside each forward (:mod:`.pipeline`);
      ``virtual_pipeline_stages``: chunks per pipeline rank (interleaved: rank ``s`` holds chunks
      ``s, s + pp, ...``). Dense models without MTP layers or tied embeddings; PPO's critic
      runs beside them (its value head on the last stage, :mod:`.value`).
    * ``sequence_parallel``: only with Transformer Engine (the THD path).
    * ``attention``: ``auto`` (THD on CUDA: Transformer Engine where installed, else torch's varlen
      kernel through :mod:`rlcore_megatron.varlen_attention`; padded rows on CPU), ``te``, ``local``
      (padded rows).
    * ``token_dispatcher``: ``allgather`` (any device) or ``alltoall`` (CUDA).
    * ``moe_aux_loss_coeff``: megatron's load-balancing loss (0: off, the RL default).
    * ``vocab_size_divisible_by``: the embedding and LM head are padded to a multiple of this ×
      TP; padding rows are excluded from the softmax and never exported.
    * ``export_mtp``: include MTP layers in the weights sent to the rollout engine and in
      ``save_hf`` (an engine that drafts with them needs them). Qwen2 models export them in
      MiMo's layout, which the local rollout and vLLM load; other models in DeepSeek-V3's, which
      neither loads: set it false there (the written config then declares no MTP layers).
    * ``seed``: megatron's model-parallel CUDA RNG seed.
    """

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    virtual_pipeline_stages: int = 1
    sequence_parallel: bool = False
    attention: str = "auto"
    token_dispatcher: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    vocab_size_divisible_by: int = 128
    export_mtp: bool = True
    seed: int = 1234


ATTENTION = ("auto", "te", "local")

#: the megatron setting each ``cluster.trainer`` dimension decides under ``cluster.backend=ray``
CLUSTER_DIMS = (("tp", "tensor_parallel_size"), ("ep", "expert_parallel_size"), ("pp", "pipeline_parallel_size"))


def section_settings(section: Any) -> MegatronSettings:
    """The ``megatron:`` config section (validated by its schema) as :class:`MegatronSettings`."""
    if section is None:
        return MegatronSettings()
    names = {f.name for f in dataclasses.fields(MegatronSettings)}
    return MegatronSettings(**{k: section[k] for k in section.keys() if k in names})


def launcher_places_ranks(config: Any) -> bool:
    """Whether the run's launcher starts the trainer ranks from ``cluster.trainer``'s sizes (it
    declares ``places_ranks``; core copies a launcher's capabilities into the resolved config)."""
    cluster = config.get("cluster") if config is not None and hasattr(config, "get") else None
    return cluster is not None and Cap.PLACES_RANKS in list(cluster.get("launcher_capabilities") or [])


def resolve_parallel(s: MegatronSettings, config: Any = None) -> MegatronSettings:
    """The settings with the run's parallel sizes. One source of truth per launcher: under a
    launcher that places the ranks itself (it declares ``places_ranks``: ``cluster.backend=ray``)
    ``cluster.trainer.tp`` / ``ep`` / ``pp`` decide ``tensor_parallel_size`` /
    ``expert_parallel_size`` / ``pipeline_parallel_size``; the megatron keys may be left at 1 or
    set to the same value, anything else is an error naming both keys. Otherwise (one process, or a
    bare engine under torchrun) the megatron keys are used as they are."""
    if not launcher_places_ranks(config):
        return s
    sizes = {}
    for dim, key in CLUSTER_DIMS:
        mine, theirs = int(getattr(s, key)), int(config.cluster.trainer[dim])
        if mine not in (1, theirs):
            raise ConfigError(
                f"megatron.{key}={mine} conflicts with cluster.trainer.{dim}={theirs}: under cluster.backend="
                f"{config.cluster.backend} "
                f"the trainer ranks' layout is cluster.trainer.{dim} and megatron.{key} follows it; set "
                f"cluster.trainer.{dim}={mine} (and leave megatron.{key} at 1 or equal to it)",
                key=f"cluster.trainer.{dim}")
        sizes[key] = theirs
    return dataclasses.replace(s, **sizes)
TOKEN_DISPATCHERS = ("allgather", "alltoall")


def check_values(s: Any) -> None:
    """Settings megatron-core or the engine refuse whatever the model and device."""
    for key in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size", "virtual_pipeline_stages",
                "vocab_size_divisible_by"):
        if getattr(s, key) < 1:
            raise ConfigError(f"bad value for config key 'megatron.{key}': {getattr(s, key)!r}; must be >= 1",
                              key=f"megatron.{key}")
    if s.pipeline_parallel_size > 1 and s.sequence_parallel:
        raise ConfigError("megatron.sequence_parallel beside pipeline parallelism is not supported (not run)",
                          key="megatron.sequence_parallel")
    if s.attention not in ATTENTION:
        raise ConfigError(f"megatron.attention must be auto, te or local, got {s.attention!r}",
                          key="megatron.attention")
    if s.token_dispatcher not in TOKEN_DISPATCHERS:
        raise ConfigError(f"megatron.token_dispatcher must be allgather or alltoall, got {s.token_dispatcher!r}",
                          key="megatron.token_dispatcher")
    if s.moe_aux_loss_coeff < 0:
        raise ConfigError(f"bad value for config key 'megatron.moe_aux_loss_coeff': {s.moe_aux_loss_coeff!r}; "
                          f"must be >= 0", key="megatron.moe_aux_loss_coeff")
    if not 0 <= s.seed < 2**32:
        raise ConfigError(f"bad value for config key 'megatron.seed': {s.seed!r}; must be in [0, 2**32)",
                          key="megatron.seed")
    if s.sequence_parallel and s.tensor_parallel_size == 1:
        # megatron-core's ModelParallelConfig raises a bare ValueError for this
        raise ConfigError("megatron.sequence_parallel=true needs megatron.tensor_parallel_size > 1 (it splits the "
                          "sequence over the tensor-parallel ranks)", key="megatron.sequence_parallel")
    if s.sequence_parallel and s.attention == "local":
        raise ConfigError(
            "megatron.sequence_parallel needs the THD path (Transformer Engine): megatron's local norm "
            "does not support sequence parallelism; set megatron.attention=auto or te", key="megatron.sequence_parallel"
        )


def check_device(s: Any, device_type: str) -> None:
    """Settings that need CUDA (``device_type``: ``cpu``, ``cuda``, ...; ``auto`` checks nothing)."""
    if device_type in ("auto", "cuda"):
        return
    if s.token_dispatcher == "alltoall":
        raise ConfigError("megatron.token_dispatcher=alltoall needs CUDA (it creates CUDA streams); use allgather",
                          key="megatron.token_dispatcher")
    if s.attention == "te":
        raise ConfigError("megatron.attention=te needs Transformer Engine on a CUDA device", key="megatron.attention")
    if s.sequence_parallel:
        raise ConfigError(
            "megatron.sequence_parallel needs the THD path (Transformer Engine on a CUDA device): megatron's "
            "local norm does not support sequence parallelism", key="megatron.sequence_parallel"
        )


def check_model(s: Any, sp: ModelSpec) -> None:
    """Parallel sizes the model can be split by."""
    check_pipeline(s, sp)
    tp = s.tensor_parallel_size
    if sp.num_kv_heads % tp or sp.num_heads % tp:
        raise ConfigError(
            f"megatron.tensor_parallel_size={tp} must divide the number of attention "
            f"heads ({sp.num_heads}) and of key/value heads ({sp.num_kv_heads})", key="megatron.tensor_parallel_size"
        )
    ep = s.expert_parallel_size
    if ep > 1 and not sp.is_moe:
        # megatron-core raises a bare ValueError ("num_moe_experts must be non None to use expert-parallel")
        raise ConfigError(f"megatron.expert_parallel_size={ep} needs an MoE model; {sp.model_type!r} has no experts",
                          key="megatron.expert_parallel_size")
    if sp.is_moe and sp.num_experts % ep:
        raise ConfigError(
            f"megatron.expert_parallel_size={ep} must divide the number of experts "
            f"({sp.num_experts})", key="megatron.expert_parallel_size"
        )


def check_pipeline(s: Any, sp: ModelSpec) -> None:
    """What pipeline stages (:mod:`.pipeline`) can run: at least one decoder layer per chunk;
    not built for MoE (routes are recorded and replayed per micro-batch over the whole model), MTP
    layers or tied embeddings (they join the first and the last stage)."""
    pp, vpp = s.pipeline_parallel_size, s.virtual_pipeline_stages
    if pp == 1:
        if vpp > 1:  # checked on the resolved sizes: under Ray cluster.trainer.pp decides pp
            raise ConfigError(f"megatron.virtual_pipeline_stages={vpp} needs megatron.pipeline_parallel_size > 1 "
                              f"(cluster.trainer.pp under Ray)", key="megatron.virtual_pipeline_stages")
        return
    key = "megatron.pipeline_parallel_size"
    if sp.num_layers < pp * vpp:
        raise ConfigError(f"{key}={pp} x megatron.virtual_pipeline_stages={vpp} = {pp * vpp} chunks need at least "
                          f"as many decoder layers; the model has {sp.num_layers}", key=key)
    for what, present in (("an MoE model", sp.is_moe), ("MTP layers", sp.mtp_layers > 0),
                          ("tied embeddings (tie_word_embeddings)", sp.tie_word_embeddings)):
        if present:
            raise ConfigError(f"{key}={pp}: pipeline stages are not supported with {what} ({sp.model_type!r})",
                              key=key)


def model_spec_for(config: Any) -> ModelSpec:
    """The :class:`ModelSpec` the engine will build for ``config``: from ``engine.model.path``'s
    config.json (read as JSON: no transformers, no weights), or from ``engine.model.tiny``
    exactly as the engine creates the tiny model. Errors name the HF field (and the tiny key)."""
    model = config.engine.model
    if model.path:
        path = Path(model.path) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"engine.model.path: {model.path} has no config.json (not an HF model directory)",
                              key="engine.model.path") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"engine.model.path: cannot read {path}: {exc}", key="engine.model.path") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"engine.model.path: {path} is not a JSON object", key="engine.model.path")
        try:
            return model_spec_from_hf(SimpleNamespace(**raw))
        except ConfigError:
            raise
        except (AttributeError, TypeError, ValueError) as exc:  # a field missing or of the wrong type
            raise ConfigError(f"engine.model.path: {path} is not a config the megatron engine can read: {exc}",
                              key="engine.model.path") from exc
    from rlcore.engines.tiny import tiny_config

    tiny = model.tiny
    try:
        return model_spec_from_hf(tiny_config(tiny, vocab_size=tiny.vocab_size or 16, eos_id=1, pad_id=0))
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the tiny model engine.model.tiny: arch={tiny.arch}, topk={tiny.topk}, "
                          f"num_experts={tiny.num_experts}, num_heads={tiny.num_heads}, "
                          f"num_kv_heads={tiny.num_kv_heads})", key=exc.key or "engine.model.tiny") from exc


def validate_settings(section: Any, config: Any = None) -> None:
    """``PluginSettings.validate`` of the ``megatron:`` section (see the module docstring). The
    checks that need the model and the device apply when ``engine.name`` is ``megatron``."""
    check_values(section)
    if config is None or config.engine.name != "megatron":
        return
    resolved = resolve_parallel(section_settings(section), config)
    check_values(resolved)
    dp = int(config.cluster.trainer.dp)
    if dp > 1 and resolved.expert_parallel_size > 1:
        raise ConfigError(f"cluster.trainer.dp={dp} beside expert parallelism (megatron.expert_parallel_size="
                          f"{resolved.expert_parallel_size}) is not supported: the EP ranks of a model run the same "
                          f"samples; use dp with tp (and pp) only", key="cluster.trainer.dp")
    check_device(resolved, str(config.engine.device).split(":")[0])
    spec = model_spec_for(config)
    try:
        check_model(resolved, spec)
    except ConfigError as exc:
        if resolved is section or not launcher_places_ranks(config):
            raise
        raise ConfigError(f"{exc} (under cluster.backend={config.cluster.backend} the sizes are cluster.trainer.tp / "
                          f"cluster.trainer.ep / cluster.trainer.pp)", key=exc.key) from exc


def exports_mtp_beyond_mimo(config: Any) -> bool:
    """Whether the megatron engine pushes MTP layers in a layout other than MiMo's over Qwen2
    (``megatron.export_mtp`` with MTP layers on another model type): the rollout backend must
    declare ``any_mtp_layout`` (a constraint of the plugin)."""
    if config.engine.name != "megatron" or not bool(config.megatron.export_mtp):
        return False
    sp = model_spec_for(config)
    return bool(sp.mtp_layers) and sp.model_type != "qwen2"


def mtp_export_reason(config: Any) -> str:
    sp = model_spec_for(config)
    return (f"megatron.export_mtp=true sends the {sp.mtp_layers} MTP layer(s) of this {sp.model_type!r} model, a "
            f"layout other than MiMo's over Qwen2; set megatron.export_mtp: false (the MTP layers still train)")
