"""The ``megatron`` training engine: a megatron-core ``GPTModel`` under rlcore.

**Model.** Built from an HF config (:mod:`.hf_config`) with megatron-core's own layer specs:
Transformer Engine's when it is importable on a CUDA device, else the local (pure PyTorch) spec.
MTP layers (``num_nextn_predict_layers``) are megatron-core ``MultiTokenPredictionLayer``\\ s in a
``MultiTokenPredictionBlock`` the engine holds next to the ``GPTModel`` (not inside it), so the
model's own forward never computes megatron's MTP loss — rlcore's MTP loss is a ``postprocess``
plugin on the same head as the policy loss — and the engine runs them only when a forward asks
for MTP hidden states.

**Packed forward.** A :class:`~rlcore.batch.PackedBatch` runs one of two ways
(:attr:`MegatronEngine.attention_path` says which):

* ``thd`` (Transformer Engine present): input ``[1, T]`` with ``PackedSeqParams(qkv_format="thd")``
  built from the batch's raw and padded ``cu_seqlens``; RoPE restarts per sequence inside TE.
* ``padded`` (no TE: CI, and the GPU machine this project tests on): megatron's local attention
  rejects ``PackedSeqParams``, and megatron computes RoPE from positions ``0..s-1`` of its input,
  so each sequence becomes a row of a ``[B, L]`` batch (``L`` = the longest padded sequence),
  which restarts positions per sequence; a causal mask keeps every real token from seeing the
  right padding. Hidden states are gathered back onto the packed axis, so callers only see THD.

**Head seam.** The engine returns final hidden states; the forward_fn computes log-probs from
them and :meth:`MegatronEngine.head`'s vocab-parallel weight rows (see :func:`.compat.head_seam`).

**Routers.** See :mod:`.routers`. **Weights.** See :mod:`.weights`.

**Distributed runs.** Every rank runs the whole rlcore step on the same batch (the trainer is
replicated; tensor/expert parallelism split the model, not the data). Expert gradients are
therefore summed over the EP replicas of each token by megatron's dispatcher and are divided by
the EP size before the optimizer step; the gradient norm sums each shard once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rlcore.batch import PackedBatch
from rlcore.errors import ConfigError, RLCoreError
from rlcore.types import (
    EngineOutput,
    HeadWeight,
    MicroBatchContext,
    ModelInfo,
    RouteLayout,
    RouterCall,
    VocabShard,
)

from rlcore_megatron import compat
from rlcore_megatron.hf_config import ModelSpec, model_spec_from_hf
from rlcore_megatron.settings import ENGINE_CAPABILITIES, MegatronSettings
from rlcore_megatron.weights import NameMap, Parallel, export_hf, load_hf_into


def settings_from_section(section: Any) -> MegatronSettings:
    """The ``megatron:`` config section (validated by its schema) as :class:`MegatronSettings`."""
    if section is None:
        return MegatronSettings()
    names = {f.name for f in dataclasses.fields(MegatronSettings)}
    return MegatronSettings(**{k: section[k] for k in section.keys() if k in names})


# ------------------------------------------------------------------------------------------
# sources of HF weights
# ------------------------------------------------------------------------------------------


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
        """A transformers model in memory. transformers builds no MTP layers, so when the
        config asks for ``num_nextn_predict_layers`` and the model has none (a tiny model created
        locally), each MTP layer is created here: the last decoder layer's tensors under the MTP
        layer's names plus ``enorm``/``hnorm``/``shared_head.norm`` (ones) and ``eh_proj``;
        matrices ~ N(0, init_std) from ``seed``, norms 1, biases 0."""
        from rlcore.engines.hf_names import checkpoint_tensors

        tensors = {n: t.detach() for n, t in checkpoint_tensors(model)}
        if getattr(model.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        tensors.update(_fresh_mtp_tensors(model.config, tensors, init_std, seed))
        return cls(model.config, tokenizer, set(tensors), tensors.__getitem__)


def _fresh_mtp_tensors(cfg: Any, tensors: dict[str, torch.Tensor], init_std: float, seed: int) -> dict[str, torch.Tensor]:
    depth = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    layers = int(cfg.num_hidden_layers)
    if not depth or any(n.startswith(f"model.layers.{layers}.") for n in tensors):
        return {}
    hidden = int(cfg.hidden_size)
    last = f"model.layers.{layers - 1}."
    gen = torch.Generator().manual_seed(seed + 7919)
    dtype = tensors["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for d in range(depth):
        prefix = f"model.layers.{layers + d}."
        shapes = {prefix + n[len(last):]: tuple(t.shape) for n, t in sorted(tensors.items()) if n.startswith(last)}
        shapes.update({prefix + "enorm.weight": (hidden,), prefix + "hnorm.weight": (hidden,),
                       prefix + "shared_head.norm.weight": (hidden,), prefix + "eh_proj.weight": (hidden, 2 * hidden)})
        for name, shape in sorted(shapes.items()):
            if len(shape) >= 2:
                out[name] = (torch.randn(shape, generator=gen) * init_std).to(dtype)
            elif name.endswith(".bias"):
                out[name] = torch.zeros(shape, dtype=dtype)
            else:
                out[name] = torch.ones(shape, dtype=dtype)
    return out


# ------------------------------------------------------------------------------------------
# process groups
# ------------------------------------------------------------------------------------------


def init_parallel(settings: MegatronSettings, device: torch.device) -> None:
    """torch.distributed (gloo on CPU, NCCL on CUDA; a world of one unless launched by
    torchrun) and megatron-core's model-parallel groups, once per process."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state as ps

    want = (settings.tensor_parallel_size, settings.expert_parallel_size)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != want:
            raise ConfigError(
                f"megatron-core's parallel state is already initialised with tensor/expert parallel sizes "
                f"{have}; this engine asks for {want}", key="megatron.tensor_parallel_size"
            )
        return
    tp, ep = want
    world = dist.get_world_size()
    if world % tp:
        raise ConfigError(f"megatron.tensor_parallel_size={tp} does not divide the world size {world}",
                          key="megatron.tensor_parallel_size")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=ep)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        if not tensor_parallel.get_cuda_rng_tracker().is_initialized():
            tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)


# ------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------


def _padded_vocab(vocab: int, multiple: int, tp: int) -> int:
    step = max(1, multiple) * tp
    return (vocab + step - 1) // step * step


#: what the decoder got that an MTP layer's transformer layer needs too (every version has them)
_MTP_LAYER_KWARGS = ("attention_mask", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin",
                     "packed_seq_params", "sequence_len_offset")


class MegatronEngine:
    """See module docstring."""

    capabilities = ENGINE_CAPABILITIES

    def __init__(self, source: HFSource, settings: MegatronSettings | None = None, device: str = "cpu",
                 dtype: str = "float32", _weights_from: MegatronEngine | None = None):
        self.settings = s = settings or MegatronSettings()
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.source = source
        self.tokenizer = source.tokenizer
        self.spec: ModelSpec = model_spec_from_hf(source.config)
        self._check_settings()
        if self.device.type == "cpu":
            from rlcore_megatron.cpu import install_cpu_shim

            install_cpu_shim()
        init_parallel(s, self.device)
        self.par = Parallel.from_megatron()
        self.padded_vocab = _padded_vocab(self.spec.vocab_size, s.vocab_size_divisible_by, self.par.tp_size)
        self.attention_path = self._attention_path()
        self.config = self._transformer_config(mtp_layers=0)
        self.model, self.mtp = self._build()
        self.names = NameMap(self.spec, self.par)
        if _weights_from is None:
            load_hf_into(self._named_parameters(), self.names, self.padded_vocab, source.names, source.get,
                         tied=self.spec.tie_word_embeddings)
        else:
            with torch.no_grad():
                for (_, dst), (_, src) in zip(self._named_parameters(), _weights_from._named_parameters(), strict=True):
                    dst.copy_(src)
        self.sites = self._router_sites()
        self.seam = None
        if self.sites:
            from rlcore_megatron.routers import RouterSeam

            self.seam = RouterSeam(self.sites, self.config)
            self.seam.check_config()
        self.sequence_alignment = self.par.tp_size if (self.attention_path == "thd" and s.sequence_parallel) else 1
        self.info = ModelInfo(
            vocab_size=self.spec.vocab_size,
            hidden_size=self.spec.hidden_size,
            num_hidden_layers=self.spec.num_layers,
            eos_token_id=(self.tokenizer.eos_token_id if self.tokenizer is not None else self.spec.eos_token_id),
            pad_token_id=((self.tokenizer.pad_token_id if self.tokenizer is not None else self.spec.pad_token_id) or 0),
            route_layout=self._route_layout(),
            mtp_layers=self.spec.mtp_layers,
            architecture=self.spec.model_type,
        )
        self.optimizer: torch.optim.Optimizer | None = None

    # ----------------------------------------------------------------- construction ------

    def _check_settings(self) -> None:
        s = self.settings
        if s.pipeline_parallel_size != 1:
            raise ConfigError(
                "megatron.pipeline_parallel_size > 1 is not supported yet: a pipelined engine must run "
                "the head and the loss inside megatron's schedule, which rlcore's trainer does not "
                "hand to engines", key="megatron.pipeline_parallel_size"
            )
        sp = self.spec
        if sp.num_kv_heads % s.tensor_parallel_size or sp.num_heads % s.tensor_parallel_size:
            raise ConfigError(
                f"megatron.tensor_parallel_size={s.tensor_parallel_size} must divide the number of attention "
                f"heads ({sp.num_heads}) and of key/value heads ({sp.num_kv_heads})", key="megatron.tensor_parallel_size"
            )
        if sp.is_moe and sp.num_experts % s.expert_parallel_size:
            raise ConfigError(
                f"megatron.expert_parallel_size={s.expert_parallel_size} must divide the number of experts "
                f"({sp.num_experts})", key="megatron.expert_parallel_size"
            )
        if s.attention not in ("auto", "te", "local"):
            raise ConfigError(f"megatron.attention must be auto, te or local, got {s.attention!r}",
                              key="megatron.attention")
        if s.token_dispatcher not in ("allgather", "alltoall"):
            raise ConfigError(f"megatron.token_dispatcher must be allgather or alltoall, got {s.token_dispatcher!r}",
                              key="megatron.token_dispatcher")
        if s.token_dispatcher == "alltoall" and self.device.type != "cuda":
            raise ConfigError("megatron.token_dispatcher=alltoall needs CUDA (it creates CUDA streams); use allgather",
                              key="megatron.token_dispatcher")

    def _attention_path(self) -> str:
        s = self.settings
        te = self.device.type == "cuda" and compat.te_available()
        if s.attention == "te" and not te:
            raise ConfigError("megatron.attention=te needs Transformer Engine on a CUDA device", key="megatron.attention")
        path = "thd" if (s.attention == "te" or (s.attention == "auto" and te)) else "padded"
        if s.sequence_parallel and path != "thd":
            raise ConfigError(
                "megatron.sequence_parallel needs the THD path (Transformer Engine): megatron's local norm "
                "does not support sequence parallelism", key="megatron.sequence_parallel"
            )
        return path

    def _transformer_config(self, mtp_layers: int) -> Any:
        import torch.nn.functional as F

        sp, s = self.spec, self.settings
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
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # every weight is loaded from the HF checkpoint
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            tensor_model_parallel_size=self.par.tp_size,
            expert_model_parallel_size=self.par.ep_size,
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
            # 0.12.1 crashes when it is unset; rlcore computes its own MTP loss, so the value is unused
            required["mtp_loss_scaling_factor"] = 0.1
        return compat.transformer_config(required, optional)

    def _build(self) -> tuple[Any, Any]:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs

        use_te = self.attention_path == "thd"
        block_spec = compat.call_with_supported(specs.get_gpt_decoder_block_spec, self.config, use_transformer_engine=use_te)
        model = compat.call_with_supported(
            GPTModel,
            config=self.config,
            transformer_layer_spec=block_spec,
            vocab_size=self.padded_vocab,
            max_sequence_length=self.spec.max_position_embeddings,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=self.spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=self.spec.rope_theta,
        )
        mtp = None
        if self.spec.mtp_layers:
            from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

            mtp_config = self._transformer_config(mtp_layers=self.spec.mtp_layers)
            mtp_spec = compat.call_with_supported(specs.get_gpt_mtp_block_spec, mtp_config, block_spec,
                                                  use_transformer_engine=use_te)
            # the model's process groups (0.19+ builds them explicitly; without them the MTP
            # layer's MoE would see no expert-parallel group and hold every expert on every rank)
            mtp = compat.call_with_supported(MultiTokenPredictionBlock, config=mtp_config, spec=mtp_spec,
                                             pg_collection=getattr(model, "pg_collection", None))
        model.to(device=self.device, dtype=self.dtype)
        if mtp is not None:
            mtp.to(device=self.device, dtype=self.dtype)
        return model, mtp

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        out = list(self.model.named_parameters())
        if self.mtp is not None:
            out += [(f"mtp.{n}", p) for n, p in self.mtp.named_parameters()]
        return out

    def _router_sites(self) -> list[Any]:
        if not self.spec.is_moe:
            return []
        from megatron.core.transformer.moe.router import TopKRouter
        from rlcore_megatron.routers import RouterSite

        sites = []
        for layer in self.model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                sites.append(RouterSite(router, int(layer.layer_number) - 1, len(sites), False,
                                        self.spec.num_experts, self.spec.topk))
        if self.mtp is not None:
            for d, mtp_layer in enumerate(self.mtp.layers):
                router = getattr(getattr(compat.mtp_inner_layer(mtp_layer), "mlp", None), "router", None)
                if isinstance(router, TopKRouter):
                    sites.append(RouterSite(router, self.spec.num_layers + d, len(sites), True,
                                            self.spec.num_experts, self.spec.topk))
        decoder_layers = [s.layer for s in sites if not s.is_mtp]
        if tuple(decoder_layers) != self.spec.moe_layer_indices:
            raise RLCoreError(
                f"megatron built MoE routers in layers {decoder_layers}, the HF config has MoE layers "
                f"{list(self.spec.moe_layer_indices)}"
            )
        return sites

    def _route_layout(self) -> RouteLayout | None:
        if not self.sites:
            return None
        return RouteLayout(layers=tuple(s.layer for s in self.sites), topk=self.spec.topk,
                           num_experts=self.spec.num_experts, num_hidden_layers=self.spec.num_layers)

    # ----------------------------------------------------------------- forward -----------

    def forward(
        self,
        batch: PackedBatch,
        *,
        record_routes: bool = False,
        router: Callable[[RouterCall], Any] | None = None,
        micro_batch: MicroBatchContext | None = None,
        mtp_hidden: bool = False,
    ) -> EngineOutput:
        if mtp_hidden and self.mtp is None:
            raise ConfigError(
                "MTP hidden states were requested, but the model has no MTP layers (the HF config's "
                "num_nextn_predict_layers is 0 or absent)", key="engine.model"
            )
        if self.seam is None:  # a dense model: no router to consult, no routes (as the hf engine)
            record_routes, router = False, None
        layout = self._layout(batch)
        if self.seam is not None:
            from rlcore_megatron.routers import RoutingState

            self.seam.check_config()
            self.seam.state = RoutingState(router, micro_batch, record_routes, layout.router_tokens,
                                           layout.router_offset, layout.to_rows, layout.from_rows)
        try:
            hidden, mtp_out = self._run(layout, mtp_hidden)
            routes = self.seam.collect(batch.num_tokens) if record_routes else None
            if routes is not None and layout.router_tokens != batch.num_tokens:
                # sequence parallel: each rank recorded its slice of the token axis
                full = routes.to(device=self.device, dtype=torch.int32)
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.par.tp_group)
                routes = full.to("cpu", torch.int16)
        finally:
            if self.seam is not None:
                self.seam.state = None
        sp = self.attention_path == "thd" and self.settings.sequence_parallel
        return EngineOutput(hidden=hidden, mtp_hidden=mtp_out, routes=routes, sequence_parallel=sp)

    def _layout(self, batch: PackedBatch) -> _Layout:
        if self.attention_path == "thd":
            return _ThdLayout(batch, self.device, self.par, self.settings.sequence_parallel)
        return _PaddedLayout(batch, self.device)

    def _run(self, layout: _Layout, want_mtp: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        captured: dict[str, Any] = {}
        handle = None
        if want_mtp:
            def keep_decoder_kwargs(module, args, kwargs):
                captured.update(kwargs)

            handle = self.model.decoder.register_forward_pre_hook(keep_decoder_kwargs, with_kwargs=True)
        try:
            with compat.head_seam(self.model) as run:
                hidden_sbh = run(layout.input_ids, layout.position_ids, layout.attention_mask, **layout.model_kwargs)
        finally:
            if handle is not None:
                handle.remove()
        hidden = layout.to_packed(hidden_sbh)
        if not want_mtp:
            return hidden, None
        return hidden, self._run_mtp(layout, hidden_sbh, captured)

    def _run_mtp(self, layout: _Layout, hidden_sbh: torch.Tensor, decoder_kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """MTP depths 1..D: ``h_d = norm_d(layer_d(eh_proj_d([enorm_d(emb(x_{t+d})), hnorm_d(h_{d-1})])))``
        with the token stream shifted within each sequence (never across a boundary)."""
        from megatron.core import tensor_parallel

        outs = []
        prev = hidden_sbh
        for d, mtp_layer in enumerate(self.mtp.layers, start=1):
            emb = self.model.embedding(input_ids=layout.shifted_input_ids(d), position_ids=layout.position_ids)
            x = torch.cat([mtp_layer.enorm(emb), mtp_layer.hnorm(prev)], dim=-1)
            x, _ = mtp_layer.eh_proj(x)
            if self.par.tp_size > 1:
                x = tensor_parallel.gather_from_tensor_model_parallel_region(x)
            if self.config.sequence_parallel:
                x = tensor_parallel.scatter_to_sequence_parallel_region(x)
            inner = compat.mtp_inner_layer(mtp_layer)
            kwargs = {k: decoder_kwargs.get(k) for k in _MTP_LAYER_KWARGS}
            x = compat.call_with_supported(inner, hidden_states=x, **kwargs)
            if isinstance(x, tuple):
                x = x[0]
            prev = mtp_layer.final_layernorm(x)
            outs.append(layout.to_packed(prev))
        return outs

    def head(self) -> HeadWeight:
        if self.spec.tie_word_embeddings:
            w = self.model.shared_embedding_or_output_weight()
        else:
            w = self.model.output_layer.weight
        rows = w.shape[0]
        start = self.par.tp_rank * rows
        group = self.par.tp_group if self.par.tp_size > 1 else None
        return HeadWeight(weight=w, vocab=VocabShard(start, start + rows, self.spec.vocab_size, group))

    # ----------------------------------------------------------------- training ----------

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, p in self._named_parameters():
            yield p

    def train(self, mode: bool = True) -> MegatronEngine:
        self.model.train(mode)
        if self.mtp is not None:
            self.mtp.train(mode)
        return self

    def setup_optimizer(self, training: Any) -> None:
        betas = tuple(float(b) for b in training.betas)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad],
            lr=float(training.lr), betas=betas, weight_decay=float(training.weight_decay),
        )

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.parameters():
                p.grad = None

    def grad_norm(self) -> float:
        """Total L2 norm of the gradient over every rank's shard, each shard counted once."""
        par = self.par
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        tp_sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self._named_parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            pm = self.names(name)  # megatron leaves its own TP attributes unset without initialisation
            if pm.expert:
                expert += sq
            elif pm.tp_dim is not None and par.tp_size > 1:
                tp_sharded += sq
            else:
                replicated += sq
        if par.tp_size > 1:
            dist.all_reduce(tp_sharded, group=par.tp_group)
        if par.ep_size * par.etp_size > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
        return float((replicated + tp_sharded + expert).sqrt())

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        if self.par.ep_size > 1:
            # every EP rank fed the same tokens; the dispatcher summed their gradients
            for name, p in self._named_parameters():
                if p.grad is not None and self.names(name).expert:
                    p.grad.div_(self.par.ep_size)
        norm = self.grad_norm()
        if grad_clip > 0 and norm > grad_clip:
            scale = grad_clip / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return norm

    def make_reference(self) -> MegatronEngine:
        """A frozen copy of the current policy, built afresh (megatron modules hold process
        groups, which do not deep-copy)."""
        ref = MegatronEngine(self.source, self.settings, str(self.device), str(self.dtype).replace("torch.", ""),
                             _weights_from=self)
        ref.train(False)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # ----------------------------------------------------------------- weights -----------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, gathered per tensor (every rank must consume the stream)."""
        skip_mtp = not self.settings.export_mtp

        def skip(name: str) -> bool:
            return skip_mtp and name.startswith("mtp.")

        return export_hf(self._named_parameters(), self.names, skip)

    def save_hf(self, path: str | Path, shard_bytes: int = 2 << 30) -> None:
        """Config, tokenizer and safetensors shards (with an index when there are several);
        rank 0 writes, every rank takes part in the gathers."""
        from safetensors.torch import save_file

        path = Path(path)
        writer = dist.get_rank() == 0
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

        for name, t in self.export_hf_weights():
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
        self.source.config.save_pretrained(str(path))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path))

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "mtp": self.mtp.state_dict() if self.mtp is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.mtp is not None and state.get("mtp") is not None:
            self.mtp.load_state_dict(state["mtp"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


# ------------------------------------------------------------------------------------------
# packed batch ↔ megatron inputs
# ------------------------------------------------------------------------------------------


class _Layout:
    """How a packed batch is laid out for megatron, and the maps back (see module docstring).
    ``to_rows``/``from_rows`` map packed per-token tensors to the rows MoE routers see."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    model_kwargs: dict[str, Any]
    router_tokens: int
    router_offset: int

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor: ...

    def shifted_input_ids(self, d: int) -> torch.Tensor: ...

    def to_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def from_rows(self, x: torch.Tensor) -> torch.Tensor: ...


class _PaddedLayout(_Layout):
    """One row per sequence, ``[B, L]``; megatron runs ``[s, b]``, so router row ``s * B + b``."""

    def __init__(self, batch: PackedBatch, device: torch.device):
        lay = batch.layout
        self.batch = batch
        self.B = B = lay.num_seqs
        self.L = L = int(lay.padded_lens.max()) if B else 0
        seq, off = lay.seq_index(), lay.offsets()
        self.flat = (seq * L + off).to(device)  # packed t -> row-major [B, L] index
        self.rows = (off * B + seq).to(device)  # packed t -> router row ([s, b] order)
        self.pad_id = batch.pad_id
        self.device = device
        self.input_ids = self._scatter(batch.input_ids.to(device))
        self.position_ids = torch.arange(L, device=device).expand(B, L)
        self.attention_mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=device), diagonal=1)[None, None]
        self.model_kwargs = {}
        self.router_tokens = batch.num_tokens
        self.router_offset = 0

    def _scatter(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.B * self.L,), self.pad_id, dtype=torch.long, device=self.device)
        return out.index_copy(0, self.flat, ids).view(self.B, self.L)

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        h = hidden_sbh.transpose(0, 1).reshape(self.B * self.L, -1)
        return h.index_select(0, self.flat)

    def shifted_input_ids(self, d: int) -> torch.Tensor:
        ids = self.batch.input_ids
        for _ in range(d):
            ids = self.batch.roll(ids, -1, fill=self.pad_id)
        return self._scatter(ids.to(self.device))

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        fill = 0 if x.is_floating_point() else -1
        out = torch.full((self.B * self.L, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return out.index_copy(0, self.rows.to(x.device), x)

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.rows.to(x.device))


class _ThdLayout(_Layout):
    """``[1, T]`` with ``PackedSeqParams(qkv_format="thd")`` (Transformer Engine attention).
    Under sequence parallelism this rank's routers see tokens ``[rank * T/tp, (rank+1) * T/tp)``."""

    def __init__(self, batch: PackedBatch, device: torch.device, par: Parallel, sequence_parallel: bool):
        from megatron.core.packed_seq_params import PackedSeqParams

        lay = batch.layout
        self.batch = batch
        self.device = device
        self.input_ids = batch.input_ids.to(device)[None]
        self.position_ids = batch.position_ids().to(device)[None]
        self.attention_mask = None
        cu = lay.cu_seqlens.to(device=device, dtype=torch.int32)
        cu_p = lay.cu_seqlens_padded.to(device=device, dtype=torch.int32)
        max_len = int(lay.padded_lens.max()) if lay.num_seqs else 0
        self.model_kwargs = {"packed_seq_params": PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
            cu_seqlens_kv_padded=cu_p, max_seqlen_q=max_len, max_seqlen_kv=max_len)}
        T = batch.num_tokens
        self.sp_group = par.tp_group if sequence_parallel and par.tp_size > 1 else None
        if self.sp_group is not None:
            if T % par.tp_size:
                raise RLCoreError(f"sequence parallelism needs T={T} divisible by tp={par.tp_size} (sequence_alignment)")
            self.router_tokens = T // par.tp_size
            self.router_offset = par.tp_rank * self.router_tokens
        else:
            self.router_tokens = T
            self.router_offset = 0

    def to_packed(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        return hidden_sbh[:, 0]

    def shifted_input_ids(self, d: int) -> torch.Tensor:
        ids = self.batch.input_ids
        for _ in range(d):
            ids = self.batch.roll(ids, -1, fill=self.batch.pad_id)
        return ids.to(self.device)[None]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the RouterCall already covers exactly this rank's rows

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x


# ------------------------------------------------------------------------------------------
# factory
# ------------------------------------------------------------------------------------------


def build_megatron_engine(ctx: Any) -> MegatronEngine:
    """Factory of the ``megatron`` engine: from ``engine.model.path`` (an HF directory) or a
    tiny model created locally for the task, exactly as the ``hf`` engine creates it."""
    ecfg = ctx.config.engine
    device = ecfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = settings_from_section(ctx.settings)
    if ecfg.model.path:
        source = HFSource.from_dir(ecfg.model.path)
    else:
        from rlcore.engines.tiny import make_tiny_model, make_tokenizer

        task = ctx.extras.get("task")
        words = task.vocab if task is not None else [str(i) for i in range(10)]
        tok = make_tokenizer(words)
        tiny = ecfg.model.tiny
        source = HFSource.from_model(make_tiny_model(tiny, tok, ecfg.model.dtype), tok,
                                     init_std=float(tiny.init_std), seed=int(tiny.seed))
    return MegatronEngine(source, settings, device=device, dtype=ecfg.model.dtype)
