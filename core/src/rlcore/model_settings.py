"""Config checks of ``engine.model`` that need nothing but the document: the tiny model's shapes
(a model that cannot be built) and the dtype, kept apart from :mod:`rlcore.config` as
:mod:`rlcore.cluster_settings` is. What needs the disk, the tokenizer or the machine (the model
directory, the vocabulary, memory) is :mod:`rlcore.preflight`'s."""

from __future__ import annotations

from typing import Any

from rlcore.errors import ConfigError

#: bytes per parameter of the dtypes ``engine.model.dtype`` may name (the engines do getattr(torch, dtype))
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


def check_model(cfg: Any) -> None:
    """Refuse an ``engine.model`` no engine can build, naming the key."""
    model = cfg.engine.model
    if str(model.dtype) not in DTYPE_BYTES:
        raise ConfigError(f"engine.model.dtype={model.dtype!r} is not a dtype the engines train in; choose one of: "
                          f"float32, bfloat16, float16, float64", key="engine.model.dtype")
    if not model.path:
        check_tiny(model.tiny, str(cfg.engine.name))


def check_tiny(t: Any, engine: str) -> None:
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
    if t.mtp_layers and t.arch != "qwen2" and engine == "hf":
        raise ConfigError(f"{p}mtp_layers={t.mtp_layers} needs {p}arch 'qwen2' on the hf engine (its MTP layers "
                          f"are MiMo's, over a Qwen2 model), got {t.arch!r}", key=f"{p}mtp_layers")
