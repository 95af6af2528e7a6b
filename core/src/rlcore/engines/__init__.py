"""Training engines. ``hf`` (transformers) lives here; ``megatron`` imports megatron-core only
when selected."""
