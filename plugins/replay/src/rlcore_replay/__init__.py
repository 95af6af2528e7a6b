"""rlcore-replay: MoE routing replay (R2, R3) for rlcore."""
__version__ = "0.1.0"
