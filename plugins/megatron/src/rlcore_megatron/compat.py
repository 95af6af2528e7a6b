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
config fields                  ``dataclasses.fields(TransformerConfig)``: a field rlcore needs
                               and the installed version lacks is an error naming it
constructor arguments          each builder gets only the keyword arguments it declares
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


def call_with_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it declares (optional features of newer
    versions are simply not passed to older ones)."""
    names, var_kw = _params(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    if not var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return fn(*args, **kwargs)


def transformer_config(required: dict[str, Any], optional: dict[str, Any]) -> Any:
    """A ``TransformerConfig`` from ``required`` fields (missing in this megatron-core: an
    error naming the field) and ``optional`` ones (set only where the field exists)."""
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


def mtp_inner_layer(mtp_layer: Any) -> Any:
    """The transformer layer inside a ``MultiTokenPredictionLayer``."""
    for name in ("mtp_model_layer", "transformer_layer"):
        inner = getattr(mtp_layer, name, None)
        if inner is not None:
            return inner
    raise ConfigError("this megatron-core's MultiTokenPredictionLayer has no inner transformer layer rlcore knows")
