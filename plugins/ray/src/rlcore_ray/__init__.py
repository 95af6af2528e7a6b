"""rlcore-ray: ``cluster.backend: ray``, trainer ranks and rollout replicas as Ray actors."""
__version__ = "0.1.0"

#: the modules other plugins may import: the storage-lending transport and its sync's reply box and
#: phase accounting (rlcore-vllm's vllm.transport mapped serves them in vLLM's worker)
__all__ = ["mapped_sync", "transport"]
