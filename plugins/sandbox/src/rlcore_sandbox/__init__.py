"""rlcore-sandbox: the code-execution tool ``python`` for rlcore's ``tools`` environment, the model's
code run under bubblewrap and a seccomp filter (:mod:`rlcore_sandbox.sandbox`)."""
__version__ = "0.1.0"
