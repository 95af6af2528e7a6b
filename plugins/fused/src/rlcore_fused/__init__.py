"""rlcore-fused: a Triton log-prob + entropy LM head for rlcore, registered as forward_fn ``fused``.

Importing this package (or :mod:`rlcore_fused.plugin`, the entry point) imports neither torch
nor Triton; the head's factory does.
"""

__version__ = "0.1.0"
