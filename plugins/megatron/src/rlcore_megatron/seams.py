"""rlcore-megatron's public seam: how another plugin adapts the MoE routers that rlcore's router
seam drives (this package's ``__all__`` names this module; its other modules are internal).

rlcore-megatron puts a router seam into every megatron model it builds: each ``TopKRouter``
consults the ``router_hook`` chain (routing replay) through it. A plugin that changes megatron-core
underneath, such as rlcore-npu for MindSpeed, uses two things:

* :func:`add_listener`: ``listener(seam)`` is called with every seam right after an engine
  installs it, before the model runs. The listener may read ``seam.config`` (the model's
  ``TransformerConfig``) and ``seam.sites``, one per MoE router in routed-layer order, each with
  ``router`` (the megatron ``TopKRouter`` module), ``layer`` (0-based decoder layer;
  ``num_hidden_layers + d`` for MTP depth ``d``), ``routed_index``, ``is_mtp``, ``num_experts``
  and ``topk``. It adapts the routers (binding methods their megatron-core lacks) or refuses the
  model by raising an :mod:`rlcore.errors` error; the engine is not built then.
* :func:`reinstall_interception`: megatron-core before 0.16 has no replay hook, so the seam wraps
  the routing function megatron's router module calls. A patcher that replaces that function
  afterwards (MindSpeed's ``apply_patches``, ``repatch``) must call this right after it; until
  then a recording or replaying forward fails rather than routing natively
  (:func:`interception_installed` says whether the wrapper is in place).

This module imports neither torch nor megatron-core at import time.
"""

from __future__ import annotations

import sys

# the registry is its own small module, which the routers notify through: this facade imports the
# routers (lazily), the routers never import this facade
from rlcore_megatron.seam_listeners import add_listener, remove_listener

__all__ = ["add_listener", "interception_installed", "reinstall_interception", "remove_listener"]

ROUTER_MODULE = "megatron.core.transformer.moe.router"

def reinstall_interception() -> bool:
    """Wrap the routing function megatron-core's router module calls now (megatron-core's own, or
    whatever a patcher put there) and put the wrapper in every loaded module holding that function.
    Returns whether it did: not before megatron's router module is loaded (the first seam wraps
    it then), nor where megatron-core has native replay (0.16 and later: nothing is intercepted).
    Idempotent."""
    if ROUTER_MODULE not in sys.modules:
        return False
    from rlcore_megatron.routers import install_interception, native_replay_available

    if native_replay_available():
        return False
    install_interception()
    return True


def interception_installed() -> bool:
    """The routing function megatron-core's router module calls is the seam's wrapper."""
    from rlcore_megatron.routers import interception_installed as installed

    return installed()
