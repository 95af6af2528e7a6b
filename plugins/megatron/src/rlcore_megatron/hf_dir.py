"""HF model directories: reading one (:class:`HFSource`, also from a transformers model in memory)
and writing one (:func:`write_hf_dir`: config, tokenizer, safetensors shards with an index)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlcore.engines import mimo_layout
from rlcore.errors import ConfigError

from rlcore_megatron.weights import fresh_mtp_layout


@dataclass
class HFSource:
    """An HF model: its config, tokenizer, and checkpoint tensors by name (read lazily)."""

    config: Any
    tokenizer: Any
    names: set[str]
    get: Callable[[str], torch.Tensor]

    @classmethod
    def from_dir(cls, path: str | Path) -> HFSource:
        from safetensors import safe_open
        from transformers import AutoConfig, AutoTokenizer

        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors files in {path}", key="engine.model.path")
        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    where[k] = f

        def get(name: str) -> torch.Tensor:
            with safe_open(str(where[name]), framework="pt") as sf:
                return sf.get_tensor(name)

        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except Exception:  # noqa: BLE001 - a directory without a tokenizer still has a model
            tok = None
        return cls(AutoConfig.from_pretrained(str(path)), tok, set(where), get)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, init_std: float = 0.02, seed: int = 0) -> HFSource:
        """A transformers model in memory. When the config asks for ``num_nextn_predict_layers``
        and the model has no MTP tensors (a plain transformers model builds none), each MTP
        layer is created here, in the layout :func:`.weights.fresh_mtp_layout` picks: the last
        decoder layer's tensors under the MTP layer's prefix plus its norms (ones) and input
        projection (MiMo: ``model.mtp_layers.{d}.`` with ``token_layernorm`` /
        ``hidden_layernorm`` / ``final_layernorm`` / ``input_proj``; DeepSeek-V3:
        ``model.layers.{L + d}.`` with ``enorm`` / ``hnorm`` / ``shared_head.norm`` /
        ``eh_proj``); matrices ~ N(0, init_std) from ``seed``, norms 1, biases 0."""
        from rlcore.engines.hf_names import checkpoint_tensors

        tensors = {n: t.detach() for n, t in checkpoint_tensors(model)}
        if getattr(model.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        tensors.update(_fresh_mtp_tensors(model.config, tensors, init_std, seed))
        return cls(model.config, tokenizer, set(tensors), tensors.__getitem__)


def tiny_source(tiny: Any, tokenizer: Any, dtype: str = "float32") -> HFSource:
    """The tiny model rlcore creates locally (``engine.model.tiny``), with its MTP layers: core
    builds them itself over Qwen2 (MiMo, :mod:`rlcore.engines.mimo`); for the MoE archs it only
    declares them (``num_nextn_predict_layers``) and :meth:`HFSource.from_model` creates them."""
    from rlcore.engines.tiny import make_tiny_model

    model = make_tiny_model(tiny, tokenizer, dtype)
    return HFSource.from_model(model, tokenizer, init_std=float(tiny.init_std), seed=int(tiny.seed))


def _fresh_mtp_tensors(cfg: Any, tensors: dict[str, torch.Tensor], init_std: float, seed: int) -> dict[str, torch.Tensor]:
    depth = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    layers = int(cfg.num_hidden_layers)
    if not depth or any(n.startswith((f"model.layers.{layers}.", mimo_layout.PREFIX)) for n in tensors):
        return {}
    hidden = int(cfg.hidden_size)
    last = f"model.layers.{layers - 1}."
    gen = torch.Generator().manual_seed(seed + 7919)
    dtype = tensors["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    mimo = fresh_mtp_layout(str(getattr(cfg, "model_type", ""))) == "mimo"
    token_norm, hidden_norm, input_proj, final_norm = mimo_layout.OWN_TENSORS
    norms, proj = ((token_norm, hidden_norm, final_norm), input_proj) if mimo else (
        ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"), "eh_proj.weight")
    for d in range(depth):
        prefix = mimo_layout.layer_prefix(d) if mimo else f"model.layers.{layers + d}."
        shapes = {prefix + n[len(last):]: tuple(t.shape) for n, t in sorted(tensors.items()) if n.startswith(last)}
        shapes.update({prefix + n: (hidden,) for n in norms})
        shapes[prefix + proj] = (hidden, 2 * hidden)
        for name, shape in sorted(shapes.items()):
            if len(shape) >= 2:
                out[name] = (torch.randn(shape, generator=gen) * init_std).to(dtype)
            elif name.endswith(".bias"):
                out[name] = torch.zeros(shape, dtype=dtype)
            else:
                out[name] = torch.ones(shape, dtype=dtype)
    return out


def export_config(config: Any, mtp_layers: int, mtp_layout: str) -> Any:
    """The config written beside exported weights, saying what the weights hold:

    * MTP layers exported in MiMo's layout: ``num_nextn_predict_layers`` and, for a Qwen2 model
      (the one MiMo's serving classes build), ``architectures: [MiMoForCausalLM]``, so vLLM
      finds both the model and its MTP draft (``speculative_config={"method": "mtp"}``);
    * MTP layers in DeepSeek-V3's layout: the config as it came;
    * no MTP layers exported (``megatron.export_mtp: false``): no ``num_nextn_predict_layers``
      and no MiMo architecture — a config that promised MTP layers the weights lack would make
      a loader build (or refuse) layers that are not there.
    """
    import copy

    if mtp_layers and mtp_layout != "mimo":
        return config
    out = copy.deepcopy(config)
    if mtp_layers:
        setattr(out, mimo_layout.NUM_LAYERS_KEY, int(mtp_layers))
        if getattr(out, "model_type", None) == "qwen2":
            out.architectures = [mimo_layout.ARCHITECTURE]
        return out
    if hasattr(out, mimo_layout.NUM_LAYERS_KEY):
        delattr(out, mimo_layout.NUM_LAYERS_KEY)
    if list(getattr(out, "architectures", None) or []) == [mimo_layout.ARCHITECTURE]:
        out.architectures = ["Qwen2ForCausalLM"]
    return out


def write_hf_dir(tensors: Iterable[tuple[str, torch.Tensor]], path: str | Path, config: Any, tokenizer: Any,
                 *, writer: bool = True, shard_bytes: int = 2 << 30) -> None:
    """Write HF-named ``tensors`` as safetensors shards of at most ``shard_bytes`` (with an index
    when there are several), ``config`` and ``tokenizer`` (if any) into ``path``. Only the
    ``writer`` touches the disk; the others still consume ``tensors`` (a stream of collectives)."""
    from safetensors.torch import save_file

    path = Path(path)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("model*.safetensors"):
            old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    files: list[tuple[str, list[str]]] = []

    def flush() -> None:
        nonlocal size
        if shards[-1]:
            name = f"model-{len(files) + 1:05d}.safetensors"
            if writer:
                save_file(shards[-1], str(path / name), metadata={"format": "pt"})
            files.append((name, list(shards[-1])))
            shards[-1] = {}
            size = 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            flush()
        shards[-1][name] = t.detach().to("cpu").contiguous().clone()
        size += nbytes
    flush()
    if not writer:
        return
    if len(files) == 1:
        (path / files[0][0]).rename(path / "model.safetensors")
    else:
        index = {"metadata": {}, "weight_map": {n: f for f, names in files for n in names}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))

