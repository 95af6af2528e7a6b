"""rlcore-mtp: multi-token-prediction training for rlcore."""
__version__ = "0.1.0"
