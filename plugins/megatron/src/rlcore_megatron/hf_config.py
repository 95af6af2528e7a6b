"""An HF ``config.json`` → the model rlcore builds in megatron-core.

Pure Python (no megatron, no torch): :func:`model_spec_from_hf` reads a transformers config and
returns a :class:`ModelSpec`, or raises :class:`~rlcore.errors.ConfigError` naming the HF field
that rlcore cannot reproduce in a megatron-core ``GPTModel`` (a model that would silently compute
something else is worse than no model).

Supported ``model_type``: ``llama``, ``qwen2``, ``qwen3`` (dense) and ``qwen2_moe``,
``qwen3_moe`` (MoE). MTP layers come from ``num_nextn_predict_layers`` (DeepSeek-V3's name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError

DENSE_TYPES = ("llama", "qwen2", "qwen3")
MOE_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to build the megatron model and map HF names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()  #: per decoder layer: True where the MLP is MoE
    #: True where the router softmax runs over all experts and the top-k weights are not
    #: renormalised (``norm_topk_prob: false``); False: softmax over the chosen top-k only.
    router_pre_softmax: bool = False
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    mtp_layers: int = 0
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def mtp_is_moe(self) -> bool:
        """megatron-core builds MTP layers from the last decoder layer's spec."""
        return self.mtp_layers > 0 and bool(self.moe_layers) and self.moe_layers[-1]


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _first_id(x: Any) -> int | None:
    if isinstance(x, (list, tuple)):
        return int(x[0]) if x else None
    return None if x is None else int(x)


def _rope_theta(cfg: Any) -> float:
    params = _get(cfg, "rope_parameters") or {}
    scaling = _get(cfg, "rope_scaling") or {}
    rope_type = (params.get("rope_type") or params.get("type") or scaling.get("rope_type")
                 or scaling.get("type") or "default")
    if rope_type != "default":
        raise ConfigError(
            f"the megatron engine supports plain RoPE only; the HF config sets rope_type={rope_type!r} "
            f"(rope_parameters/rope_scaling)", key="engine.model"
        )
    theta = params.get("rope_theta", _get(cfg, "rope_theta"))
    if theta is None:
        raise ConfigError("the HF config has no rope_theta (rope_parameters.rope_theta)", key="engine.model")
    return float(theta)


def model_spec_from_hf(cfg: Any) -> ModelSpec:
    """Translate a transformers ``PretrainedConfig`` (see module docstring)."""
    mt = str(_get(cfg, "model_type", ""))
    if mt not in SUPPORTED_TYPES:
        raise ConfigError(
            f"the megatron engine cannot build model_type {mt!r}; supported: {', '.join(SUPPORTED_TYPES)}",
            key="engine.model",
        )
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}: the megatron engine builds SwiGLU (silu) MLPs only", key="engine.model")
    if _get(cfg, "use_sliding_window", False):
        raise ConfigError("use_sliding_window=true is not supported by the megatron engine", key="engine.model")
    if _get(cfg, "mlp_bias", False):
        raise ConfigError("mlp_bias=true is not supported by the megatron engine", key="engine.model")
    if mt == "llama" and _get(cfg, "attention_bias", False):
        raise ConfigError("llama attention_bias=true (o_proj bias) is not supported by the megatron engine",
                          key="engine.model")
    if mt == "qwen3" and _get(cfg, "attention_bias", False):
        raise ConfigError("qwen3 attention_bias=true is not supported by the megatron engine", key="engine.model")
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    head_dim = _get(cfg, "head_dim") or hidden // heads
    kv_heads = int(_get(cfg, "num_key_value_heads") or heads)
    layers = int(cfg.num_hidden_layers)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}: "
                          f"megatron-core builds grouped-query attention with whole groups", key="engine.model")
    qkv_bias = mt in ("qwen2", "qwen2_moe") and bool(_get(cfg, "qkv_bias", True))
    kw: dict[str, Any] = {}
    if mt in MOE_TYPES:
        experts = int(cfg.num_experts)
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
        dense_only = set(_get(cfg, "mlp_only_layers", None) or [])
        moe_layers = tuple(
            experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers)
        )
        shared = int(_get(cfg, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
        topk = int(cfg.num_experts_per_tok)
        norm_topk = bool(_get(cfg, "norm_topk_prob", mt == "qwen3_moe"))
        if experts > 0 and not 1 <= topk <= experts:
            raise ConfigError(f"num_experts_per_tok={topk} must be in [1, num_experts={experts}]", key="engine.model")
        if experts > 0 and topk == 1 and norm_topk:
            # HF renormalises the single chosen weight to 1.0 (softmax over the top-1); megatron-core
            # refuses that router ("Please use --moe-router-pre-softmax when topk is 1": the router
            # would get no gradient), and its pre-softmax router weighs the expert by its softmax
            # probability instead, which is another model
            raise ConfigError(
                "num_experts_per_tok=1 with norm_topk_prob=true cannot be built in megatron-core: it only "
                "routes top-1 with the softmax over all experts (norm_topk_prob=false), which weighs the "
                "expert by its probability where this model weighs it by 1.0", key="engine.model"
            )
        kw.update(
            num_experts=experts,
            topk=topk,
            moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
            moe_layers=moe_layers,
            router_pre_softmax=not norm_topk,
            shared_expert_size=shared,
            shared_expert_gate=shared > 0,
        )
    else:
        kw["moe_layers"] = (False,) * layers
    return ModelSpec(
        model_type=mt,
        vocab_size=int(cfg.vocab_size),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        ffn_hidden_size=int(cfg.intermediate_size),
        norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        mtp_layers=int(_get(cfg, "num_nextn_predict_layers", 0) or 0),
        eos_token_id=_first_id(_get(cfg, "eos_token_id")),
        pad_token_id=_first_id(_get(cfg, "pad_token_id")),
        **kw,
    )
