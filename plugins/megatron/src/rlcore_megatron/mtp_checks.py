"""Checks of the MTP training path against the installed megatron-core, shared by the CPU tests
(plugins/megatron/tests/test_megatron_mtp.py, 0.12.1 and 0.16.1) and the GPU script
(plugins/megatron/bench/gpu_mtp.py, 0.19). The engine never imports this module.

* :func:`mtp_loss_exactly_once`: one forward/backward of a policy loss plus rlcore's MTP loss
  through the engine, with spies on every place megatron-core computes, logs or attaches its own
  MTP loss (:class:`MegatronMTPSpies`; ``MTPLossAutoScaler.backward`` runs exactly when its node
  is in the graph being back-propagated), a walk of the autograd graph for ``MTPLossAutoScaler``,
  and the MTP layers' gradient compared with the gradient of rlcore's MTP loss alone.
* :func:`native_mtp_loss_control`: the same comparison through megatron-core's native MTP loss
  path of this version (chosen by signature), which must show a second loss: it proves the
  first check can fail.
* :func:`mtp_gradient_owners`: which parameters receive gradient from the MTP loss under
  ``detach_trunk`` / ``detach_head``.

:func:`rlcore_mtp_loss` is the ``rlcore-mtp`` plugin's own MTP loss term, from its public
:mod:`rlcore_mtp.loss`: rlcore-mtp comes with this package's ``mtp`` extra
(``pip install 'rlcore-megatron[mtp]'``; the megatron suites and the GPU script install it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

#: (module, class or None, attribute): where megatron-core computes, logs or attaches its own MTP
#: loss, on any version (entries a version lacks are skipped)
MEGATRON_MTP_LOSS_SITES: tuple[tuple[str, str | None, str], ...] = (
    ("megatron.core.transformer.multi_token_prediction", "MTPLossAutoScaler", "forward"),
    # run by autograd when the node is in the graph being back-propagated
    ("megatron.core.transformer.multi_token_prediction", "MTPLossAutoScaler", "backward"),
    ("megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionBlock", "forward"),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper", "save_loss_to_tracker"),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper", "save_metrics_to_tracker"),
    ("megatron.core.transformer.multi_token_prediction", None, "process_mtp_loss"),
    ("megatron.core.models.gpt.gpt_model", None, "process_mtp_loss"),
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "compute_language_model_loss"),
)


class MegatronMTPSpies(contextlib.AbstractContextManager):
    """Count calls of :data:`MEGATRON_MTP_LOSS_SITES` while active (``calls``: name → count;
    static methods stay static). Everything is restored on exit."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._restore: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> MegatronMTPSpies:
        for module_name, cls_name, attr in MEGATRON_MTP_LOSS_SITES:
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:
                continue
            if cls_name is not None:
                owner = getattr(owner, cls_name, None)
            if owner is None or attr not in vars(owner):
                continue
            raw = inspect.getattr_static(owner, attr)
            label = f"{cls_name}.{attr}" if cls_name else attr
            self._restore.append((owner, attr, raw))
            setattr(owner, attr, self._wrap(raw, label))
        return self

    def _wrap(self, raw: Any, label: str) -> Any:
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[label] += 1
            return fn(*args, **kwargs)

        if isinstance(raw, staticmethod):
            return staticmethod(counted)
        if isinstance(raw, classmethod):
            return classmethod(counted)
        return counted

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, raw in reversed(self._restore):
            setattr(owner, attr, raw)
        self._restore.clear()


def autograd_node_names(t: torch.Tensor) -> set[str]:
    """Type names of every node of ``t``'s autograd graph.

    Python objects of autograd nodes are made on access and freed when dropped, so an ``id``
    can be reused by another node's object: every visited object is kept alive until the walk
    ends (a walk that dropped them once skipped part of the graph on the GPU machine)."""
    names: set[str] = set()
    seen: set[int] = set()
    alive: list[Any] = []
    stack = [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        alive.append(fn)
        seen.add(id(fn))
        names.add(type(fn).__name__)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return names


def rlcore_mtp_loss(batch: Any, engine_output: Any, head_weight: Any, forward_fn: Callable[..., Any] | None = None,
                    detach_head: bool = False, scale: float = 0.1) -> torch.Tensor:
    """The MTP loss term of the ``rlcore-mtp`` plugin itself (``rlcore_mtp.loss.mtp_postprocess``:
    labels rolled per depth inside each packed sequence, masked positions excluded, the given
    forward_fn, ``mtp.loss_scale = scale``) for one micro-batch that is the whole step."""
    from rlcore.heads import reference_logprobs
    from rlcore.types import ModelOutput
    from rlcore_mtp.loss import mtp_postprocess

    ctx = SimpleNamespace(batch=batch, phase="train", num_tokens_in_step=int(batch.loss_mask.sum()))
    output = ModelOutput(engine=engine_output, head=None, head_weight=head_weight,
                         forward_fn=forward_fn or reference_logprobs)
    settings = SimpleNamespace(loss_scale=scale, detach_head=detach_head, depths=0)
    return mtp_postprocess(ctx, output, settings).loss_terms["mtp"]


def _policy_loss(batch: Any, hidden: torch.Tensor, head_weight: Any) -> torch.Tensor:
    from rlcore.heads import reference_logprobs
    from rlcore.types import HeadInput

    mask = batch.loss_mask.to(hidden.device)
    lp = reference_logprobs(HeadInput(hidden=hidden, weight=head_weight.weight, labels=batch.labels().to(hidden.device),
                                      vocab=head_weight.vocab, loss_mask=mask)).logprobs
    return -(lp * mask).sum() / mask.sum().clamp(min=1)


def _mtp_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.named_parameters() if n.startswith("mtp.")]


def _compare(params: list[tuple[str, torch.nn.Parameter]], alone: tuple[torch.Tensor | None, ...]) -> dict[str, Any]:
    worst, biggest, with_grad = 0.0, 0.0, 0
    for (_, p), a in zip(params, alone, strict=True):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        a = a if a is not None else torch.zeros_like(p)
        worst = max(worst, float((g - a).abs().max()))
        biggest = max(biggest, float(g.abs().max()))
        with_grad += int(bool((g != 0).any()))
    return {"max_abs_grad_diff_vs_rlcore_alone": worst, "max_abs_mtp_grad": biggest,
            "mtp_params_with_grad": with_grad}


def mtp_loss_exactly_once(engine: Any, batch: Any, scale: float = 0.1,
                          forward_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """One training forward/backward (policy loss + ``scale`` × rlcore's MTP loss) through the
    engine; see the module docstring. The engine's gradients are cleared afterwards."""
    engine.train(True)
    engine.zero_grad()
    batch = batch.to(engine.device)  # as the trainer hands it over
    params = _mtp_params(engine)
    with MegatronMTPSpies() as spies:
        out = engine.forward(batch, mtp_hidden=True)
        hw = engine.head()
        mtp = rlcore_mtp_loss(batch, out, hw, forward_fn, scale=scale)
        alone = torch.autograd.grad(mtp, [p for _, p in params], retain_graph=True, allow_unused=True)
        total = _policy_loss(batch, out.hidden, hw) + mtp
        nodes = autograd_node_names(total)
        total.backward()
    report = {"megatron_calls": {k: v for k, v in spies.calls.items() if v},
              "autoscaler_in_graph": "MTPLossAutoScalerBackward" in nodes, "mtp_loss": float(mtp.detach())}
    report.update(_compare(params, alone))
    engine.zero_grad()
    return report


def native_mtp_loss_control(engine: Any, seq: list[int], scale: float = 0.1) -> dict[str, Any]:
    """Megatron-core's native MTP loss path on this version, over one sequence, fed the engine's
    own trunk and MTP hidden states, plus rlcore's MTP loss: returns what
    :func:`mtp_loss_exactly_once` measures. The path is chosen by signature:

    * ``MultiTokenPredictionBlock.forward`` takes ``labels`` (0.12/0.13): the block's forward
      with labels (it reruns the MTP layers and attaches its loss to the main hidden states);
    * else ``GPTModel._postprocess`` with ``config.mtp_num_layers = 1`` (0.14+), passed
      ``labels=None`` where ``process_mtp_loss`` takes ``input_ids`` (0.19: it derives the
      labels), else the labels.
    """
    from megatron.core.transformer import multi_token_prediction as mtpm
    from rlcore.batch import PackedBatch

    from rlcore_megatron import compat

    dev = engine.device
    engine.train(True)
    engine.zero_grad()
    batch = PackedBatch.pack([seq], [1]).to(dev)  # one unpadded row: megatron's plain roll is right for it
    ids = torch.tensor([seq], device=dev)
    pos = torch.arange(len(seq), device=dev)[None]
    labels = batch.labels()[None].to(dev)
    mask = batch.loss_mask[None].float().to(dev)
    captured: dict[str, Any] = {}
    handle = engine.model.decoder.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    try:
        out = engine.forward(batch, mtp_hidden=True)
    finally:
        handle.remove()
    hw = engine.head()
    params = _mtp_params(engine)
    mtp = rlcore_mtp_loss(batch, out, hw, scale=scale)
    alone = torch.autograd.grad(mtp, [p for _, p in params], retain_graph=True, allow_unused=True)
    h, m = out.hidden[:, None], out.mtp_hidden[0][:, None]
    tied = engine.spec.tie_word_embeddings
    output_weight = engine.model.shared_embedding_or_output_weight() if tied else None
    cfg = engine.model.config
    saved = (getattr(cfg, "mtp_num_layers", None), getattr(cfg, "mtp_loss_scaling_factor", None))
    with MegatronMTPSpies() as spies:
        if compat.accepts(mtpm.MultiTokenPredictionBlock.forward, "labels"):
            path = "MultiTokenPredictionBlock.forward(labels=...)"
            main = mtpm.MultiTokenPredictionBlock.forward(
                engine.mtp, input_ids=ids, position_ids=pos, hidden_states=h,
                attention_mask=captured.get("attention_mask"), labels=labels, rotary_pos_emb=captured.get("rotary_pos_emb"),
                loss_mask=mask, embedding=engine.model.embedding, output_layer=engine.model.output_layer,
                output_weight=output_weight, compute_language_model_loss=engine.model.compute_language_model_loss)
            policy = _policy_loss(batch, main[:, 0], hw)
        else:
            derive = compat.accepts(getattr(mtpm, "process_mtp_loss", lambda: None), "input_ids")
            path = ("GPTModel._postprocess(labels=None): process_mtp_loss derives labels from input_ids" if derive
                    else "GPTModel._postprocess(labels=...)")
            cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor = 1, scale
            try:
                res = compat.call_with_supported(
                    engine.model._postprocess, hidden_states=torch.cat([h, m]), input_ids=ids, position_ids=pos,
                    labels=None if derive else labels, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                    mtp_in_postprocess=False, loss_mask=mask)
            finally:
                cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor = saved
            if derive:  # logits [b, s, V]: the policy's log-likelihood from them
                logp = torch.log_softmax(res[0].float(), -1).gather(1, labels[0, :, None].clamp(min=0))[:, 0]
                policy = -(logp * mask[0]).sum() / mask.sum()
            else:  # the per-token loss [b, s]
                policy = (res * mask).sum() / mask.sum()
        total = policy + mtp
        nodes = autograd_node_names(total)
        total.backward()
    report = {"path": path, "megatron_calls": {k: v for k, v in spies.calls.items() if v},
              "autoscaler_in_graph": "MTPLossAutoScalerBackward" in nodes}
    report.update(_compare(params, alone))
    engine.zero_grad()
    return report


def _owner(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "head"
    return "trunk"


def mtp_gradient_owners(engine: Any, batch: Any, *, detach_trunk: bool, detach_head: bool,
                        forward_fn: Callable[..., Any] | None = None) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """Backward of rlcore's MTP loss alone: the parameters with a non-zero gradient, grouped as
    ``mtp`` / ``trunk`` (decoder) / ``embedding`` / ``head`` (untied output layer), and the MTP
    layers' gradients. The engine's gradients are cleared before and after."""
    engine.train(True)
    engine.zero_grad()
    batch = batch.to(engine.device)
    out = engine.forward(batch, mtp_hidden=True, mtp_detach_trunk=detach_trunk)
    rlcore_mtp_loss(batch, out, engine.head(), forward_fn, detach_head=detach_head).backward()
    owners: dict[str, list[str]] = {"mtp": [], "trunk": [], "embedding": [], "head": []}
    mtp_grads = {}
    for name, p in engine.named_parameters():
        if p.grad is not None and bool((p.grad != 0).any()):
            owners[_owner(name)].append(name)
        if name.startswith("mtp.") and p.grad is not None:
            mtp_grads[name] = p.grad.detach().clone()
    engine.zero_grad()
    return owners, mtp_grads
