"""MiMo in torch: a transformers Qwen2 causal LM plus MTP layers in MiMo's checkpoint layout.

transformers has no MiMo class (the hub's is remote code); this one subclasses
``Qwen2ForCausalLM`` so the trunk, ``save_pretrained`` and ``from_pretrained`` are transformers'
own, and adds ``model.mtp_layers`` (see :mod:`rlcore.engines.mimo_layout` for the names, the
concat order and the semantics, taken from vLLM's loader). ``save_pretrained`` writes
``architectures: ["MiMoForCausalLM"]`` (the class name) and ``num_nextn_predict_layers`` (a
config attribute), which is what vLLM keys its MiMo and MiMo-MTP models on.

Every tensor here is ``[B, L, ...]`` right-padded rows (the HF engine's view of a packed batch),
so no row ever sees another sequence.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import Qwen2ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

from rlcore.engines import mimo_layout
from rlcore.engines.kv_cache import cache_arg

# the KV-cache keyword of the installed transformers ('cache' in 5.x, where the old one warns per call)
_LAYER_CACHE, _MASK_CACHE = cache_arg(Qwen2DecoderLayer.forward), cache_arg(create_causal_mask)


def mtp_block_config(config: Any) -> Any:
    """The config the MTP decoder blocks are built with: the trunk's, with one full-attention
    layer type per MTP layer (their attention's ``layer_idx`` indexes the draft's own KV cache)."""
    n = mimo_layout.num_layers_in(config)
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    cfg.layer_types = ["full_attention"] * n
    return cfg


class MiMoMTPLayer(Qwen2DecoderLayer):
    """One MTP layer: the Qwen2 block's tensors directly on this module (as in the checkpoint),
    plus ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` and ``final_layernorm``."""

    def __init__(self, block_config: Any, layer: int):
        super().__init__(block_config, layer)
        h, eps = block_config.hidden_size, block_config.rms_norm_eps
        self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)

    def forward(  # type: ignore[override]
        self,
        previous_hidden: torch.Tensor,
        token_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        past_key_values: Any = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        # vLLM's MiMo layer zeroes the embedding at position 0; train what it serves
        token_embeds = token_embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        x = self.input_proj(torch.cat([self.hidden_layernorm(previous_hidden), self.token_layernorm(token_embeds)], -1))
        x = Qwen2DecoderLayer.forward(
            self, x, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
            position_embeddings=position_embeddings, **{_LAYER_CACHE: past_key_values},
        )
        return self.final_layernorm(x)


class MiMoForCausalLM(Qwen2ForCausalLM):
    """Qwen2 + ``config.num_nextn_predict_layers`` MTP layers at ``model.mtp_layers``."""

    def __init__(self, config: Any):
        super().__init__(config)
        n = mimo_layout.num_layers_in(config)
        if n < 1:
            raise ValueError(f"MiMoForCausalLM needs config.{mimo_layout.NUM_LAYERS_KEY} >= 1, got {n}")
        block_cfg = mtp_block_config(config)
        self.model.mtp_layers = nn.ModuleList([MiMoMTPLayer(block_cfg, d) for d in range(n)])
        self.mtp_block_config = block_cfg
        self.post_init()

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.mtp_layers)

    def trunk_prenorm_hidden(self) -> _PreNormCapture:
        """Context manager capturing the trunk's last hidden state before ``model.norm`` (the
        depth-1 input; vLLM's MiMoModel returns exactly that tensor)."""
        return _PreNormCapture(self.model.norm)

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        trunk_hidden: torch.Tensor,
        depths: int | None = None,
        detach_trunk: bool = False,
    ) -> list[torch.Tensor]:
        """Hidden states of MTP depths ``1..depths`` (each after its ``final_layernorm``, ready for
        the shared LM head), ``[B, L, H]`` each.

        ``input_ids``/``attention_mask``: ``[B, L]`` right-padded rows (1 = real token);
        ``trunk_hidden``: the trunk's pre-norm last hidden state ``[B, L, H]``. Depth ``k`` at
        position ``t`` reads ``h^{k-1}_t`` and the embedding of token ``t + k`` of the same row
        (zero past the row's length) and predicts token ``t + k + 1``. ``detach_trunk``: the MTP
        loss reaches no trunk parameter — the trunk hidden state and every embedding lookup are
        detached (megatron-core 0.19 ``mtp_detach_heads``' input half; verl ``detach_encoder``
        detaches the embedding only)."""
        n = self.num_mtp_layers if depths is None else int(depths)
        if not 1 <= n <= self.num_mtp_layers:
            raise ValueError(f"asked for {n} MTP depths; the model has {self.num_mtp_layers} MTP layers")
        B, L = input_ids.shape
        pos = torch.arange(L, device=input_ids.device).expand(B, L)
        lens = attention_mask.long().sum(1, keepdim=True)
        h = trunk_hidden.detach() if detach_trunk else trunk_hidden
        mask = create_causal_mask(config=self.mtp_block_config, inputs_embeds=h, attention_mask=attention_mask,
                                  position_ids=pos, **{_MASK_CACHE: None})
        pos_emb = self.model.rotary_emb(h, pos)
        out: list[torch.Tensor] = []
        for k in range(1, n + 1):
            shifted = torch.zeros_like(input_ids)
            shifted[:, : L - k] = input_ids[:, k:]
            exists = (pos + k) < lens
            emb = self.model.embed_tokens(shifted)
            if detach_trunk:
                emb = emb.detach()
            emb = emb * exists.unsqueeze(-1).to(emb.dtype)
            h = self.model.mtp_layers[k - 1](h, emb, pos, mask, pos_emb)
            out.append(h)
        return out


class _PreNormCapture:
    def __init__(self, norm: nn.Module):
        self.norm = norm
        self.value: torch.Tensor | None = None
        self._handle: Any = None

    def _hook(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        self.value = args[0]

    def __enter__(self) -> _PreNormCapture:
        self._handle = self.norm.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


def has_mtp_layers(model: Any) -> int:
    """MTP layers ``model`` carries (0 for any other model)."""
    layers = getattr(getattr(model, "model", None), "mtp_layers", None)
    return len(layers) if layers is not None else 0


def load_causal_lm(path: str, dtype: torch.dtype) -> Any:
    """``from_pretrained`` for a directory: MiMo (config.json declares MTP layers) through this
    class, anything else through ``AutoModelForCausalLM``. A MiMo directory whose weights lack
    MTP tensors is an error (transformers would initialise them randomly and say little)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(path) / "config.json").read_text())
    n = mimo_layout.num_layers_in(cfg)
    if n == 0:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if cfg.get("model_type") != "qwen2":
        raise ValueError(
            f"{path}: config.json declares {mimo_layout.NUM_LAYERS_KEY}={n} with model_type "
            f"{cfg.get('model_type')!r}; rlcore builds MTP layers in MiMo's layout over Qwen2 only"
        )
    model, info = MiMoForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if mimo_layout.is_mtp_name(k)]
    if missing:
        raise ValueError(f"{path}: {len(missing)} MTP tensors missing from the checkpoint, e.g. {missing[:3]}")
    return model
