"""Building megatron-core's model for an HF config: settings checks, process groups, the
``TransformerConfig``, the ``GPTModel`` with its MTP block, and the MoE router sites.

:class:`~rlcore_megatron.engine.MegatronEngine` calls each function once, at construction;
none keeps state of its own (megatron-core's parallel state aside).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rlcore.errors import ConfigError, RLCoreError

from rlcore_megatron import compat
from rlcore_megatron.hf_config import ModelSpec
from rlcore_megatron.routers import RouterSite
from rlcore_megatron.settings import MegatronSettings, check_device, check_model, check_values
from rlcore_megatron.weights import Parallel


def check_settings(s: MegatronSettings, sp: ModelSpec, device: torch.device) -> None:
    """Refuse settings this model or device cannot run, naming the ``megatron.*`` field (the
    checks ``rlcore check`` runs on the config: :mod:`.settings`)."""
    check_values(s)
    check_device(s, device.type)
    check_model(s, sp)


def uses_transformer_engine(device: torch.device) -> bool:
    """Transformer Engine runs here (importable, CUDA device)."""
    return device.type == "cuda" and compat.te_available()


def choose_attention_path(s: MegatronSettings, device: torch.device) -> str:
    """``thd`` or ``padded`` (rows; see the engine's docstring). ``auto`` is ``thd`` on CUDA: with
    Transformer Engine's layer spec where it is installed, else with the local spec and
    :mod:`.varlen_attention` (torch's variable-length attention); ``padded`` on CPU. ``local``
    is ``padded``."""
    te = uses_transformer_engine(device)
    if s.attention == "te" and not te:
        raise ConfigError("megatron.attention=te needs Transformer Engine on a CUDA device", key="megatron.attention")
    path = "thd" if (s.attention == "te" or (s.attention == "auto" and device.type == "cuda")) else "padded"
    if s.sequence_parallel and not (path == "thd" and te):
        raise ConfigError(
            "megatron.sequence_parallel needs the THD path with Transformer Engine: megatron's local norm "
            "does not support sequence parallelism", key="megatron.sequence_parallel"
        )
    return path


@dataclass(frozen=True)
class CreatedGroups:
    """What :func:`init_parallel` initialised itself (what :func:`release_parallel` releases): the
    default process group, and megatron-core's parallel state with the pipeline groups."""

    default_group: bool
    model_parallel: bool


def init_parallel(settings: MegatronSettings, device: torch.device) -> CreatedGroups:
    """torch.distributed and megatron-core's model-parallel groups, once per process. A default
    group that is already initialised is used as it is: the Ray trainer ranks
    (``rlcore.parallel.worker``) join it before the engine is built, with ``tp * ep`` ranks from
    ``cluster.trainer``. Otherwise it is created here with the device platform's backend (gloo on
    CPU, NCCL on CUDA, HCCL on NPU): torchrun's world, or a world of one. Returns what it created,
    which only its creator releases (a group or parallel state found here is someone else's)."""
    from rlcore.platforms import platform_for

    platform = platform_for(device)  # gloo on CPU, nccl on CUDA, the platform's own (hccl on NPU)
    created_default = not dist.is_initialized()
    if created_default:
        backend = platform.dist_backend
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type != "cpu":
        platform.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state as ps

    want = (settings.tensor_parallel_size, settings.expert_parallel_size)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != want:
            raise ConfigError(
                f"megatron-core's parallel state is already initialised with tensor/expert parallel sizes "
                f"{have}; this engine asks for {want}", key="megatron.tensor_parallel_size"
            )
        return CreatedGroups(default_group=created_default, model_parallel=False)
    tp, ep = want
    pp = settings.pipeline_parallel_size
    world = dist.get_world_size()
    if world % tp:
        raise ConfigError(f"megatron.tensor_parallel_size={tp} does not divide the world size {world}",
                          key="megatron.tensor_parallel_size")
    if world % (tp * pp):
        raise ConfigError(f"megatron.tensor_parallel_size={tp} x pipeline_parallel_size={pp} does not divide the "
                          f"world size {world}", key="megatron.pipeline_parallel_size")
    replicas = world // (tp * ep) if world % (tp * ep) == 0 else 0
    if ep > 1 and replicas != 1:
        # the EP ranks of a replica run the same samples (their expert gradients are divided by
        # ep); megatron's data-parallel group would mix them with the replicas that split them
        raise ConfigError(f"megatron.expert_parallel_size={ep} on {world} ranks (tensor parallel {tp}): expert "
                          f"parallelism beside data parallelism (cluster.trainer.dp > 1) is not supported; run "
                          f"tp * ep ranks", key="cluster.trainer.dp")
    # pipeline size 1 even when pipelined: the stages are run by rlcore_megatron.pipeline, which
    # builds its own pipeline and data-parallel groups over megatron's tensor-parallel ones
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=ep)
    if pp > 1:
        from rlcore_megatron.pipeline import pipeline_groups

        pipeline_groups(tp, pp)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
            tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)
    return CreatedGroups(default_group=created_default, model_parallel=True)


def release_parallel(created: CreatedGroups) -> None:
    """Undo :func:`init_parallel`, last created first: forget the pipeline groups and megatron-core's
    parallel state (their process groups stay registered with torch.distributed, whose
    ``destroy_process_group()`` shuts every group down), then destroy the default group if it
    was created here. Whoever created the default group (the launcher's rank process, or the
    user) destroys it, and with it every subgroup, before the process exits: a group still held
    at interpreter shutdown can end the process in a native abort."""
    if created.model_parallel:
        from megatron.core import parallel_state as ps

        from rlcore_megatron.pipeline import forget_pipeline_groups

        forget_pipeline_groups()
        ps.destroy_model_parallel()
    if created.default_group and dist.is_initialized():
        dist.destroy_process_group()


def padded_vocab_size(vocab: int, multiple: int, tp: int) -> int:
    """The embedding/LM-head rows: ``vocab`` rounded up to a multiple of ``multiple * tp``."""
    step = max(1, multiple) * tp
    return (vocab + step - 1) // step * step


def transformer_config(sp: ModelSpec, s: MegatronSettings, par: Parallel, device: torch.device,
                       dtype: torch.dtype, mtp_layers: int) -> Any:
    """megatron-core's ``TransformerConfig`` for the model (with ``mtp_layers`` MTP layers)."""
    import torch.nn.functional as F

    required: dict[str, Any] = dict(
        num_layers=sp.num_layers,
        hidden_size=sp.hidden_size,
        num_attention_heads=sp.num_heads,
        num_query_groups=sp.num_kv_heads,
        kv_channels=sp.head_dim,
        ffn_hidden_size=sp.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=sp.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=sp.qkv_bias,
        qk_layernorm=sp.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=par.tp_size,
        expert_model_parallel_size=par.ep_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=s.sequence_parallel,
    )
    optional: dict[str, Any] = {}
    if sp.is_moe:
        required.update(
            num_moe_experts=sp.num_experts,
            moe_router_topk=sp.topk,
            moe_ffn_hidden_size=sp.moe_ffn_hidden_size,
            moe_router_pre_softmax=sp.router_pre_softmax,
            moe_layer_freq=[int(m) for m in sp.moe_layers],
            moe_router_load_balancing_type="aux_loss" if s.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=float(s.moe_aux_loss_coeff),
            moe_token_dispatcher_type=s.token_dispatcher,
            moe_grouped_gemm=False,
        )
        if sp.shared_expert_size:
            required["moe_shared_expert_intermediate_size"] = sp.shared_expert_size
            required["moe_shared_expert_gate"] = sp.shared_expert_gate
        # the fused router skips replay silently (see routers.py); replay's hook point on ≥0.16
        optional.update(moe_router_fusion=False, moe_enable_routing_replay=True, moe_permute_fusion=False)
    if mtp_layers:
        required["mtp_num_layers"] = mtp_layers
        # 0.12.1 crashes when it is unset; unused: only the MTP block's config gets it, and
        # megatron's own MTP loss never runs (compat.refuse_native_mtp_loss)
        required["mtp_loss_scaling_factor"] = 0.1
    return compat.transformer_config(required, optional)


@dataclass
class BuiltModel:
    """The decoder's config, the ``GPTModel`` and the MTP block beside it (None without MTP), and
    the kernel of its attention on the THD path (:func:`.varlen_attention.thd_backend`; None on
    the padded path)."""

    config: Any
    model: Any
    mtp: Any
    thd_backend: str | None = None


def build_model(spec: ModelSpec, settings: MegatronSettings, par: Parallel, padded_vocab: int,
                attention_path: str, device: torch.device, dtype: torch.dtype, *, pre_process: bool = True,
                post_process: bool = True) -> BuiltModel:
    """The ``GPTModel`` (layer specs: TE's on the THD path where Transformer Engine runs; else
    local, with :class:`.varlen_attention.VarlenDotProductAttention` on the THD path) and, when the HF config
    has MTP layers, a ``MultiTokenPredictionBlock`` held beside it, on ``device`` in ``dtype``;
    weights uninitialised (the engine loads them). A pipeline chunk (:mod:`.pipeline`): ``spec``
    with the chunk's layer count, ``pre_process`` (the embedding) only in the first chunk,
    ``post_process`` (final norm, output layer) only in the last."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    config = transformer_config(spec, settings, par, device, dtype, mtp_layers=0)
    use_te = attention_path == "thd" and uses_transformer_engine(device)
    block_spec = compat.call_with_supported(specs.get_gpt_decoder_block_spec, config, use_transformer_engine=use_te)
    thd_backend = None
    if attention_path == "thd":
        from rlcore_megatron.varlen_attention import thd_backend as backend_of
        from rlcore_megatron.varlen_attention import with_varlen_core_attention

        if not use_te:
            block_spec = with_varlen_core_attention(block_spec)
        thd_backend = backend_of(use_te, device, dtype)
    model = compat.call_with_supported(
        GPTModel,
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=padded_vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
    )
    mtp = None
    if spec.mtp_layers:
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

        mtp_config = transformer_config(spec, settings, par, device, dtype, mtp_layers=spec.mtp_layers)
        mtp_spec = compat.call_with_supported(specs.get_gpt_mtp_block_spec, mtp_config, block_spec,
                                              use_transformer_engine=use_te)
        # the model's process groups (0.19+ builds them explicitly; without them the MTP
        # layer's MoE would see no expert-parallel group and hold every expert on every rank)
        mtp = compat.call_with_supported(MultiTokenPredictionBlock, config=mtp_config, spec=mtp_spec,
                                         pg_collection=getattr(model, "pg_collection", None))
    compat.refuse_native_mtp_loss(model, mtp)
    model.to(device=device, dtype=dtype)
    if mtp is not None:
        mtp.to(device=device, dtype=dtype)
    return BuiltModel(config, model, mtp, thd_backend)


def router_sites(model: Any, mtp: Any, spec: ModelSpec) -> list[RouterSite]:
    """Every ``TopKRouter`` of the decoder's MoE layers, then of the MTP layers, in route order;
    an error when megatron built MoE layers other than the HF config's."""
    if not spec.is_moe:
        return []
    from megatron.core.transformer.moe.router import TopKRouter

    sites = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if isinstance(router, TopKRouter):
            sites.append(RouterSite(router, int(layer.layer_number) - 1, len(sites), False,
                                    spec.num_experts, spec.topk))
    if mtp is not None:
        for d, mtp_layer in enumerate(mtp.layers):
            router = getattr(getattr(compat.mtp_inner_layer(mtp_layer), "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                sites.append(RouterSite(router, spec.num_layers + d, len(sites), True,
                                        spec.num_experts, spec.topk))
    decoder_layers = [s.layer for s in sites if not s.is_mtp]
    if tuple(decoder_layers) != spec.moe_layer_indices:
        raise RLCoreError(
            f"megatron built MoE routers in layers {decoder_layers}, the HF config has MoE layers "
            f"{list(spec.moe_layer_indices)}"
        )
    return sites
