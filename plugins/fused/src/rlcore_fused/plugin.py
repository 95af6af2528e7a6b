"""The plugin module named by the entry point ``fused = "rlcore_fused.plugin"``.

It registers the ``fused`` forward_fn and the ``fused:`` config section. It stays cheap to import
(``rlcore plugins`` lists it without loading torch or Triton): the factory imports the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, ForwardFnSpec, PluginSettings

from rlcore_fused.tuning import BACKENDS

__all__ = ["PLUGIN_API", "BACKENDS", "CAPABILITIES", "FusedSettings", "forward_fn", "plugin_settings",
           "validate_settings"]

#: what both backends implement (and the conformance suites check)
CAPABILITIES = frozenset({
    Cap.ENTROPY,
    Cap.PER_TOKEN_TEMPERATURE,
    Cap.VOCAB_PARALLEL,
    Cap.SEQUENCE_PARALLEL,
    Cap.MASK_SKIPS_COMPUTE,
    Cap.FUSED_LOSS,
    Cap.SUM_PI_SQUARED,
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
    * ``loss_compile_objective``: the fused-loss path on CUDA runs the objective's closed form
      through ``torch.compile`` (a few fused kernels per chunk instead of ~35 small ones).
    """

    backend: str = "auto"
    chunk_tokens: int = 2048
    backward_chunk_mib: int = 512
    #: fused-loss path (train phase): the fp32 logits chunk of the Triton backend
    loss_chunk_mib: int = 768
    #: fused-loss path: sum dW over token chunks in fp32 (exact parity with the log-prob head's dW
    #: accuracy; 4·V·H bytes more, +8 % time at T=16384)
    loss_dw_fp32: bool = False
    #: fused-loss path on CUDA: torch.compile the objective's closed form (its ~35 small kernels per
    #: half-chunk become a few, which the side stream runs beside the row kernels; measured on an
    #: H100: docs/benchmarks/fused.md)
    loss_compile_objective: bool = True



def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _triton_installed() -> bool:
    """Whether a ``triton`` module can be found (without importing it: the check stays cheap)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["triton"] = None
        return False


def validate_settings(section, config=None) -> None:
    """The ``fused:`` section's checks (``PluginSettings.validate``): what the head would refuse at
    build time or at its first call, refused by ``rlcore check`` with the key named. The checks
    across sections (``engine.device``) apply when ``forward.name`` is ``fused``."""
    from rlcore.errors import ConfigError

    if section.backend not in BACKENDS:
        raise ConfigError(f"bad value for config key 'fused.backend': {section.backend!r}; choose one of: "
                          f"{', '.join(BACKENDS)}", key="fused.backend")
    for key in ("chunk_tokens", "backward_chunk_mib"):
        if section[key] < 1:
            raise ConfigError(f"bad value for config key 'fused.{key}': {section[key]!r}; must be >= 1",
                              key=f"fused.{key}")
    if config is None or config.forward.name != "fused":
        return
    device = str(config.engine.device)
    kind = device.split(":")[0]
    if section.backend == "auto" and kind not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"fused.backend=auto has no kernel for engine.device={device}: set fused.backend=torch "
                          f"to use the chunked torch path there", key="fused.backend")
    # auto on a machine without CUDA: the platform's own refusal (engine.device=cuda but no GPU) is
    # the error to act on first, not a missing Triton the machine could not use anyway
    needs_triton = section.backend == "triton" or (section.backend == "auto" and kind == "cuda" and _cuda_available())
    if needs_triton and not _triton_installed():
        raise ConfigError(f"fused.backend={section.backend} with engine.device={device} needs Triton, which is "
                          f"not installed: `pip install 'rlcore-fused[triton]'`, or set fused.backend=torch",
                          key="fused.backend")
    import os

    if section.backend == "triton" and kind == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError("fused.backend=triton runs on CUDA tensors; with engine.device=cpu use fused.backend=torch "
                          "(or auto), or set TRITON_INTERPRET=1 to run the Triton interpreter", key="fused.backend")


@hookimpl
def plugin_settings():
    return PluginSettings(section="fused", schema=FusedSettings, validate=validate_settings)


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
                                   loss_dw_fp32=bool(getattr(settings, "loss_dw_fp32", False)),
                                   loss_compile_objective=bool(getattr(settings, "loss_compile_objective", True))),
    )


@hookimpl
def forward_fn():
    yield ForwardFnSpec(
        name="fused",
        factory=build_head,
        capabilities=CAPABILITIES,
        description="Triton log-prob + entropy LM head (fp32 statistics, no [T, V] logits); chunked torch on CPU",
    )
