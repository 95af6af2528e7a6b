"""rlcore: a minimal, pluggable core for RL post-training of LLMs (PPO/GRPO family).

Plugins import what they need from here and from :mod:`rlcore.types`::

    from rlcore import hookimpl, PLUGIN_API
    from rlcore.types import ForwardFnSpec, Cap

Importing this package does not import torch or any engine.
"""

from rlcore.hookspecs import hookimpl
from rlcore.types import PLUGIN_API

__version__ = "0.1.0"

__all__ = ["PLUGIN_API", "__version__", "hookimpl"]
