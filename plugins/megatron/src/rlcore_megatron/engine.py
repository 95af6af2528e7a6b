"""The ``megatron`` training engine: a megatron-core ``GPTModel`` under rlcore.

**Model.** Built (:mod:`.model`) from an HF config (:mod:`.hf_config`) with megatron-core's own layer specs:
Transformer Engine's when it is importable on a CUDA device, else the local (pure PyTorch) spec.
MTP layers (``num_nextn_predict_layers``) are megatron-core ``MultiTokenPredictionLayer``\\ s in a
``MultiTokenPredictionBlock`` the engine holds next to the ``GPTModel`` (not inside it), so the
model's own forward never computes megatron's MTP loss — rlcore's MTP loss is a ``postprocess``
plugin on the same head as the policy loss — and the engine runs them only when a forward asks
for MTP hidden states.

**Packed forward.** A :class:`~rlcore.batch.PackedBatch` runs one of two ways
(:attr:`MegatronEngine.attention_path` says which; :mod:`.layout`):

* ``thd`` (any CUDA device): input ``[1, T]`` with ``PackedSeqParams(qkv_format="thd")`` built
  from the batch's raw and padded ``cu_seqlens``; attention by Transformer Engine where installed,
  else :class:`rlcore_megatron.varlen_attention.VarlenDotProductAttention` (torch's varlen
  kernel); :attr:`MegatronEngine.thd_backend` says which.
* ``padded`` (CPU, or ``megatron.attention=local``): megatron's local attention
  rejects ``PackedSeqParams``, and megatron computes RoPE from positions ``0..s-1`` of its input,
  so each sequence becomes a row of a ``[B, L]`` batch (``L`` = the longest padded sequence),
  which restarts positions per sequence; a causal mask keeps every real token from seeing the
  right padding. Hidden states are gathered back onto the packed axis, so callers only see THD.

**Head seam.** The engine returns final hidden states; the forward_fn computes log-probs from
them and :meth:`MegatronEngine.head`'s vocab-parallel weight rows (see :func:`.compat.head_seam`).

**Routers.** See :mod:`.routers`. **Weights.** See :mod:`.weights` (names, gathers) and
:mod:`.hf_dir` (HF directories read and written).

**Distributed runs.** The ranks of one model replica run the whole rlcore step on the same
batch (tensor/expert parallelism split the model, not the data). Expert gradients are
therefore summed over the EP replicas of each token by megatron's dispatcher and are divided by
the EP size before the optimizer step; the gradient norm sums each shard once. Several replicas
(data parallelism, ``cluster.trainer.dp`` > 1, beside TP, not EP) each run their share of the
sequences: :meth:`MegatronEngine.data_parallel_group` names megatron's data-parallel group, over
which rlcore's model-parallel rank strategy (:mod:`rlcore.parallel.model_parallel`) sums
gradients and log-probs; megatron's own DDP wrapper is not used (it averages into buffers of its
own, which the optimizer and :meth:`MegatronEngine.grad_norm` here do not read). Pipeline
stages (``pipeline_parallel_size`` > 1) run inside :meth:`MegatronEngine.forward`: see
:mod:`.pipeline`; the rank strategy takes log-probs and metrics from the last stage
(:meth:`MegatronEngine.pipeline_group`); PPO's critic hands its values back from the last stage
itself (:mod:`.value`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
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
from rlcore_megatron.hf_dir import HFSource, export_config, tiny_source, write_hf_dir
from rlcore_megatron.layout import PackedLayout, make_layout
from rlcore_megatron.model import (
    build_model,
    check_settings,
    choose_attention_path,
    init_parallel,
    padded_vocab_size,
    release_parallel,
    router_sites,
)
from rlcore_megatron.pipeline import chunk_layers, gather_stages, pipeline_groups, run_chunks
from rlcore_megatron.routers import RouterSeam, RoutingState
from rlcore_megatron.settings import ENGINE_CAPABILITIES, MegatronSettings, resolve_parallel, section_settings
from rlcore_megatron.weights import (
    GATHER_BYTES,
    NameMap,
    Parallel,
    detect_mtp_layout,
    export_hf,
    load_hf_into,
)

__all__ = ["MegatronEngine", "HFSource", "build_megatron_engine", "settings_from_section"]


def settings_from_section(section: Any, config: Any = None) -> MegatronSettings:
    """The ``megatron:`` config section (validated by its schema) as :class:`MegatronSettings`,
    with the parallel sizes of ``config``'s launcher (:func:`.settings.resolve_parallel`)."""
    return resolve_parallel(section_settings(section), config)


#: a chunk's decoder layer (numbered from 0 in each pipeline chunk)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

#: what the decoder got that an MTP layer's transformer layer needs too (every version has them)
_MTP_LAYER_KWARGS = ("attention_mask", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin",
                     "packed_seq_params", "sequence_len_offset")


class MegatronEngine:
    """See module docstring."""

    capabilities = ENGINE_CAPABILITIES

    #: gathered bytes per export collective (:func:`.weights.export_hf`); the factory sets the run's bucket size
    export_gather_bytes: int = GATHER_BYTES

    def __init__(self, source: HFSource, settings: MegatronSettings | None = None, device: str = "cpu",
                 dtype: str = "float32", _weights_from: MegatronEngine | None = None):
        self.settings = s = settings or MegatronSettings()
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.source = source
        self.tokenizer = source.tokenizer
        self.spec: ModelSpec = model_spec_from_hf(source.config)
        check_settings(s, self.spec, self.device)
        if self.device.type == "cpu":
            from rlcore_megatron.cpu import install_cpu_shim

            install_cpu_shim()
        self.created_groups = init_parallel(s, self.device)  # released by close(), only by the engine that made them
        self.par = Parallel.from_megatron()
        self.padded_vocab = padded_vocab_size(self.spec.vocab_size, s.vocab_size_divisible_by, self.par.tp_size)
        self.attention_path = choose_attention_path(s, self.device)
        self.pipe = pipeline_groups(self.par.tp_size, s.pipeline_parallel_size) if s.pipeline_parallel_size > 1 \
            else None
        self.chunks, self.chunk_offsets = self._build_chunks()
        self.model = self.chunks[0]  # the whole model unless pipelined
        self.names = NameMap(self.spec, self.par, detect_mtp_layout(self.spec, source.names))
        if _weights_from is None:
            hf_names = source.names
            if self.pipe is not None:  # this stage's tensors only
                hf_names = set(source.names) & {h for n, _ in self.named_parameters() for h in self.names(n).hf}
            load_hf_into(self.named_parameters(), self.names, self.padded_vocab, hf_names, source.get,
                         tied=self.spec.tie_word_embeddings)
        else:
            with torch.no_grad():
                for (_, dst), (_, src) in zip(self.named_parameters(), _weights_from.named_parameters(), strict=True):
                    dst.copy_(src)
        self.sites = router_sites(self.model, self.mtp, self.spec)
        self.seam = None
        if self.sites:
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

    def _build_chunks(self) -> tuple[list[Any], list[int]]:
        """The ``GPTModel``\\ s of this rank and the first decoder layer of each: the whole model,
        or this pipeline rank's chunks (:mod:`.pipeline`); sets ``config`` and ``mtp``."""
        s = self.settings
        if self.pipe is None:
            built = build_model(self.spec, s, self.par, self.padded_vocab, self.attention_path, self.device,
                                self.dtype)
            self.config, self.mtp, self.thd_backend = built.config, built.mtp, built.thd_backend
            return [built.model], [0]
        pp = self.pipe.pp
        cuts = chunk_layers(self.spec.num_layers, pp * s.virtual_pipeline_stages)
        chunks, offsets = [], []
        for c in range(self.pipe.stage, len(cuts), pp):
            first, count = cuts[c]
            built = build_model(dataclasses.replace(self.spec, num_layers=count), s, self.par, self.padded_vocab,
                                self.attention_path, self.device, self.dtype, pre_process=c == 0,
                                post_process=c == len(cuts) - 1)
            chunks.append(built.model)
            offsets.append(first)
        self.config, self.mtp, self.thd_backend = built.config, None, built.thd_backend
        return chunks, offsets

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Megatron-named parameters of this rank: the model's (a pipeline rank's chunks with
        their decoder layers numbered as in the whole model), then the MTP block's (``mtp.``)."""
        if self.pipe is None:
            out = list(self.model.named_parameters())
        else:
            out = []
            for chunk, first in zip(self.chunks, self.chunk_offsets, strict=True):
                for name, p in chunk.named_parameters():
                    m = _LAYER.match(name)
                    out.append((f"decoder.layers.{first + int(m.group(1))}.{m.group(2)}" if m else name, p))
        if self.mtp is not None:
            out += [(f"mtp.{n}", p) for n, p in self.mtp.named_parameters()]
        return out

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
        mtp_detach_trunk: bool = False,
    ) -> EngineOutput:
        """See :class:`rlcore.types.TrainingEngine`. ``mtp_detach_trunk``: the MTP layers read
        the trunk's hidden states and the shared token embeddings detached, so the MTP loss
        trains the MTP layers (and, unless the loss detaches it, the LM head) but never the
        trunk (megatron-core 0.19's ``mtp_detach_heads`` input half, verl's ``detach_encoder``)."""
        if mtp_hidden and self.mtp is None:
            raise ConfigError(
                "MTP hidden states were requested, but the model has no MTP layers (the HF config's "
                "num_nextn_predict_layers is 0 or absent)", key="engine.model"
            )
        if self.seam is None:  # a dense model: no router to consult, no routes (as the hf engine)
            record_routes, router = False, None
        layout = make_layout(batch, self.attention_path, self.device, self.par, self.settings.sequence_parallel)
        if self.seam is not None:
            self.seam.check_config()
            self.seam.state = RoutingState(router, micro_batch, record_routes, layout.router_tokens,
                                           layout.router_offset, layout.to_rows, layout.from_rows)
        try:
            if self.pipe is not None:  # MoE and MTP are refused with pipeline stages (settings.check_pipeline)
                hidden, mtp_out = self._run_pipeline(layout, batch.num_tokens), None
            else:
                hidden, mtp_out = self._run(layout, mtp_hidden, mtp_detach_trunk)
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

    def _run(self, layout: PackedLayout, want_mtp: bool,
             detach_trunk: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        captured: dict[str, Any] = {}
        handles = []
        if want_mtp:
            def keep_decoder_kwargs(module, args, kwargs):
                captured.update(kwargs)

            def keep_prenorm(module, args, kwargs):
                captured["prenorm_hidden"] = args[0] if args else next(iter(kwargs.values()))

            handles.append(self.model.decoder.register_forward_pre_hook(keep_decoder_kwargs, with_kwargs=True))
            if self.names.mtp_layout == "mimo":
                handles.append(self.model.decoder.final_layernorm.register_forward_pre_hook(keep_prenorm,
                                                                                            with_kwargs=True))
        try:
            with compat.head_seam(self.model) as run:
                hidden_sbh = run(layout.input_ids, layout.position_ids, layout.attention_mask, **layout.model_kwargs)
        finally:
            for handle in handles:
                handle.remove()
        hidden = layout.to_packed(hidden_sbh)
        if not want_mtp:
            return hidden, None
        trunk = hidden_sbh
        if self.names.mtp_layout == "mimo":
            if "prenorm_hidden" not in captured:
                raise RLCoreError("the decoder's final norm did not run: MiMo's MTP layers read its input")
            trunk = captured.pop("prenorm_hidden")
        return hidden, self._run_mtp(layout, trunk, captured, detach_trunk)

    def _run_pipeline(self, layout: PackedLayout, num_tokens: int) -> torch.Tensor:
        """This pipeline rank's chunks over the micro-batch: the final hidden states on the last
        stage, zeros elsewhere (:func:`.pipeline.run_chunks`)."""
        rows, cols = layout.input_ids.shape  # [b, s] (padded rows) or [1, T] (THD)
        activation = (cols, rows, self.spec.hidden_size)

        def run_chunk(chunk: Any, last: bool) -> torch.Tensor:
            args = (layout.input_ids, layout.position_ids, layout.attention_mask)
            if not last:
                return chunk(*args, **layout.model_kwargs)
            with compat.head_seam(chunk) as run:
                return layout.to_packed(run(*args, **layout.model_kwargs))

        return run_chunks(self.chunks, self.pipe, run_chunk, activation, (num_tokens, self.spec.hidden_size),
                          self.dtype, self.device)

    def _run_mtp(self, layout: PackedLayout, trunk_sbh: torch.Tensor, decoder_kwargs: dict[str, Any],
                 detach_trunk: bool) -> list[torch.Tensor]:
        """MTP depths 1..D: ``h_d = norm_d(layer_d(eh_proj_d([enorm_d(emb(x_{t+d})), hnorm_d(h_{d-1})])))``
        with the token stream shifted within each sequence (never across a boundary).

        The semantics follow the checkpoint's MTP layout (:mod:`.weights`), i.e. what will serve
        these weights: MiMo's (vLLM's ``MiMoMTP``) reads the trunk's hidden state *before* its
        final norm and zeroes the token embedding at each sequence's first position and where
        ``x_{t+d}`` does not exist; DeepSeek-V3's keeps megatron-core's (post-norm hidden state,
        embeddings as they are).

        megatron's own ``MultiTokenPredictionBlock.forward`` is never called (see
        :func:`.compat.refuse_native_mtp_loss`): it is where megatron-core computes its own MTP
        loss (0.12/0.13), and from 0.14 its output feeds ``GPTModel._postprocess``, which adds it."""
        from megatron.core import tensor_parallel

        mimo = self.names.mtp_layout == "mimo"
        outs = []
        prev = trunk_sbh.detach() if detach_trunk else trunk_sbh
        for d, mtp_layer in enumerate(self.mtp.layers, start=1):
            emb = self.model.embedding(input_ids=layout.shifted_input_ids(d), position_ids=layout.position_ids)
            if detach_trunk:
                emb = emb.detach()
            if mimo:
                emb = emb * layout.mtp_embedding_kept(d).to(emb.dtype)
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
        if self.pipe is not None and not self.pipe.last:
            # a stage before the last: its head runs on zero hidden states and is thrown away
            # (.pipeline); a zero weight of the shard's shape, one row of memory
            rows = self.padded_vocab // self.par.tp_size
            start = self.par.tp_rank * rows
            weight = torch.zeros(1, self.spec.hidden_size, dtype=self.dtype, device=self.device).expand(rows, -1)
            group = self.par.tp_group if self.par.tp_size > 1 else None
            return HeadWeight(weight=weight, vocab=VocabShard(start, start + rows, self.spec.vocab_size, group))
        last = self.chunks[-1]  # the whole model, or the last stage's last chunk
        if self.spec.tie_word_embeddings:
            w = last.shared_embedding_or_output_weight()
        else:
            w = last.output_layer.weight
        rows = w.shape[0]
        start = self.par.tp_rank * rows
        group = self.par.tp_group if self.par.tp_size > 1 else None
        return HeadWeight(weight=w, vocab=VocabShard(start, start + rows, self.spec.vocab_size, group))

    # ----------------------------------------------------------------- training ----------

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> MegatronEngine:
        for chunk in self.chunks:
            chunk.train(mode)
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
        for name, p in self.named_parameters():
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
        total = replicated + tp_sharded + expert
        if self.pipe is not None:  # each stage's parameters are its own
            dist.all_reduce(total, group=self.pipe.group)
        return float(total.sqrt())

    @staticmethod
    def clipped_step(optimizer: Any, params: Any, norm: float, grad_clip: float) -> float:
        """Scale the gradients down to ``grad_clip`` when their (already reduced) norm exceeds it,
        take the optimizer step, return the norm before clipping (the policy's and the critic's step)."""
        if grad_clip > 0 and norm > grad_clip:
            scale = grad_clip / (norm + 1e-6)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        optimizer.step()
        return norm

    def divide_expert_grads(self) -> None:
        """Every EP rank fed the same tokens and the dispatcher summed their gradients: the
        experts' gradients are divided by the EP size (before the norm and the step)."""
        if self.par.ep_size > 1:
            for name, p in self.named_parameters():
                if p.grad is not None and self.names(name).expert:
                    p.grad.div_(self.par.ep_size)

    def optimizer_step(self, grad_clip: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("setup_optimizer() was not called")
        self.divide_expert_grads()
        return self.clipped_step(self.optimizer, self.parameters(), self.grad_norm(), grad_clip)

    def close(self) -> None:
        """At the end of a run (the trainer calls it, success or error): release the process groups
        this engine initialised (:func:`.model.release_parallel`): megatron-core's parallel state
        and the pipeline groups, then the default group if the engine created it (a world of one,
        or torchrun's without a group of the user's). A group the launcher or the user created
        before is left to them. Once is enough: a second call does nothing."""
        created, self.created_groups = self.created_groups, None
        if created is not None:
            release_parallel(created)

    def make_reference(self) -> MegatronEngine:
        """A frozen copy of the current policy, built afresh (megatron modules hold process
        groups, which do not deep-copy)."""
        ref = MegatronEngine(self.source, self.settings, str(self.device), str(self.dtype).replace("torch.", ""),
                             _weights_from=self)
        ref.train(False)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def make_value_model(self, seed: int = 0) -> Any:
        """PPO's critic (``Cap.VALUE_MODEL``): the policy's weights under the same layout (pipeline
        stages included), with a scalar head on the last stage (:mod:`rlcore_megatron.value`)."""
        from rlcore_megatron.value import MegatronValueModel

        return MegatronValueModel(self, seed)

    # ----------------------------------------------------------------- weights -----------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, gathered over the tensor/expert-parallel ranks one collective per
        group of :attr:`export_gather_bytes` (the run's ``sync.bucket_mb``: one all-gather per
        bucket) and, pipelined, from every stage to the writer (every rank must consume the stream)."""
        skip_mtp = not self.settings.export_mtp

        def skip(name: str) -> bool:
            return skip_mtp and name.startswith("mtp.")

        stream = export_hf(self.named_parameters(), self.names, skip, gather_bytes=self.export_gather_bytes)
        return stream if self.pipe is None else gather_stages(stream, self.pipe, self.device)

    def save_hf(self, path: str | Path, shard_bytes: int = 2 << 30) -> None:
        """Config, tokenizer and safetensors shards (with an index when there are several);
        rank 0 writes, every rank takes part in the gathers."""
        mtp = self.spec.mtp_layers if self.settings.export_mtp else 0
        config = export_config(self.source.config, mtp, self.names.mtp_layout)
        write_hf_dir(self.export_hf_weights(), path, config, self.tokenizer,
                     writer=dist.get_rank() == 0, shard_bytes=shard_bytes)

    def data_parallel_group(self) -> Any:
        """The ranks that hold the same shard and split the step's sequences (megatron-core's
        data-parallel group; pipelined, :mod:`.pipeline`'s), or ``None`` when there is one model
        replica."""
        if self.pipe is not None:
            return self.pipe.dp_group
        if self.par.ep_size > 1:
            return None  # refused beside data parallelism (model.init_parallel): every EP rank, every sample
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None

    def parallel_layout(self) -> dict[str, int]:
        """How the model is split over the ranks (recorded with per-rank checkpoints: a shard
        only loads into the same layout)."""
        group = self.data_parallel_group()
        dp = dist.get_world_size(group) if group is not None else 1
        return {"tp": self.par.tp_size, "ep": self.par.ep_size, "etp": self.par.etp_size,
                "pp": self.settings.pipeline_parallel_size, "vpp": self.settings.virtual_pipeline_stages, "dp": dp,
                "rank": dist.get_rank(), "world": dist.get_world_size()}

    def pipeline_group(self) -> tuple[Any, int] | None:
        """This rank's pipeline (its process group) and the global rank of its last stage, whose
        log-probs and metrics are the pass's; ``None`` unless pipelined."""
        if self.pipe is None:
            return None
        return self.pipe.group, self.pipe.rank_of(self.pipe.pp - 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict() if self.pipe is None else [c.state_dict() for c in self.chunks],
            "mtp": self.mtp.state_dict() if self.mtp is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.pipe is None:
            self.model.load_state_dict(state["model"])
        else:
            for chunk, chunk_state in zip(self.chunks, state["model"], strict=True):
                chunk.load_state_dict(chunk_state)
        if self.mtp is not None and state.get("mtp") is not None:
            self.mtp.load_state_dict(state["mtp"])
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def build_megatron_engine(ctx: Any) -> MegatronEngine:
    """Factory of the ``megatron`` engine: from ``engine.model.path`` (an HF directory) or a
    tiny model created locally for the task, exactly as the ``hf`` engine creates it."""
    from rlcore.platforms import run_device

    ecfg = ctx.config.engine
    device = str(run_device(ctx))  # the run's platform (cpu, cuda, or a plugin's: npu), resolved by core
    settings = settings_from_section(ctx.settings, ctx.config)
    if ecfg.model.path:
        source = HFSource.from_dir(ecfg.model.path)
    else:
        from rlcore.engines.tiny import make_tokenizer

        task = ctx.extras.get("task")
        words = task.vocab if task is not None else [str(i) for i in range(10)]
        tok = make_tokenizer(words)
        source = tiny_source(ecfg.model.tiny, tok, ecfg.model.dtype)
    engine = MegatronEngine(source, settings, device=device, dtype=ecfg.model.dtype)
    engine.export_gather_bytes = max(1, int(ctx.config.sync.bucket_mb * 2**20))  # a gather per sync bucket
    return engine
