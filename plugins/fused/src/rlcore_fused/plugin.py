"""The plugin module named by the entry point ``fused = "rlcore_fused.plugin"``.

It registers the ``fused`` forward_fn and the ``fused:`` config section. It stays cheap to import
(``rlcore plugins`` lists it without loading torch or Triton): the factory imports the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, ForwardFnSpec, PluginSettings

__all__ = ["PLUGIN_API", "CAPABILITIES", "FusedSettings", "forward_fn", "plugin_settings"]

#: what both backends implement (and the conformance suites check)
CAPABILITIES = frozenset({
    Cap.ENTROPY,
    Cap.PER_TOKEN_TEMPERATURE,
    Cap.VOCAB_PARALLEL,
    Cap.SEQUENCE_PARALLEL,
    Cap.MASK_SKIPS_COMPUTE,
    Cap.FUSED_LOSS,
})


@dataclass
class FusedSettings:
    """The ``fused:`` config section.

    * ``backend``: ``auto`` (Triton on CUDA tensors, chunked torch on CPU tensors), ``triton``
      or ``torch``. A CUDA device without a working Triton is an error under ``auto``, not a
      silent switch to torch.
    * ``chunk_tokens``: tokens per logits block of the torch backend.
    * ``backward_chunk_mib``: the Triton backward's ∂L/∂logits buffer, which sets how many vocab
      rows each backward chunk covers (memory vs. GEMM size).
    * ``loss_chunk_mib``, ``loss_dw_fp32``: the fused-loss path (``Cap.FUSED_LOSS``, train phase):
      the fp32 logits chunk (tokens per chunk) and whether dW is summed over chunks in fp32.
    """

    backend: str = "auto"
    chunk_tokens: int = 2048
    backward_chunk_mib: int = 512
    #: fused-loss path (train phase): the fp32 logits chunk of the Triton backend
    loss_chunk_mib: int = 768
    #: fused-loss path: sum dW over token chunks in fp32 (exact parity with the log-prob head's dW
    #: accuracy; 4·V·H bytes more, +8 % time at T=16384)
    loss_dw_fp32: bool = False


@hookimpl
def plugin_settings():
    return PluginSettings(section="fused", schema=FusedSettings)


def build_head(ctx):
    """``ForwardFnSpec.factory``: the configured :class:`rlcore_fused.head.FusedHead`."""
    from rlcore_fused.head import FusedHead
    from rlcore_fused.tuning import TritonConfig

    settings = getattr(ctx, "settings", None) or FusedSettings()
    return FusedHead(
        backend=str(settings.backend),
        chunk_tokens=int(settings.chunk_tokens),
        triton_config=TritonConfig(chunk_mib=int(settings.backward_chunk_mib),
                                   loss_chunk_mib=int(getattr(settings, "loss_chunk_mib", 768)),
                                   loss_dw_fp32=bool(getattr(settings, "loss_dw_fp32", False))),
    )


@hookimpl
def forward_fn():
    yield ForwardFnSpec(
        name="fused",
        factory=build_head,
        capabilities=CAPABILITIES,
        description="Triton log-prob + entropy LM head (fp32 statistics, no [T, V] logits); chunked torch on CPU",
    )
