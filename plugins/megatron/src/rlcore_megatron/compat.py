"""What the installed megatron-core can do, found by signatures and attributes.

rlcore supports megatron-core 0.12.1 through the newest release without reading a version
string: each difference the engine depends on is detected where it matters.

=============================  ===============================================================
difference                     how it is detected
=============================  ===============================================================
head seam                      ``output_processor`` in ``GPTModel.forward``'s signature (0.18+);
                               older: ``output_layer.forward`` replaced on the instance for
                               the duration of one call (:func:`head_seam`)
router seam                    ``router_replay`` in ``topk_routing_with_score_function``'s
                               signature (0.16+); see :mod:`.routers`
MTP layer's inner layer        attribute ``mtp_model_layer`` (0.19) or ``transformer_layer``
megatron's own MTP loss        never reachable (:func:`refuse_native_mtp_loss`): checked on the
                               built model's attributes, not on a version
config fields                  ``dataclasses.fields(TransformerConfig)``: a field rlcore needs
                               and the installed version lacks is an error naming it
constructor arguments          each builder gets the keyword arguments it declares; one it
                               does not declare is left out only if it is in
                               :data:`DROPPABLE_KWARGS` (it cannot change the model), else an
                               error naming the builder, the argument and the version
Transformer Engine             ``import transformer_engine`` (THD packing needs it)
=============================  ===============================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rlcore.errors import ConfigError


@functools.cache
def _params(fn: Callable) -> tuple[frozenset[str], bool]:
    sig = inspect.signature(fn)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return frozenset(sig.parameters), var_kw


def accepts(fn: Callable, name: str) -> bool:
    names, _ = _params(fn)
    return name in names


#: Keyword arguments :func:`call_with_supported` may leave out where the installed megatron-core
#: does not declare them, because leaving them out does not change what the model computes
#: (every other argument rlcore passes shapes the model: a version without it is an error, not a
#: model built another way):
#:
#: * ``pg_collection`` (``MultiTokenPredictionBlock``, ``GPTModel``; 0.19+): the process groups,
#:   passed explicitly on versions that take them; older versions read the same groups from
#:   ``parallel_state``, which :func:`rlcore_megatron.model.init_parallel` initialised.
#: * ``vp_stage`` / ``pp_rank`` (0.14+ specs): virtual-pipeline placement; rlcore runs one stage.
#: * ``rotary_pos_cos`` / ``rotary_pos_sin`` / ``sequence_len_offset`` (a transformer layer's
#:   forward): flash-decoding inference inputs, ``None`` in training; left out only when None.
DROPPABLE_KWARGS = frozenset({"pg_collection", "vp_stage", "pp_rank"})
DROPPABLE_WHEN_NONE = frozenset({"rotary_pos_cos", "rotary_pos_sin", "sequence_len_offset"})


def _version() -> str:
    try:
        import megatron.core as mc

        return str(getattr(mc, "__version__", "?"))
    except Exception:  # noqa: BLE001 - for a message only
        return "?"


def call_with_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it declares. An argument it does not declare is
    left out when it cannot change the model (:data:`DROPPABLE_KWARGS`, or
    :data:`DROPPABLE_WHEN_NONE` with the value ``None``); any other is a
    :class:`~rlcore.errors.ConfigError` naming ``fn``, the argument and the megatron-core
    version: a model built without it would silently be another model."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    names, var_kw = _params(target)
    if var_kw:
        return fn(*args, **kwargs)
    unknown = [k for k in kwargs if k not in names]
    refused = [k for k in unknown
               if k not in DROPPABLE_KWARGS and not (k in DROPPABLE_WHEN_NONE and kwargs[k] is None)]
    if refused:
        what = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        raise ConfigError(
            f"megatron-core {_version()}'s {what} does not accept {', '.join(refused)}, which rlcore needs to "
            f"build this model as configured (leaving it out would build another model); use a megatron-core "
            f"release that has it", key="engine.model"
        )
    return fn(*args, **{k: v for k, v in kwargs.items() if k in names})


def transformer_config(required: dict[str, Any], optional: dict[str, Any]) -> Any:
    """A ``TransformerConfig`` from ``required`` fields (missing in this megatron-core: an
    error naming the field) and ``optional`` ones (set only where the field exists). Only
    fields whose absence cannot change the model may be optional: today the fused-kernel
    switches ``moe_router_fusion`` / ``moe_permute_fusion`` (a version without the field has no
    such kernel) and ``moe_enable_routing_replay`` (without it rlcore's router seam replays,
    :mod:`.routers`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    have = {f.name for f in dataclasses.fields(TransformerConfig)}
    missing = sorted(k for k in required if k not in have)
    if missing:
        import megatron.core as mc

        raise ConfigError(
            f"megatron-core {getattr(mc, '__version__', '?')} has no TransformerConfig field(s) "
            f"{', '.join(missing)}, which this model needs", key="engine.model"
        )
    kw = dict(required)
    kw.update({k: v for k, v in optional.items() if k in have})
    return TransformerConfig(**kw)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        return False
    return True


def has_output_processor(model: Any) -> bool:
    return accepts(type(model).forward, "output_processor")


def _hidden_states_out(hidden_states: Any, **_: Any) -> Any:
    return hidden_states


@contextlib.contextmanager
def head_seam(model: Any) -> Iterator[Callable[..., Any]]:
    """Run ``GPTModel.forward`` so that it returns the decoder's final hidden states instead
    of logits; yields the callable to run it with (keyword ``output_processor`` on 0.18+).

    The returned hidden states are ``[s, b, h]`` on every version. On versions without the
    output-processor hook, ``output_layer.forward`` of *this instance* returns its input for
    the duration of the block (``_postprocess`` then returns ``input.transpose(0, 1)``, which
    the runner transposes back); nothing else is touched and the class is never modified.
    """
    if has_output_processor(model):

        def run(*args: Any, **kwargs: Any) -> Any:
            return model(*args, output_processor=_hidden_states_out, **kwargs)

        yield run
        return

    layer = model.output_layer

    def identity_output_layer(input_: Any, weight: Any = None, runtime_gather_output: Any = None, **_: Any):
        return input_, None

    def run(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs).transpose(0, 1)

    layer.forward = identity_output_layer
    try:
        yield run
    finally:
        del layer.forward  # back to the class's forward


def refuse_native_mtp_loss(model: Any, mtp_block: Any) -> None:
    """Make megatron-core's own MTP loss unreachable, so rlcore's MTP loss (a ``postprocess``
    plugin) is the only one. Where megatron adds it, by version:

    * 0.12/0.13: ``MultiTokenPredictionBlock.forward`` computes the loss from ``labels`` and
      attaches it to the main hidden states with ``MTPLossAutoScaler``;
    * 0.14-0.16: ``GPTModel._postprocess`` does, whenever ``config.mtp_num_layers`` is set;
    * 0.17+: ``process_mtp_loss``, called by ``_postprocess`` when ``config.mtp_num_layers`` is
      set; from 0.19 it derives labels from ``input_ids`` when ``labels`` is None, so passing
      no labels no longer skips it.

    The engine builds the ``GPTModel`` without MTP (``mtp_num_layers`` unset, no ``mtp``
    submodule: checked here, on attributes every version has) and runs the MTP layers itself;
    the block beside it is only a container of layers, and calling its ``forward`` raises."""
    from rlcore.errors import RLCoreError

    if getattr(model.config, "mtp_num_layers", None) or getattr(model, "mtp_process", False) \
            or isinstance(getattr(model, "mtp", None), torch.nn.Module):
        raise RLCoreError(
            "the megatron GPTModel was built with MTP layers (config.mtp_num_layers or a .mtp block): its "
            "forward would add megatron-core's own MTP loss on top of rlcore's"
        )
    if mtp_block is None:
        return

    def never(*_: Any, **__: Any) -> Any:
        raise RLCoreError(
            "MultiTokenPredictionBlock.forward was called: it computes megatron-core's own MTP loss (0.12/0.13) "
            "or feeds GPTModel._postprocess, which adds it; rlcore runs the MTP layers itself "
            "(MegatronEngine._run_mtp) and adds only its own MTP loss"
        )

    mtp_block.forward = never  # this instance only; the class is not modified


def mtp_inner_layer(mtp_layer: Any) -> Any:
    """The transformer layer inside a ``MultiTokenPredictionLayer``."""
    for name in ("mtp_model_layer", "transformer_layer"):
        inner = getattr(mtp_layer, name, None)
        if inner is not None:
            return inner
    raise ConfigError("this megatron-core's MultiTokenPredictionLayer has no inner transformer layer rlcore knows")
