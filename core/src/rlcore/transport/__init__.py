"""Cross-process bucketed weight transport: a trainer rank pushes HF-named weights into a rollout
process through a few fixed buffers, verified and versioned. No engine is imported here.

Sender (the one trainer rank that sends; the others :func:`drain` the same export, since its
gathers are collectives)::

    from rlcore.transport import PipeChannel, ShmPlane, WeightSender
    sender = WeightSender(PipeChannel(conn, "rollout"), ShmPlane(), slot_bytes=512 << 20, num_slots=2)
    report = sender.send(engine.export_hf_weights(), version=step)   # a rlcore.types.SyncReport

Receiver (the rollout process; ``target`` is any :class:`rlcore.types.BucketReceiver`)::

    from rlcore.transport import PipeChannel, WeightReceiver, receiver_plane_for
    WeightReceiver(PipeChannel(conn, "trainer"), receiver_plane_for("shm")).serve(target)

Colocated on one GPU, :class:`MappedSender` / :class:`MappedReceiver`
(:mod:`rlcore.transport.mapped`) skip the buckets: the receiver copies straight out of the
trainer's parameter storages, shared once, while the trainer waits.

Planes (:mod:`rlcore.transport.planes`): ``ShmPlane`` (CPU shared memory), ``CudaIpcPlane`` (a
GPU shared by both processes), ``DistPlane`` (a ``torch.distributed`` broadcast: gloo on CPU,
NCCL to disaggregated engines; the caller creates the group). The protocol, the hand-back of
every buffer and the verification are in :mod:`rlcore.transport.protocol` and
:class:`WeightSender`; ``docs/transport.md`` has the whole story and what ran where.
"""

from rlcore.checksums import ChecksumPlan
from rlcore.transport.endpoints import SenderAborted, WeightReceiver, WeightSender, drain
from rlcore.transport.mapped import MappedReceiver, MappedSender, mapping_refusal
from rlcore.transport.mapping import CopyProgram
from rlcore.transport.planes import (
    CudaIpcPlane,
    CudaIpcReceiverPlane,
    DistPlane,
    DistReceiverPlane,
    ReceiverPlane,
    SenderPlane,
    ShmPlane,
    ShmReceiverPlane,
    map_segment,
    receiver_plane_for,
    shm_directory,
)
from rlcore.transport.protocol import (
    Channel,
    ChannelListener,
    PipeChannel,
    SlotLedger,
    TransportError,
    connect_channel,
)

__all__ = [
    "Channel", "ChannelListener", "ChecksumPlan", "CopyProgram", "MappedReceiver", "MappedSender", "mapping_refusal", "CudaIpcPlane", "CudaIpcReceiverPlane", "DistPlane", "DistReceiverPlane", "PipeChannel",
    "ReceiverPlane", "SenderAborted", "SenderPlane", "ShmPlane", "ShmReceiverPlane", "SlotLedger", "TransportError",
    "WeightReceiver", "WeightSender", "connect_channel", "drain", "map_segment", "receiver_plane_for", "shm_directory",
]
