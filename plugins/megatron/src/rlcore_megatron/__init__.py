"""The ``megatron`` training engine: a megatron-core ``GPTModel`` (dense, MoE, MTP) under rlcore.

Nothing here imports megatron-core at import time; :mod:`rlcore.builtin.megatron` imports
:mod:`rlcore.engines.megatron.engine` only when the config selects ``engine.name: megatron``.

Modules:

* :mod:`~rlcore.engines.megatron.hf_config` — an HF ``config.json`` → :class:`ModelSpec` (pure
  Python; every unsupported field is an error naming it).
* :mod:`~rlcore.engines.megatron.compat` — what the installed megatron-core can do, detected by
  signatures and attributes, never by version strings.
* :mod:`~rlcore.engines.megatron.weights` — HF ↔ Megatron names (fused QKV, gate/up, experts,
  vocab padding), loading shards and streaming HF tensors with per-tensor TP/EP gathers.
* :mod:`~rlcore.engines.megatron.routers` — the router seam (``router_hook`` in every MoE router).
* :mod:`~rlcore.engines.megatron.engine` — :class:`MegatronEngine` itself.
* :mod:`~rlcore.engines.megatron.cpu` — the CPU shim (gloo, no CUDA RNG tracker).
* :mod:`~rlcore.engines.megatron.settings` — the ``megatron:`` config section.
* :mod:`~rlcore.engines.megatron.gpu_smoke` — the GPU machine's smoke run (scripts/gpu/megatron_019.sh).
"""
