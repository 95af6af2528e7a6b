"""Config checks of ``engine.model`` that need nothing but the document: the tiny model's shapes
(a model that cannot be built) and the dtype, kept apart from :mod:`rlcore.config` as
:mod:`rlcore.cluster_settings` is. What needs the disk, the tokenizer or the machine (the model
directory, the vocabulary, memory) is :mod:`rlcore.preflight`'s; what the selected engine must be able
to build is a capability (:data:`TINY_MTP_OVER_MOE`)."""

from __future__ import annotations

from typing import Any

from rlcore.errors import ConfigError
from rlcore.types import Cap, RequiresCapability

#: the values of ``engine.attention`` (the ``hf`` engine's attention path: :mod:`rlcore.engines.hf`)
ATTENTION_CHOICES = ("auto", "padded", "packed")

#: bytes per parameter of the dtypes ``engine.model.dtype`` may name (the engines do getattr(torch, dtype))
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


def check_model(cfg: Any) -> None:
    """Refuse an ``engine.model`` no engine can build, naming the key."""
    model = cfg.engine.model
    if str(model.dtype) not in DTYPE_BYTES:
        raise ConfigError(f"engine.model.dtype={model.dtype!r} is not a dtype the engines train in; choose one of: "
                          f"float32, bfloat16, float16, float64", key="engine.model.dtype")
    if not model.path:
        check_tiny(model.tiny)


def check_tiny(t: Any) -> None:
    """The tiny model's shapes (``engine.model.tiny``): what transformers would refuse when it builds
    it (RoPE's odd head_dim), or what would fail at the first forward (a head count that does not
    divide, topk beyond the experts)."""
    from rlcore.engines.tiny import SUPPORTED_ARCHS

    p = "engine.model.tiny."
    if t.arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"{p}arch={t.arch!r}: choose one of: {', '.join(SUPPORTED_ARCHS)}", key=f"{p}arch")
    if t.num_heads % t.num_kv_heads:
        raise ConfigError(f"{p}num_kv_heads={t.num_kv_heads}: num_heads={t.num_heads} must be a multiple of it "
                          f"(each key/value head serves a group of query heads)", key=f"{p}num_kv_heads")
    if t.head_dim % 2:
        raise ConfigError(f"{p}head_dim={t.head_dim}: must be even (RoPE rotates pairs of dimensions)",
                          key=f"{p}head_dim")
    if t.arch != "qwen2" and t.topk > t.num_experts:
        raise ConfigError(f"{p}topk={t.topk}: each token picks topk of num_experts={t.num_experts} experts",
                          key=f"{p}topk")


def _tiny_mtp_over_moe(cfg: Any) -> bool:
    tiny = cfg.engine.model.tiny
    return not cfg.engine.model.path and bool(tiny.mtp_layers) and tiny.arch != "qwen2"


#: MTP layers on the tiny MoE archs: transformers has none for them (the tiny model over qwen2 gets
#: MiMo's), so the selected engine must build its own; the built-in hf plugin declares this rule
#: (its engine lacks the capability, rlcore-megatron's has it)
TINY_MTP_OVER_MOE = RequiresCapability(
    role="engine", capability=Cap.MOE_MTP, when=_tiny_mtp_over_moe,
    reason=lambda cfg: (f"engine.model.tiny.mtp_layers={cfg.engine.model.tiny.mtp_layers} on engine.model.tiny.arch "
                        f"{cfg.engine.model.tiny.arch!r}: transformers builds MTP layers only in MiMo's layout, over "
                        f"arch 'qwen2'"),
)
