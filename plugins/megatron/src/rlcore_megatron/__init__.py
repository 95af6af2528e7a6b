"""rlcore-megatron: the ``megatron`` training engine, a megatron-core ``GPTModel`` (dense, MoE, MTP)
under rlcore.

Nothing here imports megatron-core at import time; :mod:`rlcore_megatron.plugin` (the entry
point) imports :mod:`rlcore_megatron.engine` only when the config selects ``engine.name: megatron``.

Public, for other plugins (``__all__``): :mod:`~rlcore_megatron.seams`, the router seam's
registration (a listener called with every seam an engine installs) and its re-installation
after a patcher replaced megatron-core's routing function. Every other module is internal.

Modules, each importing only modules listed above it (and rlcore's public modules):

* :mod:`~rlcore_megatron.seams` — the public seam (no torch, no megatron-core).
* :mod:`~rlcore_megatron.settings` — the ``megatron:`` config section, the declared capabilities.
* :mod:`~rlcore_megatron.hf_config` — an HF ``config.json`` → :class:`ModelSpec` (pure
  Python; every unsupported field is an error naming it).
* :mod:`~rlcore_megatron.compat` — what the installed megatron-core can do, detected by
  signatures and attributes, never by version strings.
* :mod:`~rlcore_megatron.cpu` — the CPU shim (gloo, no CUDA RNG tracker).
* :mod:`~rlcore_megatron.weights` — HF ↔ Megatron names (fused QKV, gate/up, experts,
  vocab padding), loading shards and streaming HF tensors with per-tensor TP/EP gathers.
* :mod:`~rlcore_megatron.hf_dir` — HF directories: :class:`HFSource` (read, or a model in
  memory) and :func:`write_hf_dir`.
* :mod:`~rlcore_megatron.routers` — the router seam (``router_hook`` in every MoE router).
* :mod:`~rlcore_megatron.layout` — a packed batch as megatron's input (padded rows or THD) and
  the maps back.
* :mod:`~rlcore_megatron.model` — settings checks, process groups, ``TransformerConfig``,
  the ``GPTModel`` with its MTP block, the router sites.
* :mod:`~rlcore_megatron.engine` — :class:`MegatronEngine` (forward, head, optimizer, export)
  and its factory.
* :mod:`~rlcore_megatron.plugin` — the entry point (imports the engine only in its factory): the ``engine`` provider and the section.

The GPU smoke run lives with the benchmarks (``plugins/megatron/bench/gpu_smoke.py``).
"""

__all__ = ["seams"]
