"""rlcore-megatron: the ``megatron`` training engine: a megatron-core ``GPTModel`` (dense, MoE, MTP) under rlcore.

Nothing here imports megatron-core at import time; :mod:`rlcore_megatron.plugin` (the entry point) imports
:mod:`rlcore_megatron.engine` only when the config selects ``engine.name: megatron``.

Modules:

* :mod:`~rlcore_megatron.hf_config` — an HF ``config.json`` → :class:`ModelSpec` (pure
  Python; every unsupported field is an error naming it).
* :mod:`~rlcore_megatron.compat` — what the installed megatron-core can do, detected by
  signatures and attributes, never by version strings.
* :mod:`~rlcore_megatron.weights` — HF ↔ Megatron names (fused QKV, gate/up, experts,
  vocab padding), loading shards and streaming HF tensors with per-tensor TP/EP gathers.
* :mod:`~rlcore_megatron.routers` — the router seam (``router_hook`` in every MoE router).
* :mod:`~rlcore_megatron.engine` — :class:`MegatronEngine` itself.
* :mod:`~rlcore_megatron.cpu` — the CPU shim (gloo, no CUDA RNG tracker).
* :mod:`~rlcore_megatron.settings` — the ``megatron:`` config section.
* :mod:`~rlcore_megatron.plugin` — the entry point: the ``engine`` provider and the section.

The GPU smoke run lives with the benchmarks (``plugins/megatron/bench/gpu_smoke.py``).
"""
