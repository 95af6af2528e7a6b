"""The source-mapped weight transport: a trainer rank lends its parameters' storages to a colocated
rollout process, which copies straight out of them while the trainer waits (CUDA IPC on a GPU,
named shared memory on CPU). No engine is imported here.

Sender (the trainer rank; the same ``(HF name, parameter)`` pairs every push)::

    sender = MappedSender(channel, verify=True)
    report = sender.send(hf_named_parameters, version=step)   # a rlcore.types.SyncReport
    sender.check_writable()                                   # before the optimizer step

Receiver (the rollout process; ``target`` is any :class:`rlcore.types.BucketReceiver`, optionally
with ``direct_destinations()``)::

    MappedReceiver(channel).serve(target)

The messages and the channel are in :mod:`.protocol`, the sharing of storages and the receiver's
copy program in :mod:`.mapping`, the lease and the verification in :mod:`.mapped`;
``docs/transport.md`` has the whole story and what ran where.
"""

from rlcore_ray.transport.mapped import MappedReceiver, MappedSender
from rlcore_ray.transport.mapping import CopyProgram
from rlcore_ray.transport.protocol import Channel, ChannelClosed, TransportError

__all__ = ["Channel", "ChannelClosed", "CopyProgram", "MappedReceiver", "MappedSender", "TransportError"]
