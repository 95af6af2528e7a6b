"""The ``hf`` training engine: any transformers causal LM, CPU or GPU.

The body forward returns final hidden states for a :class:`~rlcore.batch.PackedBatch`; the head
is the selected forward_fn's job. Two attention paths (``engine.attention``;
:attr:`HFEngine.attention_path` says which ran), both returning hidden states on the packed axis,
so callers only ever see THD:

* ``padded``: the sequences run as a right-padded ``[B, L_max]`` batch with an attention mask.
* ``packed``: the real tokens run as one ``[1, T]`` row, positions restarting per sequence, and
  each attention layer attends within its own sequence only (``cu_seqlens``) through an attention
  function registered with transformers' ``AttentionInterface`` (:mod:`rlcore.engines.varlen`:
  torch's ``varlen_attn`` on CUDA in bf16/fp16, SDPA per sequence elsewhere). No padding is
  computed. ``auto`` picks it where torch's varlen kernel runs. MTP models (below) use ``padded``.

MoE routers (transformers' ``*TopKRouter`` modules) get a forward hook — PyTorch's public
API, no monkeypatching — that consults the ``router_hook`` chain and records the chosen experts
(:mod:`rlcore.engines.hf_routers`, shared with the ``local`` rollout backend).

A MiMo model (:mod:`rlcore.engines.mimo`: Qwen2 + ``model.mtp_layers``) also returns MTP hidden
states when asked (``mtp_hidden=True``): one ``[T, H]`` per depth in packed order, computed in the
same right-padded rows, so depth ``k`` at a position reads token ``t + k`` of its own sequence
only (see :mod:`rlcore.engines.mimo_layout` for the semantics). Any other model refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlcore.batch import PackedBatch
from rlcore.engines.hf_names import checkpoint_tensors
from rlcore.engines.hf_routers import RouterSeam
from rlcore.engines.mimo import has_mtp_layers, load_causal_lm
from rlcore.engines.varlen import TORCH_VARLEN, varlen_attention, varlen_backend
from rlcore.errors import CheckpointError, ConfigError, MissingCapabilityError, RLCoreError
from rlcore.lora import ADAPTER_DIR, Adapters, adapter_state, load_adapter_state
from rlcore.model_settings import ATTENTION_CHOICES
from rlcore.platforms import run_device
from rlcore.types import (
    Cap,
    EngineOutput,
    HeadWeight,
    MicroBatchContext,
    ModelInfo,
    RouterCall,
    VocabShard,
    value_head,
)

HF_ENGINE_CAPABILITIES = frozenset({Cap.MOE, Cap.MTP, Cap.ROUTER_HOOK, Cap.RECORD_ROUTES, Cap.VALUE_MODEL, Cap.LORA})

#: the name the packed attention function (and its no-mask function) is registered under in transformers
PACKED_ATTENTION = "rlcore_packed"


def _packed_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function contract (``query`` ``[1, Hq, T, D]``, returns
    ``([1, T, Hq, D], None)``) over the packed row; ``cu_seq_lens_q``/``max_length_q`` come
    from the model's forward kwargs."""
    if dropout:
        raise RLCoreError(f"engine.attention=packed: the model asks attention dropout {dropout}, which the packed "
                          f"path does not apply; use engine.attention=padded")
    if kwargs.get("sliding_window") is not None:
        raise RLCoreError("engine.attention=packed: sliding-window attention is not supported; use "
                          "engine.attention=padded")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = varlen_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scale=scaling)
    return out[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the sequences' boundaries travel as cu_seqlens, not as a mask


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def choose_attention_path(attention: str, model: Any, device: torch.device) -> str:
    """``padded`` or ``packed`` for ``engine.attention`` (``auto``: packed where torch's varlen
    kernel runs, i.e. CUDA in bf16/fp16, and the model has no MTP layers)."""
    if attention not in ATTENTION_CHOICES:
        raise ConfigError(f"engine.attention={attention!r}: choose one of: {', '.join(ATTENTION_CHOICES)}",
                          key="engine.attention")
    mtp = has_mtp_layers(model)
    if attention == "packed" and mtp:
        raise ConfigError("engine.attention=packed: the model's MTP layers run over padded rows; use "
                          "engine.attention=padded or auto", key="engine.attention")
    if attention == "auto":
        dtype = next(model.parameters()).dtype
        return "packed" if not mtp and varlen_backend(device, dtype) == TORCH_VARLEN else "padded"
    return attention


class HFEngine:
    """The built-in ``hf`` engine."""

    capabilities = HF_ENGINE_CAPABILITIES

    def __init__(self, model: Any, tokenizer: Any, device: str | torch.device = "cpu", attention: str = "padded",
                 lora: Any = None):
        self.model = model.to(device)
        #: ``lora.rank`` > 0: the model's linear layers wrapped with LoRA adapters (rlcore.lora), the base frozen
        self.adapters: Adapters | None = Adapters(self.model, lora) if lora is not None and int(lora.rank) > 0 else None
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.attention_path = choose_attention_path(attention, self.model, self.device)
        if self.attention_path == "packed":
            _register_packed_attention()
        self.seam = RouterSeam(self.model)
        cfg = model.config
        self.info = ModelInfo(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            num_hidden_layers=int(cfg.num_hidden_layers),
            eos_token_id=tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id,
            pad_token_id=(tokenizer.pad_token_id if tokenizer is not None else cfg.pad_token_id) or 0,
            route_layout=self.seam.layout,
            mtp_layers=has_mtp_layers(self.model),
            architecture=str(cfg.model_type),
        )
        self.optimizer: torch.optim.Optimizer | None = None

    # ----------------------------------------------------------------- construction ------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                        attention: str = "padded", lora: Any = None) -> HFEngine:
        from transformers import AutoTokenizer

        model = load_causal_lm(str(path), getattr(torch, dtype))
        tok = AutoTokenizer.from_pretrained(str(path))
        return cls(model, tok, device, attention, lora)

    # ----------------------------------------------------------------- forward -----------

    def forward(
        self,
        batch: PackedBatch,
        *,
        record_routes: bool = False,
        router: Callable[[RouterCall], Any] | None = None,
        micro_batch: MicroBatchContext | None = None,
        mtp_hidden: bool = False,
        mtp_detach_trunk: bool = False,
    ) -> EngineOutput:
        """``mtp_hidden``: also return the MTP depths' hidden states; ``mtp_detach_trunk``: cut the
        MTP layers' inputs from the trunk (its hidden state and the shared embedding lookup)."""
        if mtp_hidden and not self.info.mtp_layers:
            raise MissingCapabilityError(
                f"engine 'hf': the model ({self.info.architecture}) has no MTP layers, but MTP hidden states were "
                f"requested (mtp_hidden=True); create it with engine.model.tiny.mtp_layers >= 1 (arch qwen2) or "
                f"load a MiMo directory (config.json num_nextn_predict_layers >= 1)"
            )
        lay = batch.layout
        dev = self.device
        T = batch.num_tokens
        B = lay.num_seqs
        lens = lay.seq_lens
        Lmax = lay.max_seqlen
        seq = lay.seq_index()
        off = lay.offsets()
        valid = off < lens[seq]
        packed_idx = valid.nonzero().squeeze(1).to(dev)
        use_packed = self.attention_path == "packed"  # never with MTP hidden states (choose_attention_path)
        # the model's rows: [B, Lmax] right-padded, or the real tokens in one [1, T_real] row
        rows_shape = (1, packed_idx.numel()) if use_packed else (B, Lmax)
        num_rows = rows_shape[0] * rows_shape[1]
        flat_idx = torch.arange(num_rows, device=dev) if use_packed else (seq * Lmax + off)[valid].to(dev)

        ids = torch.full((num_rows,), batch.pad_id, dtype=torch.long, device=dev)
        ids[flat_idx] = batch.input_ids.to(dev)[packed_idx]
        attn = torch.zeros(num_rows, dtype=torch.long, device=dev)
        attn[flat_idx] = 1
        pos = off[valid].to(dev)[None] if use_packed else torch.arange(Lmax, device=dev).expand(B, Lmax)

        def to_rows(x: torch.Tensor) -> torch.Tensor:
            rows = torch.full((num_rows, *x.shape[1:]), -1, dtype=x.dtype, device=x.device)
            rows[flat_idx.to(x.device)] = x[packed_idx.to(x.device)]
            return rows

        def from_rows(x: torch.Tensor) -> torch.Tensor:
            fill = -1 if not x.dtype.is_floating_point else 0
            out = torch.full((T, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
            out[packed_idx.to(x.device)] = x[flat_idx.to(x.device)]
            return out

        def packed(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(num_rows, -1)
            return x.new_zeros(T, x.shape[1]).index_copy(0, packed_idx, x.index_select(0, flat_idx))

        mtp_out = None
        with self.seam.forward_pass(num_tokens=T, record=record_routes, dispatch=router, micro_batch=micro_batch,
                                    to_rows=to_rows, from_rows=from_rows):
            if mtp_hidden:
                with self.model.trunk_prenorm_hidden() as trunk:
                    out = self.model.base_model(input_ids=ids.view(B, Lmax), attention_mask=attn.view(B, Lmax),
                                                position_ids=pos, use_cache=False)
                mtp_out = [packed(h) for h in self.model.mtp_forward(
                    ids.view(B, Lmax), attn.view(B, Lmax), trunk.value, detach_trunk=mtp_detach_trunk)]
            elif use_packed:
                out = self._packed_forward(ids.view(rows_shape), pos, lay.seq_lens, Lmax)
            else:
                out = self.model.base_model(input_ids=ids.view(B, Lmax), attention_mask=attn.view(B, Lmax),
                                            position_ids=pos, use_cache=False)
            routes = self.seam.collect() if record_routes else None
        hidden = packed(out.last_hidden_state)
        if routes is not None:
            routes = from_rows(routes)
        return EngineOutput(hidden=hidden, mtp_hidden=mtp_out, routes=routes)

    def _packed_forward(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, max_len: int) -> Any:
        """The trunk over one packed row, the packed attention function in place of the model's
        own for this call only (the model's config names its attention implementation)."""
        cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=self.device)
        cu[1:] = lens.cumsum(0).to(device=self.device, dtype=torch.int32)
        config = self.model.config
        own = config._attn_implementation
        config._attn_implementation = PACKED_ATTENTION
        try:
            return self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu,
                                         cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        finally:
            config._attn_implementation = own

    def head(self) -> HeadWeight:
        w = self.model.get_output_embeddings().weight
        return HeadWeight(weight=w, vocab=VocabShard.full(self.info.vocab_size, rows=w.shape[0]))

    # ----------------------------------------------------------------- training ----------

    def parameters(self) -> Iterator[torch.Tensor]:
        return self.model.parameters()

    def train(self, mode: bool = True) -> HFEngine:
        self.model.train(mode)
        return self

    def setup_optimizer(self, training: Any) -> None:
        betas = tuple(float(b) for b in training.betas)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=float(training.lr), betas=betas, weight_decay=float(training.weight_decay),
        )

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        self.optimizer.step()
        return float(norm)

    def make_reference(self) -> HFEngine | BaseWithoutAdapters:
        """A frozen copy of the current policy (for the KL penalty); with LoRA, the policy's own model
        with its adapters off (the base: no copy)."""
        if self.adapters is not None:
            return BaseWithoutAdapters(self)
        ref = HFEngine(copy.deepcopy(self.model), self.tokenizer, self.device, self.attention_path)
        ref.model.eval()
        for p in ref.model.parameters():
            p.requires_grad_(False)
        return ref

    def make_value_model(self, seed: int = 0) -> HFValueModel:
        """A critic for PPO (``Cap.VALUE_MODEL``): a copy of the current policy's trunk with a
        scalar head (:class:`HFValueModel`)."""
        return HFValueModel(self, seed)

    # ----------------------------------------------------------------- weights -----------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its checkpoint name (with LoRA: merged, ``W + scaling · B @ A``)."""
        tensors = self.adapters.merged() if self.adapters is not None else checkpoint_tensors(self.model)
        for name, t in tensors:
            yield name, t.detach()

    def export_adapter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters' tensors in PEFT's saved names (what an adapter push carries)."""
        if self.adapters is None:
            raise MissingCapabilityError("engine 'hf': export_adapter() without LoRA adapters (lora.rank is 0)")
        for name, t in self.adapters.tensors():
            yield name, t.detach()

    def save_hf(self, path: str | Path) -> None:
        """An HF directory; with LoRA, the base model and the adapters in ``adapter/`` (rlcore.lora)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.adapters is not None:
            self.model.save_pretrained(path, state_dict=self.adapters.base_state())
            self.adapters.save(path / ADAPTER_DIR)
        else:
            self.model.save_pretrained(path)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)

    def save_merged(self, path: str | Path) -> None:
        """With LoRA: the merged model as a plain HF directory (``lora.export_merged``; a rollout
        that takes full weights starts from it)."""
        if self.adapters is None:
            return self.save_hf(path)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=self.adapters.merged_state())
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return None

    def state_dict(self) -> dict[str, Any]:
        """The model's weights (with LoRA: the adapters only, the base is rebuilt from
        ``engine.model``) and the optimizer's state."""
        weights = adapter_state(self.adapters) if self.adapters is not None else {"model": self.model.state_dict()}
        return {**weights, "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.adapters is not None:
            load_adapter_state(self.adapters, state)
        elif "model" not in state and "adapter" in state:
            raise CheckpointError("the checkpoint holds LoRA adapters (trained with lora.rank > 0), but this run "
                                  "fine-tunes the whole model: resume it with the checkpoint's lora.* settings")
        else:
            self.model.load_state_dict(state["model"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


class BaseWithoutAdapters:
    """A LoRA policy's KL reference: the policy's own model with its adapters off, i.e. the frozen
    base it started from (no second copy of the model). Everything but the forward is the policy's."""

    def __init__(self, policy: HFEngine):
        self.policy = policy
        self.info = policy.info
        self.device = policy.device
        self.tokenizer = policy.tokenizer
        self.capabilities = policy.capabilities

    def forward(self, batch: PackedBatch, **kwargs: Any) -> EngineOutput:
        with torch.no_grad(), self.policy.adapters.disabled():
            return self.policy.forward(batch, **kwargs)

    def head(self) -> HeadWeight:
        return self.policy.head()

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(())  # the policy's own: nothing of its own to broadcast or train

    def train(self, mode: bool = True) -> BaseWithoutAdapters:
        return self


class HFValueModel:
    """A separate critic (:class:`rlcore.types.value.ValueModel`): a deep copy of the policy
    model, whose trunk (``base_model``) runs through :meth:`HFEngine.forward` (same packing,
    same MoE seam, no router_hook chain), and a ``Linear(H, 1)`` head in fp32 on its final hidden
    states. The head starts as OpenRLHF's value head (normal, std ``1/(H+1)``; bias 0), drawn
    from its own generator (``seed``) so the policy's random stream is untouched. The copy's
    LM head is never used nor trained (with untied embeddings it costs its memory, no optimizer
    state)."""

    def __init__(self, policy: HFEngine, seed: int = 0):
        self.body = HFEngine(copy.deepcopy(policy.model), policy.tokenizer, policy.device, policy.attention_path)
        self.head = value_head(self.body.info.hidden_size, seed, policy.device)
        self.optimizer: torch.optim.Optimizer | None = None

    def values(self, batch: PackedBatch) -> torch.Tensor:
        return self.head(self.body.forward(batch).hidden.float()).squeeze(-1)

    def parameters(self) -> Iterator[torch.Tensor]:
        yield from self.body.model.base_model.parameters()
        yield from self.head.parameters()

    def train(self, mode: bool = True) -> HFValueModel:
        self.body.model.train(mode)
        self.head.train(mode)
        return self

    def setup_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=float(lr),
                                           betas=tuple(float(b) for b in betas), weight_decay=float(weight_decay))

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        self.optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {"trunk": self.body.model.base_model.state_dict(), "head": self.head.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.body.model.base_model.load_state_dict(state["trunk"])
        self.head.load_state_dict(state["head"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def build_hf_engine(ctx: Any) -> HFEngine:
    """Factory of the ``hf`` engine: from ``engine.model.path`` or a tiny model for the task."""
    from rlcore.engines.tiny import check_hf_mtp, make_tiny_model, make_tokenizer

    ecfg = ctx.config.engine
    device = run_device(ctx)
    lora = ctx.config.lora if int(ctx.config.lora.rank) > 0 else None
    if ecfg.model.path:
        return HFEngine.from_pretrained(ecfg.model.path, device=device, dtype=ecfg.model.dtype,
                                        attention=ecfg.attention, lora=lora)
    task = ctx.extras.get("task")
    words = task.vocab if task is not None else [str(i) for i in range(10)]
    tok = make_tokenizer(words, chat_template=getattr(task, "chat_template", None))  # data.train_files: a template
    check_hf_mtp(ecfg.model.tiny)
    model = make_tiny_model(ecfg.model.tiny, tok, ecfg.model.dtype)
    return HFEngine(model, tok, device, ecfg.attention, lora)
