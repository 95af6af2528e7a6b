"""Tiny models and tokenizers created locally (no model hub): the embedded default and tests.

``make_tokenizer`` builds a word-level tokenizer over a task's vocabulary; ``make_tiny_model``
builds a randomly initialised transformers causal LM (dense Qwen2, Qwen2-MoE with a shared
expert, or Qwen3-MoE) whose vocabulary is the tokenizer's. Head dim defaults to 64 (vLLM's CPU
attention rejects 16). ``mtp_layers > 0`` with ``arch: qwen2`` builds MiMo: the Qwen2 model plus
MTP layers in MiMo's checkpoint layout (:mod:`rlcore.engines.mimo`); for the MoE archs it only
sets ``num_nextn_predict_layers`` (transformers builds no MTP layers; the megatron engine creates
its own, the hf engine refuses: :func:`check_hf_mtp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.engines.mimo_layout import ARCHITECTURE, NUM_LAYERS_KEY

__all__ = ["check_hf_mtp", "init_tiny_weights", "make_tiny_model", "make_tokenizer", "save_tiny", "tiny_config"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
SUPPORTED_ARCHS = ("qwen2", "qwen2_moe", "qwen3_moe")


def make_tokenizer(words: Sequence[str], chat_template: str | None = None) -> Any:
    """A word-level fast tokenizer: ``<pad>``=0, ``<eos>``=1, ``<unk>``=2, then ``words``;
    ``chat_template``: a jinja chat template set as its ``chat_template`` (prompts from dataset
    files, :data:`rlcore.datasets.TINY_CHAT_TEMPLATE`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for w in (*SPECIAL_TOKENS, *words):
        if w not in vocab:
            vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def tiny_config(tiny: Any, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """A transformers config for ``tiny.arch`` (see :class:`rlcore.config.TinyModelConfig`)."""
    from transformers import AutoConfig

    arch = tiny.arch
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"engine.model.tiny.arch: {arch!r} is not one of {', '.join(SUPPORTED_ARCHS)}")
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=tiny.tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    if arch in ("qwen2_moe", "qwen3_moe"):
        kw.update(
            num_experts=tiny.num_experts,
            num_experts_per_tok=tiny.topk,
            moe_intermediate_size=tiny.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
    if arch == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = tiny.intermediate_size
    if tiny.mtp_layers:
        # MiMo's (DeepSeek-V3's) name; vLLM and the megatron engine read it
        kw[NUM_LAYERS_KEY] = tiny.mtp_layers
        if arch == "qwen2":
            kw["architectures"] = [ARCHITECTURE]
    return AutoConfig.for_model(arch, **kw)


def check_hf_mtp(tiny: Any) -> None:
    """The hf engine's MTP layers are MiMo's, over a dense Qwen2 model."""
    if tiny.mtp_layers and tiny.arch != "qwen2":
        raise ValueError(
            f"engine.model.tiny.mtp_layers={tiny.mtp_layers} needs engine.model.tiny.arch 'qwen2' on the hf engine "
            f"(its MTP layers are MiMo's, over a Qwen2 model), got {tiny.arch!r}"
        )


def init_tiny_weights(model: Any, std: float, seed: int) -> None:
    """Re-initialise every matrix with N(0, std) (norms stay at 1) so logits are not flat."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def make_tiny_model(tiny: Any, tokenizer: Any, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(
        tiny,
        vocab_size=tiny.vocab_size or len(tokenizer),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    torch_dtype = getattr(torch, dtype)
    if tiny.mtp_layers and tiny.arch == "qwen2":
        from rlcore.engines.mimo import MiMoForCausalLM

        model = MiMoForCausalLM._from_config(cfg, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    init_tiny_weights(model, tiny.init_std, tiny.seed)
    return model


def save_tiny(path: str | Path, tiny: Any, words: Sequence[str], dtype: str = "float32") -> Path:
    """Create a tiny model + tokenizer for ``words`` and save both as an HF directory."""
    path = Path(path)
    tok = make_tokenizer(words)
    model = make_tiny_model(tiny, tok, dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
