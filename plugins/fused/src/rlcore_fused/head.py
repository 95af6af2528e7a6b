"""The ``fused`` forward_fn: per-token log-prob and entropy from hidden states and LM-head rows,
without ever holding ``[T, V]`` logits.

Semantics are the reference head's (``rlcore.heads``): fp32 logits divided by the temperature
(scalar or per token), fp32 softmax statistics, padding vocab rows (ids ≥ ``vocab_size``)
excluded, 0 log-prob / entropy and no gradient at masked positions, entropy as
``log S − W/S`` with ``W = Σ e^{z−m}(z−m)``. What differs is how the work is done:

* masked tokens are dropped before any arithmetic (the kernels see only the unmasked rows);
* a backend computes one packed ``(max, Σexp, Σexp·(z−max), target logit)`` record per token
  over this rank's vocab rows; under vocab sharding one all-gather of that record is the whole
  exchange (:mod:`rlcore_fused.softmax_stats`);
* ``Σπ²`` (when asked) is one more row of that record, ``Σ e^{2(z−m)}``, merged with the others;
* the backward recomputes logits from the saved inputs and the per-token ``lse`` and
  ``E_p[z]``; the hidden-state gradient is summed over the tensor-parallel group (or
  reduce-scattered under sequence parallelism) by rlcore's autograd collectives.

Backends: ``triton`` (CUDA; CPU only under ``TRITON_INTERPRET=1``) and ``torch`` (chunked, any
device). ``auto`` picks ``triton`` for CUDA tensors and ``torch`` for CPU tensors; anything else,
or a CUDA device whose Triton cannot be imported, is an error rather than a silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rlcore.distributed import copy_to_group, group_size
from rlcore.errors import BatchShapeError, RLCoreError
from rlcore.heads import check_head_input
from rlcore.types import HeadInput, HeadOutput, VocabShard

from rlcore_fused.softmax_stats import exchange_records, finalize, sum_pi_squared
from rlcore_fused.torch_backend import TorchKernels
from rlcore_fused.tuning import BACKENDS, TritonConfig


class FusedBackendError(RLCoreError, RuntimeError):
    """The selected backend cannot run here; the message says what to install or choose."""


class _FusedLogprobEntropy(torch.autograd.Function):
    """(compacted hidden [N, H], weight [V_local, H]) → (logprob [N], entropy [N]) in fp32, and
    Σπ² [N] (no gradient; zeros unless ``compute_sum_sq``)."""

    @staticmethod
    def forward(ctx, x, weight, labels_local, inv_temp, valid_rows, group, compute_entropy, kernels, compute_sum_sq):
        w_valid = weight[:valid_rows]
        record = kernels.local_record(x, w_valid, labels_local, inv_temp, compute_entropy, compute_sum_sq)
        record = exchange_records(record, group)
        logprob, entropy, lse, mean_logit, target_missing = finalize(record, compute_entropy)
        sum_sq = sum_pi_squared(record) if compute_sum_sq else torch.zeros_like(logprob)
        ctx.mark_non_differentiable(sum_sq)
        ctx.save_for_backward(x, weight, labels_local, inv_temp, lse, mean_logit)
        ctx.valid_rows = valid_rows
        ctx.kernels = kernels
        ctx.set_materialize_grads(False)
        if entropy is None:
            entropy = torch.zeros_like(logprob)
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(target_missing)
        return logprob, entropy, target_missing, sum_sq

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_missing=None, _g_sum_sq=None):
        x, weight, labels_local, inv_temp, lse, mean_logit = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx_full = dw_full = None
        if g_lp is None and g_ent is None:
            return (None,) * 9
        v = ctx.valid_rows
        dx, dw = ctx.kernels.grads(
            x, weight[:v], labels_local, inv_temp, lse, mean_logit,
            None if g_lp is None else g_lp.float(), None if g_ent is None else g_ent.float(),
            need_dx, need_dw,
        )
        if need_dx:
            dx_full = dx
        if need_dw:
            if v == weight.shape[0]:
                dw_full = dw
            else:  # padding rows get an exact-zero gradient
                dw_full = torch.zeros_like(weight)
                dw_full[:v] = dw
        return dx_full, dw_full, None, None, None, None, None, None, None


class _PrecomputedLoss(torch.autograd.Function):
    """A loss whose gradients were formed in the forward: backward scales the stored ``dX``
    (over all T rows of ``hidden``) and ``dW`` by the incoming gradient.

    With a backend that can scale in place on the device (Triton on CUDA: a kernel that does
    nothing when the incoming gradient is 1, the usual ``loss.backward()``), the backward takes
    no host sync, so the host runs ahead into the next work while the head's GEMMs finish; the
    stored gradients are then handed out scaled, and a second backward through the same graph
    (``retain_graph``) is refused. Otherwise one sync decides whether to multiply at all."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, dx, dw, kernels):
        ctx.save_for_backward(dx, dw)
        ctx.kernels = kernels
        ctx.scaled_in_place = False
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.scaled_in_place:
            raise RuntimeError(
                "rlcore-fused: the fused loss's backward ran twice through one graph; its gradients were formed "
                "in the forward and handed out scaled in place the first time. Call the head again (or set "
                "fused.backend=torch) for a second backward"
            )
        dx, dw = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        scale = getattr(ctx.kernels, "scale_in_place", None)
        if scale is not None and all(t.is_cuda and t.is_contiguous() for t in (dx, dw)):
            g0 = g.reshape(())
            gx = scale(dx, g0) if need_dx else None
            gw = scale(dw, g0) if need_dw else None
            ctx.scaled_in_place = True
            return None, gx, gw, None, None, None
        unit = bool(g.eq(1).all())  # the usual case: loss.backward() on the step loss's sum
        gx = (dx if unit else dx * g.to(dx.dtype)) if need_dx else None
        gw = (dw if unit else dw * g.to(dw.dtype)) if need_dw else None
        return None, gx, gw, None, None, None


def _token_slice(x: Any, lo: int, hi: int) -> Any:
    """``TokenInputs`` rows ``[lo, hi)``: every tensor on the token axis (the fields that
    :meth:`rlcore.types.LossRequest.inputs_at` restricts) sliced, ``seq_tokens`` (per sequence)
    kept."""
    def cut(t):
        return None if t is None else t[lo:hi]

    return replace(x, old_logprobs=cut(x.old_logprobs), rollout_logprobs=cut(x.rollout_logprobs),
                   advantages=cut(x.advantages), mask=cut(x.mask), weights=cut(x.weights),
                   correction=cut(x.correction), ref_logprobs=cut(x.ref_logprobs), seq_index=cut(x.seq_index))


def _closed_form(objective: Any, logp: torch.Tensor, ent: torch.Tensor, x: Any):
    out = objective.closed_form(logp, ent, x)
    return out.value.float(), out.d_logprobs.float(), out.d_entropy.float()


_COMPILED: dict[str, Any] = {}


def _compiled_closed_form():
    """:func:`_closed_form` through ``torch.compile`` (dynamic shapes: one compile serves every
    chunk size), built on first use. A failing compile is an error naming the setting that runs
    the objective eagerly instead."""
    if "closed_form" not in _COMPILED:
        compiled = torch.compile(_closed_form, dynamic=True)

        def closed_form(objective, logp, ent, x):
            try:
                return compiled(objective, logp, ent, x)
            except Exception as exc:
                raise RuntimeError(
                    f"rlcore-fused: torch.compile of the loss objective failed ({type(exc).__name__}: {exc}); "
                    "set fused.loss_compile_objective: false to evaluate it eagerly"
                ) from exc
        _COMPILED["closed_form"] = closed_form
    return _COMPILED["closed_form"]


def fused_loss(inp: HeadInput, kernels: Any) -> HeadOutput:
    """The fused-loss path (``Cap.FUSED_LOSS``): ``inp.loss`` evaluated inside the head, the
    gradients of hidden states and weight formed in this forward with three GEMMs per token
    chunk (the backend's ``loss_grads``); log-probs and entropy come back detached."""
    req = inp.loss
    h, mask = check_head_input(inp)
    vocab: VocabShard = inp.vocab
    group = vocab.group
    if group_size(group) > 1 and not inp.sequence_parallel:
        h = copy_to_group(h, group)  # identity forward; sums the ranks' partial dX in backward
    T = h.shape[0]
    dev = h.device
    loss_mask = req.inputs.mask.to(dev, torch.bool)
    keep = loss_mask if mask is None else (mask & loss_mask)
    all_labels = inp.labels.to(dev)
    # the label check rides on the compaction's host sync (queued before it, read after it), so
    # the call takes no second sync after its kernels (the GPU would idle through the host's tail)
    bad_any = (keep & ((all_labels < 0) | (all_labels >= vocab.vocab_size))).any()
    idx = keep.nonzero().squeeze(1)
    if bool(bad_any):
        labels = all_labels.index_select(0, idx)
        bad = (labels < 0) | (labels >= vocab.vocab_size)
        raise BatchShapeError(
            f"labels at unmasked positions must be in [0, {vocab.vocab_size}); found {labels[bad][:4].tolist()}"
        )
    n = idx.numel()
    labels = all_labels if n == T else all_labels.index_select(0, idx)
    temp = inp.temperature
    if isinstance(temp, torch.Tensor) and temp.dim() > 0:
        inv_temp = 1.0 / temp.to(dev, torch.float32).index_select(0, idx)
    else:
        t = float(temp)
        if t <= 0:
            raise ValueError(f"temperature must be > 0, got {t}")
        inv_temp = torch.full((n,), 1.0 / t, dtype=torch.float32, device=dev)
    objective = req.objective
    dense = n == T  # every token carries loss: no compaction copies
    # the objective's inputs compacted once; each chunk takes a slice of them (views, no copies)
    compact = req.inputs if dense else req.inputs_at(idx)

    config = getattr(kernels, "config", None)
    closed_form = _compiled_closed_form() if (dev.type == "cuda" and getattr(config, "loss_compile_objective", True)) \
        else _closed_form

    def closed(lo: int, hi: int, logp: torch.Tensor, ent: torch.Tensor):
        return closed_form(objective, logp, ent, req.inputs_for(_token_slice(compact, lo, hi), logp))

    with torch.no_grad():
        res = kernels.loss_grads(h.detach() if dense else h.detach().index_select(0, idx),
                                 inp.weight.detach()[: vocab.valid_rows], labels - vocab.start, inv_temp, group, closed,
                                 shard_rows=inp.weight.shape[0])
        dx = res.dx.to(h.dtype) if dense else \
            torch.zeros(h.shape, dtype=h.dtype, device=dev).index_copy_(0, idx, res.dx.to(h.dtype))
        dw = res.dw
        if dw.shape[0] != inp.weight.shape[0]:  # padding rows get an exact-zero gradient
            full = torch.zeros_like(inp.weight)
            full[: dw.shape[0]] = dw
            dw = full
        if dense:
            lp, ent = res.logprobs, res.entropy
        else:
            zeros = torch.zeros(T, dtype=torch.float32, device=dev)
            lp = zeros.index_put((idx,), res.logprobs)
            ent = zeros.index_put((idx,), res.entropy)
    loss = _PrecomputedLoss.apply(res.loss, h, inp.weight, dx, dw, kernels)
    return HeadOutput(logprobs=lp, entropy=ent if inp.compute_entropy else None, loss=loss)


def fused_logprobs(inp: HeadInput, kernels: Any) -> HeadOutput:
    """Run the fused head with the given backend kernels (see module docstring).

    Host syncs: one for the input checks (labels in range, every target found in a vocab shard),
    taken after the kernels are queued, plus one for the mask's compaction when there is a mask.
    Out-of-range labels are harmless to the kernels (they only compare them with column ids).
    """
    h, mask = check_head_input(inp)
    vocab: VocabShard = inp.vocab
    group = vocab.group
    if group_size(group) > 1 and not inp.sequence_parallel:
        h = copy_to_group(h, group)  # identity forward; sums the ranks' partial dX in backward
    T = h.shape[0]
    idx = None if mask is None else mask.nonzero().squeeze(1)
    n = T if idx is None else idx.numel()
    dense = n == T
    labels = inp.labels.to(h.device)
    labels = labels if dense else labels.index_select(0, idx)
    temp = inp.temperature
    if isinstance(temp, torch.Tensor) and temp.dim() > 0:
        t = temp.to(h.device, torch.float32)
        inv_temp = 1.0 / (t if dense else t.index_select(0, idx))
    else:
        t = float(temp)
        if t <= 0:
            raise ValueError(f"temperature must be > 0, got {t}")
        inv_temp = torch.full((n,), 1.0 / t, dtype=torch.float32, device=h.device)
    want_sq = inp.compute_sum_pi_squared
    if n == 0:
        zeros = torch.zeros(T, dtype=torch.float32, device=h.device)
        return HeadOutput(logprobs=zeros + h.sum() * 0.0 + inp.weight.sum() * 0.0,
                          entropy=zeros.clone() if inp.compute_entropy else None,
                          sum_pi_squared=zeros.clone() if want_sq else None)
    x = h if dense else h.index_select(0, idx)
    lp, ent, target_missing, sq = _FusedLogprobEntropy.apply(
        x, inp.weight, labels - vocab.start, inv_temp, vocab.valid_rows, group, inp.compute_entropy, kernels, want_sq,
    )
    bad = (labels < 0) | (labels >= vocab.vocab_size)
    bad_labels, missing = torch.stack([bad.any(), target_missing]).tolist()
    if bad_labels:
        raise BatchShapeError(
            f"labels at unmasked positions must be in [0, {vocab.vocab_size}); found {labels[bad][:4].tolist()}"
        )
    if missing:
        raise BatchShapeError(
            "some target ids lie in no rank's vocabulary shard: the tensor-parallel ranks' VocabShard "
            f"ranges must together cover [0, {vocab.vocab_size})"
        )
    if not dense:
        zeros = torch.zeros(T, dtype=torch.float32, device=h.device)
        lp = zeros.index_put((idx,), lp)
        ent = zeros.index_put((idx,), ent) if inp.compute_entropy else None
        sq = zeros.index_put((idx,), sq.detach()) if want_sq else None
    else:
        ent = ent if inp.compute_entropy else None
        sq = sq.detach() if want_sq else None
    return HeadOutput(logprobs=lp, entropy=ent, sum_pi_squared=sq)


@dataclass
class FusedHead:
    """The ``fused`` forward_fn.

    ``backend``: ``auto`` (Triton for CUDA tensors, chunked torch for CPU tensors), ``triton``
    or ``torch``. ``chunk_tokens`` bounds the torch backend's logits block; ``triton_config``
    tunes the Triton backend (tile shapes, backward chunk size, TMA).
    """

    backend: str = "auto"
    chunk_tokens: int = 2048
    triton_config: Any = None
    _torch: TorchKernels = field(init=False, repr=False)
    _triton: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"fused.backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        self._torch = TorchKernels(chunk_tokens=self.chunk_tokens)

    def kernels_for(self, device: torch.device):
        """The backend kernels for tensors on ``device`` (raises when the choice cannot run)."""
        kind = self.backend
        if kind == "auto":
            if device.type == "cuda":
                kind = "triton"
            elif device.type == "cpu":
                kind = "torch"
            else:
                raise FusedBackendError(
                    f"fused.backend=auto has no kernel for {device.type} tensors: set fused.backend=torch "
                    "to use the chunked torch path there"
                )
        if kind == "torch":
            return self._torch
        return self._triton_kernels(device)

    def _triton_kernels(self, device: torch.device):
        if self._triton is None:
            try:
                from rlcore_fused.triton_backend import TritonKernels
            except ImportError as exc:
                raise FusedBackendError(
                    f"rlcore-fused: the Triton backend is needed for {device.type} tensors but Triton cannot be "
                    f"imported ({exc}). Install it with `pip install 'rlcore-fused[triton]'`, or set "
                    "fused.backend=torch to run the chunked torch path instead."
                ) from exc
            self._triton = TritonKernels(self.triton_config or TritonConfig())
        return self._triton

    def __call__(self, inp: HeadInput) -> HeadOutput:
        kernels = self.kernels_for(inp.hidden.device)
        if inp.loss is not None and not inp.loss.objective.loss.sequence_level and not inp.compute_sum_pi_squared:
            return fused_loss(inp, kernels)
        # no loss request, a sequence-level loss or Σπ² asked for beside it (declined: core forms
        # the loss from the log-probs)
        return fused_logprobs(inp, kernels)


def torch_head() -> FusedHead:
    """Factory for tests and the 2-process check: the chunked torch backend."""
    return FusedHead(backend="torch", chunk_tokens=16)


def triton_head() -> FusedHead:
    """Factory for tests and the 2-process check: the Triton backend (CPU under TRITON_INTERPRET=1),
    operands through masked pointer loads."""
    return FusedHead(backend="triton", triton_config=TritonConfig(use_tma=False))


def triton_tma_head() -> FusedHead:
    """As :func:`triton_head`, operands through TMA tensor descriptors."""
    return FusedHead(backend="triton", triton_config=TritonConfig(use_tma=True))
