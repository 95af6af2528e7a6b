"""What rlcore's rollout-engine plugins share, kept out of core (core imports no engine and drives
none): engine servers over HTTP (:mod:`rlcore_enginekit.serving`: bind check, launch, health, a
JSON client), shared-memory segments two processes of one host map
(:mod:`rlcore_enginekit.shared_memory`), and routed experts as an engine returns them, decoded
(:mod:`rlcore_enginekit.routed_experts`). rlcore-vllm and rlcore-sglang depend on it; a third
party's engine plugin may too. No entry point: it adds no hook."""

__all__ = ["routed_experts", "serving", "shared_memory"]
