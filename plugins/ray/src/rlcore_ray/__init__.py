"""rlcore-ray: ``cluster.backend: ray``, trainer ranks and rollout replicas as Ray actors."""
__version__ = "0.1.0"
