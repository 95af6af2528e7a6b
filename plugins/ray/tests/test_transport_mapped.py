"""The source-mapped transport (rlcore_ray.transport.mapped) across real processes on CPU: the trainer's
tensors live in shared memory (torch's ``file_system`` sharing, the CPU analogue of a CUDA IPC
handle), the receiver opens each storage once and copies from it into its own tensors. Covers the
layout cache (nothing re-exported while addresses stay, one storage re-exported when a parameter is
replaced), coalesced copies, the loader path, verification catching a byte written while lent,
the lease after a timeout, and refusals. The CUDA handles themselves need a GPU: the CUDA test
below and ``bench_transport_mapped_gpu.py`` run them on one (docs/benchmarks/transport.md)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp
from rlcore.sync import ChecksumPlan, tensor_checksum
from rlcore_ray.transport import CopyProgram, MappedSender, TransportError
from rlcore_ray.transport import testing as tm
from rlcore_ray.transport.testing import PipeChannel


@pytest.fixture
def file_system_sharing():
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    yield
    tmp.set_sharing_strategy(before)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a CUDA GPU; "
                                "plugins/ray/bench/bench_transport_mapped_gpu.py runs them on one (docs/benchmarks/transport.md)")


def _start(**kwargs):
    return tm.start_receiver_process(tm.mapped_receiver_main, tm.SPEC, **kwargs)


class RecklessSender(MappedSender):
    """Writes one byte of a parameter after its checksum was taken, before the receiver reads:
    what an optimizer step during the lease would do."""

    corrupt = False

    def _before_publish(self, tensors):
        if self.corrupt:
            tensors[3].view(-1).view(torch.uint8)[5] ^= 0x10


def test_mapped_push_layout_cache_coalescing_loader_and_a_byte_written_while_lent(file_system_sharing):
    weights = tm.allocate(tm.SPEC, shared=True, seed=1)
    conn, proc = _start(relocate_after={1: "model.norm.weight"})  # the replica moves a tensor after v1
    sender = RecklessSender(PipeChannel(conn, "rollout"), timeout=60)
    reports = [sender.send(weights, version=1)]
    sender.check_writable()  # the reply came: the optimizer may step
    for t in weights.values():
        t.mul_(-1)  # in place: same addresses
    reports.append(sender.send(list(weights.items()), version=2))
    weights["lm_head.weight"] = weights["lm_head.weight"].clone().share_memory_()  # a replaced storage
    reports.append(sender.send(weights, version=3))
    sender.corrupt = True
    with pytest.raises(TransportError, match="other bytes than the sender's checksum") as err:
        sender.send(weights, version=4)
    assert "model.layers.0.mlp.experts.1.gate_proj.weight" in str(err.value)
    assert sender.state == "idle"  # the error reply certifies that the receiver's reads are over
    sender.corrupt = False
    reports.append(sender.send(weights, version=5))  # the changed byte, now under its own checksum
    _, version, sums, aborted, torn, summaries = tm.finish_receiver_process(conn, proc)

    first, same, replaced, last = reports
    storages = 1 + 1 + 3  # one flat bf16 buffer, the qkv, embed, norm, lm_head
    assert first.details["layout_sent"] and first.details["storages_exported"] == storages
    assert not same.details["layout_sent"] and same.details["storages_exported"] == 0
    assert replaced.details["layout_sent"] and replaced.details["storages_exported"] == 1
    assert replaced.details["storages"] == storages and sender.exported_total == storages + 1
    assert all(r.details["level"] == "coverage+exact" and r.checked == len(tm.SPEC) for r in reports)
    assert {"signature", "checksum", "settle", "publish", "wait"} <= set(same.details["sender_phases"])
    assert {"copy", "load", "sync", "verify", "commit"} <= set(same.details["receiver_phases"])
    ok = [s for s in summaries if "error" not in s]
    assert [s["version"] for s in ok] == [1, 2, 3, 5] and "other bytes" in summaries[3]["error"]
    program = ok[0]["program"]
    # 24 expert views of one flat buffer on both sides: one run; embed, norm, lm_head: one each
    assert program["pairs"] == len(tm.SPEC) - 1 and program["runs"] == 4, program
    assert ok[0]["loader_buckets"] == 1  # the qkv went through the target's loader
    # the replica's moved tensor is noticed: its copies are planned again, nothing is re-opened
    assert "plan" in ok[1]["phases"] and "open" not in ok[1]["phases"] and not same.details["layout_sent"]
    assert ok[-1]["opened_total"] == storages + 1  # each storage opened once, the new lm_head too
    assert version == 5 and aborted == 1 and not torn
    assert sums == {n: tensor_checksum(t) for n, t in weights.items()}


def test_a_push_that_times_out_keeps_the_parameters_locked_until_reclaimed(file_system_sharing):
    weights = tm.allocate(tm.SPEC, shared=True, seed=2)
    conn, proc = _start(slow_commit={2: 4.0})
    sender = MappedSender(PipeChannel(conn, "rollout"), timeout=60)
    sender.send(weights, version=1)  # the receiver process is up
    sender.timeout = 1.0
    with pytest.raises(TransportError, match="no message"):
        sender.send(weights, version=2)
    assert sender.state == "unknown"
    with pytest.raises(TransportError, match="reclaim"):
        sender.check_writable()
    with pytest.raises(TransportError, match="reclaim"):
        sender.send(weights, version=3)
    sender.reclaim(timeout=30)
    sender.check_writable()
    rep = sender.send(weights, version=3)
    assert rep.details["layout_sent"] and rep.details["storages_exported"] == 0  # re-sent, nothing re-shared
    _, version, sums, aborted, torn, _ = tm.finish_receiver_process(conn, proc)
    assert version == 3 and aborted == 0 and sums == {n: tensor_checksum(t) for n, t in weights.items()}


def test_a_receiver_that_died_releases_the_lease(file_system_sharing):
    """A closed channel means the receiver's process is gone, and its reads with it: the push
    fails naming the closed channel and the parameters are writable at once (silence, above,
    leaves them locked)."""
    from rlcore_ray.transport import ChannelClosed

    weights = tm.allocate(tm.SPEC, shared=True, seed=6)
    conn, proc = _start()
    sender = MappedSender(PipeChannel(conn, "rollout"), timeout=60)
    sender.send(weights, version=1)
    proc.kill()
    proc.join(30)
    with pytest.raises(ChannelClosed, match="closed the channel"):
        sender.send(weights, version=2)
    assert sender.state == "idle"
    sender.check_writable()


class _NoChannel:
    def send(self, msg):
        raise AssertionError("nothing may be sent for a refused push")


def test_refusals_name_the_tensor_and_a_bucketed_sync(file_system_sharing):
    weights = tm.allocate(tm.SPEC, shared=True, seed=3)
    sender = MappedSender(_NoChannel())
    bad = dict(weights, **{"lm_head.weight": weights["lm_head.weight"].t()})
    with pytest.raises(TransportError, match=r"lm_head.weight is not contiguous.*bucketed sync \(sync.name=inproc\)"):
        sender.send(bad, version=1)
    with pytest.raises(TransportError, match="shared memory"):
        sender.send({"x": torch.ones(4)}, version=1)
    assert sender.state == "idle"


def test_copy_program_merges_adjacent_pairs_and_copies_every_byte():
    spec = [(f"e{i}", (3, 5), "bfloat16", "flat") for i in range(10)] + [("odd", (7,), "float16", "own"),
                                                                       ("big", (64, 64), "float32", "own")]
    src, dst = tm.allocate(spec, seed=4), tm.allocate(spec)
    pairs = [(dst[n], src[n]) for n in src]
    program = CopyProgram(pairs[::-1], big_bytes=16 << 10)  # any order: sorted by source address
    program.run()
    assert all(torch.equal(dst[n].view(torch.uint8) if dst[n].dim() == 0 else dst[n], src[n]) for n in src)
    stats = program.stats()
    assert stats["runs"] == 3 and stats["big_copies"] == 1 and stats["fused_copies"] == 2
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in src.values())
    widths = {d.dtype for d, _ in program.big} | {d[0].dtype for d, _ in program.groups}
    assert torch.int16 in widths  # 14 bytes: int16 view, the others wider
    with pytest.raises(TransportError, match="needs CUDA tensors and Triton"):
        CopyProgram(pairs, fused="triton")  # never a silent fallback when the kernel was asked for


def test_checksum_plan_equals_tensor_checksum():
    ts = [torch.randn(100, 7), torch.randn(13).to(torch.bfloat16), torch.arange(3, dtype=torch.int8)]
    plan = ChecksumPlan(ts)
    assert plan.compute() == [tensor_checksum(t) for t in ts]
    ts[0][3, 3] += 1
    assert plan.compute()[0] == tensor_checksum(ts[0]) != ChecksumPlan([torch.zeros(1)]).compute()[0]


@needs_cuda
def test_cuda_ipc_mapped_push_one_handle_per_block_and_bitwise_copies():
    weights = tm.allocate(tm.SPEC, device="cuda:0", seed=5)
    conn, proc = _start(device="cuda:0")
    sender = RecklessSender(PipeChannel(conn, "rollout"), timeout=120)
    first = sender.send(weights, version=1)
    for t in weights.values():
        t.add_(1)
    second = sender.send(weights, version=2)
    sender.corrupt = True
    with pytest.raises(TransportError, match="other bytes"):
        sender.send(weights, version=3)
    sender.corrupt = False
    sender.send(weights, version=4)
    _, version, sums, aborted, torn, summaries = tm.finish_receiver_process(conn, proc)
    assert first.details["layout_sent"] and not second.details["layout_sent"]
    assert first.details["blocks"] <= first.details["storages"] == 5
    assert first.details["checksum_backend"] in ("triton", "per-tensor")
    assert version == 4 and aborted == 1 and not torn
    assert sums == {n: tensor_checksum(t) for n, t in weights.items()}


def _push_in_this_process(weights, device):
    """A sender and a receiver in one process (vLLM's engine in the trainer's process), the receiver on
    a thread: two pushes, the second after an in-place update; the receiver's result tuple."""
    import multiprocessing as mp
    import threading

    ours, theirs = mp.Pipe()
    receiver = threading.Thread(target=tm.mapped_receiver_main, args=(theirs, tm.SPEC),
                                kwargs={"device": device}, daemon=True)
    receiver.start()
    sender = MappedSender(PipeChannel(ours, "rollout"), timeout=60)
    sender.send(weights, version=1)
    for t in weights.values():
        t.add_(1)
    sender.send(weights, version=2)
    ours.send(("close",))
    assert ours.poll(60), "the receiver did not answer"
    result = ours.recv()
    receiver.join(30)
    assert result[0] == "result", result
    return result


def test_a_receiver_in_the_exporting_process_gets_the_storage_itself(file_system_sharing):
    from rlcore_ray.transport.mapping import export_storage, open_storage

    t = torch.arange(12, dtype=torch.float32).share_memory_()
    storage = t.untyped_storage()
    _, payload = export_storage(storage)
    opened = open_storage(payload)
    assert opened is storage  # not a second mapping of the file: the same bytes, no reopen
    weights = tm.allocate(tm.SPEC, shared=True, seed=3)
    _, version, sums, aborted, torn, _ = _push_in_this_process(weights, "cpu")
    assert version == 2 and not aborted and not torn
    assert sums == {n: tensor_checksum(t) for n, t in weights.items()}


@needs_cuda
def test_cuda_mapped_push_to_a_receiver_in_the_same_process():
    # CUDA refuses to open an IPC handle in the process that made it: the receiver takes the storage itself
    weights = tm.allocate(tm.SPEC, device="cuda:0", seed=4)
    _, version, sums, aborted, torn, _ = _push_in_this_process(weights, "cuda:0")
    assert version == 2 and not aborted and not torn
    assert sums == {n: tensor_checksum(t) for n, t in weights.items()}
