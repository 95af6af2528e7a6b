"""Where trainer ranks and rollout replicas run: in this process (``cluster.backend: local``) or
as Ray actors in a placement group (``ray``). Ray is imported only by :mod:`rlcore.cluster.ray_launch`.
"""
