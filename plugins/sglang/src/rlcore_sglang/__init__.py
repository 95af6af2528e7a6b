"""rlcore-sglang: SGLang as rlcore's rollout backend, and the weight syncs that feed it.

Importing this package imports neither torch nor SGLang; the backend and the syncs import what
they need when a run selects them.
"""

__version__ = "0.1.0"
