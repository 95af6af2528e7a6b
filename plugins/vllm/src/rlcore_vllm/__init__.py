"""rlcore-vllm: vLLM as rlcore's rollout backend, with bucketed, verified weight sync.

The entry point (``vllm = "rlcore_vllm.plugin"``) imports neither vLLM nor torch; the factories
do, when a config selects ``rollout.backend: vllm`` or ``sync.name: vllm``.
"""

__version__ = "0.1.0"
