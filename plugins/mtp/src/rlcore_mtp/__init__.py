"""rlcore-mtp: multi-token-prediction training for rlcore.

Public, for other plugins (``__all__``): :mod:`~rlcore_mtp.loss`, the MTP loss term of one
micro-batch (:func:`~rlcore_mtp.loss.mtp_postprocess`), which an engine's own checks call to
train its MTP layers exactly as a run does (rlcore-megatron's ``mtp_checks``). The entry point
:mod:`~rlcore_mtp.plugin` is internal.
"""

__all__ = ["loss"]
__version__ = "0.1.0"
