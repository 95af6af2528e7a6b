"""Checksums in the same pass as the copy (issue 31 item 3, issue 32 item 3): the fused
copy-and-checksum gives ``tensor_checksum``'s values, the sender's sums stay on the device until
the end of the push (no wait per bucket, no bucket kept alive by them), a byte changed between
the two sides is caught, the push's phases reach the run's metrics, and the kernels are warmed
when the sync is set up."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from rlcore.checksums import ChecksumPlan, ChecksumSlots, tensor_checksum
from rlcore.errors import BucketError, WeightSyncError
from rlcore.rollout_local import LocalRollout
from rlcore.sync import Bucket, SentChecksums, iter_buckets
from rlcore.testing.conformance import hf_export
from rlcore.testing.models import make_model_dir
from rlcore.weight_sync import InprocSync
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = Path(__file__).resolve().parents[2]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(3, generator=g),                                   # one partial row
        torch.randn(70_001, generator=g),                              # a full row and a tail
        torch.randn(5, 2 * 65521 + 3, generator=g).to(torch.bfloat16),  # several rows, 2-byte words
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),   # zero-padded to a word
        torch.randn(300, generator=g).to(torch.bfloat16)[1:],          # at byte offset 2
        -torch.ones(65521 * 3, dtype=torch.int32),                     # negative words
    ]


def test_fused_copy_and_checksum_equal_tensor_checksum():
    ts = _tensors()
    ref = [tensor_checksum(t) for t in ts]
    slots = ChecksumSlots(capacity=2)  # grows on the device as tensors come
    dsts = [torch.empty_like(t) for t in ts]
    copied = slots.copy(list(zip(dsts, ts, strict=True)))
    read = slots.checksum(ts)
    values = slots.values()
    assert [values[s] for s in copied] == ref and [values[s] for s in read] == ref
    assert all(torch.equal(d, t) for d, t in zip(dsts, ts, strict=True))
    assert ChecksumPlan(ts).compute() == ref
    slots.reset()
    assert slots.values() == [] and slots.checksum(ts[:1]) == [0]


def test_sender_checksums_fused_into_the_fill_equal_the_separate_ones():
    """With ``checksums=`` the bucket builder copies and sums in one launch per bucket; the values
    equal each bucket's own (separate) checksums, and the bytes are the same."""
    named = [(f"w{i}", t) for i, t in enumerate(_tensors())]
    slots = ChecksumSlots()
    fused, separate, landed = {}, {}, {}
    for bucket in iter_buckets(named, bucket_bytes=300_000, checksums=slots):
        assert bucket.slots is not None and len(bucket.slots) == len(bucket.metas)
        fused.update(zip(bucket.names, bucket.slots, strict=True))
        separate.update(bucket.checksums())
        landed.update({n: v.clone() for n, v in bucket.tensors()})
    values = dict(zip(fused, slots.values(list(fused.values())), strict=True))
    assert values == separate == {n: tensor_checksum(t) for n, t in named}
    assert all(torch.equal(landed[n], t) for n, t in named)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-models")
    return {"a": make_model_dir(root / "a", "qwen2", seed=1), "b": make_model_dir(root / "b", "qwen2", seed=2)}


class _Corrupting(LocalRollout):
    """A transfer fault: one byte of the third bucket (or, landing in place, of the third group of
    tensors) changes after the sender summed it."""

    groups = 0

    def receive_bucket(self, bucket: Bucket) -> None:
        if bucket.index == 2:
            bucket.buffer[bucket.metas[0].offset] ^= 0x5A
        super().receive_bucket(bucket)

    def receive_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.groups += 1
        if self.groups == 3:
            name, t = named[0]
            t = t.clone()
            t.view(-1).view(torch.uint8)[0] ^= 0x5A
            named = [(name, t), *named[1:]]
        super().receive_tensors(named)


@pytest.mark.parametrize("update", ["staged", "in_place"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_byte_changed_in_transit_is_caught(dirs, update, fused):
    backend = _Corrupting(update=update, fused_checksums=fused)
    backend.start(str(dirs["a"]), version=0)
    with pytest.raises(WeightSyncError, match=r"1 of \d+ tensors differ on the receiver"):
        InprocSync(bucket_bytes=64 * 1024).push(hf_export(dirs["b"]), backend, 1)


@pytest.mark.parametrize("update", ["staged", "in_place"])
def test_landing_sums_equal_a_fresh_read_of_the_weights(dirs, update):
    """The receiver's sums come from the copies that wrote the weights; they equal reading them."""
    backend = LocalRollout(update=update, fused_checksums=True)
    backend.start(str(dirs["a"]), version=0)
    report = InprocSync(bucket_bytes=64 * 1024).push(hf_export(dirs["b"]), backend, 1)
    assert report.details["level"] == "coverage+exact"
    assert backend._landed is not None  # the sums of this push's landing answered
    from_landing = backend.weight_checksums()
    backend._landed = None
    assert backend.weight_checksums() == from_landing == {n: tensor_checksum(t) for n, t in hf_export(dirs["b"])}


class _BucketCounter(LocalRollout):
    """Counts, at every bucket received, the earlier buckets whose storage is still alive (held by
    anything: a bucket object, a view, queued work). It takes buckets even in place (no direct
    landing), so the sender's side of the bucket path is what is measured."""

    def lands_directly(self) -> bool:
        return False

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[tuple[weakref.ref, StorageWeakRef]] = []
        self.alive_max = 0

    def receive_bucket(self, bucket: Bucket) -> None:
        self.alive_max = max(self.alive_max, sum(not s.expired() for _, s in self.seen))
        self.seen.append((weakref.ref(bucket), StorageWeakRef(bucket.buffer.untyped_storage())))
        super().receive_bucket(bucket)


def test_pending_checksums_keep_no_bucket_alive(dirs):
    """The reverted change kept every bucket of a push alive until its queued checksums were read
    (1-3 GB more on the writer): here, when a bucket arrives, no earlier one is alive, so a push
    holds the open bucket and the one being received, at most (an in-place receiver, which keeps
    nothing of a bucket; the staged one keeps them as its staging, next test)."""
    backend = _BucketCounter(fused_checksums=True, update="in_place")
    backend.start(str(dirs["a"]), version=0)
    report = InprocSync(bucket_bytes=16 * 1024).push(hf_export(dirs["b"]), backend, 1)
    assert report.num_buckets >= 10 and report.details["level"] == "coverage+exact"
    assert backend.alive_max == 0
    assert all(r() is None and s.expired() for r, s in backend.seen)  # and none outlives the push


def test_a_run_writes_the_push_phases(tmp_path):
    from rlcore.cli import main

    out = tmp_path / "run"
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(out), "training.steps=2",
                 "rollout.n=2", "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false",
                 "output.checkpoint_every=0"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        phases = {k: v for k, v in row.items() if k.startswith("sync/") and k.endswith("_seconds")}
        assert set(phases) == {f"sync/{p}_seconds" for p in ("control", "sender_checksum", "copy", "wait",
                                                       "receiver_checksum", "commit")}
        assert all(v >= 0 for v in phases.values()) and phases["sync/copy_seconds"] > 0
        assert sum(phases.values()) <= row["sync_seconds"] + 1e-6
        assert row["sync_level"] == "coverage+exact"


def test_checksum_kernels_are_warmed_when_the_sync_is_built():
    """In a fresh process: building the sync warms the run's device; nothing had before."""
    code = """
from types import SimpleNamespace
import torch
from rlcore.checksums import warmed_devices
from rlcore.weight_sync import build_inproc
assert warmed_devices() == frozenset()
ctx = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(sync=SimpleNamespace(verify=True, bucket_mb=1)))
build_inproc(ctx)
print(sorted(warmed_devices()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "['cpu']"


class _StagingWatcher(_BucketCounter):
    """Also records whether each staged tensor is a view of its bucket's buffer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.kept: list[bool] = []

    def receive_bucket(self, bucket: Bucket) -> None:
        super().receive_bucket(bucket)
        buffer = bucket.buffer.untyped_storage().data_ptr()
        self.kept += [self._staging[n].untyped_storage().data_ptr() == buffer for n in bucket.names]


@pytest.mark.parametrize("fused", [True, False])
def test_the_staged_update_keeps_fresh_buckets_instead_of_copying_them(dirs, fused):
    """The staged local rollout lands a push with one copy after the bucket fill (the commit), not
    two: each bucket of the sync's own allocation becomes the staging as it is. The push is still
    verified, the weights are the pushed ones, and no bucket outlives the push."""
    backend = _StagingWatcher(fused_checksums=fused)
    backend.start(str(dirs["a"]), version=0)
    report = InprocSync(bucket_bytes=16 * 1024).push(hf_export(dirs["b"]), backend, 1)
    assert report.num_buckets >= 10 and report.details["level"] == "coverage+exact"
    assert len(backend.kept) == report.num_tensors and all(backend.kept)
    assert backend.alive_max > 0  # earlier buckets are alive while later ones arrive: they are the staging
    assert all(r() is None and s.expired() for r, s in backend.seen)
    assert backend.weight_checksums() == {n: tensor_checksum(t) for n, t in hf_export(dirs["b"])}


def test_buckets_of_a_reused_buffer_are_copied_out(dirs):
    """A sender with its own allocator may write the buffer again (here one buffer for every
    bucket, as a fixed pool does): the staged receiver copies each bucket out, so the commit lands
    every tensor as it was sent, not the last bucket's bytes."""
    pool: list[torch.Tensor] = []

    def one_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
        if not pool or pool[0].numel() < nbytes:
            pool[:] = [torch.empty(max(nbytes, 16 * 1024), dtype=torch.uint8, device=device)]
        return pool[0][:nbytes]

    backend = _StagingWatcher()
    backend.start(str(dirs["a"]), version=0)
    backend.begin_update(1)
    buckets = 0
    for bucket in iter_buckets(hf_export(dirs["b"]), 16 * 1024, allocator=one_buffer, group_by_dtype=False):
        assert not bucket.receiver_may_keep
        backend.receive_bucket(bucket)
        buckets += 1
    backend.commit_update(1)
    assert buckets >= 10 and not any(backend.kept)
    assert backend.weight_checksums() == {n: tensor_checksum(t) for n, t in hf_export(dirs["b"])}


def _no_second_read(*_args):
    raise AssertionError("a bucket was read again after its fill: its checksums come from the fill's copies")


def test_sent_checksums_come_from_the_fills_in_one_read(dirs, monkeypatch):
    """``SentChecksums``: the sender's values equal each tensor's own checksum, are read once per
    push, and no bucket is checksummed again after its fill (core's syncs use it, and so do the
    vLLM and SGLang senders); a bucket built without its slots is refused, naming the fix."""
    monkeypatch.setattr(Bucket, "checksums", _no_second_read)
    named = list(hf_export(dirs["b"]))
    sent = SentChecksums()
    for _ in range(2):  # kept across pushes: the second starts from nothing
        for bucket in iter_buckets(named, 16 * 1024, checksums=sent.start()):
            sent.record(bucket)
        assert sent.values() == {n: tensor_checksum(t) for n, t in named}
    with pytest.raises(BucketError, match="built without checksums"):
        sent.record(next(iter(iter_buckets(named, 16 * 1024))))
    backend = LocalRollout(fused_checksums=False)
    backend.start(str(dirs["a"]), version=0)
    report = InprocSync(bucket_bytes=16 * 1024).push(hf_export(dirs["b"]), backend, 1)
    assert report.details["level"] == "coverage+exact" and report.checked == len(named)


@pytest.mark.parametrize("fused", [True, False])
def test_an_in_place_receiver_takes_the_tensors_themselves(dirs, fused, monkeypatch):
    """In place, the inproc sync hands the sender's tensors to the receiver, which copies them
    straight into its live weights: no bucket is built (one copy per push instead of two), the push
    is verified coverage+exact, and the weights are the pushed ones. A staged receiver refuses
    tensors handed to it this way."""
    import rlcore.weight_sync

    def no_buckets(*_args, **_kwargs):
        raise AssertionError("a bucket was built for a receiver that lands in place")

    monkeypatch.setattr(rlcore.weight_sync, "iter_buckets", no_buckets)
    backend = LocalRollout(update="in_place", fused_checksums=fused)
    backend.start(str(dirs["a"]), version=0)
    report = InprocSync(bucket_bytes=16 * 1024).push(hf_export(dirs["b"]), backend, 1)
    assert report.details["landing"] == "direct" and report.num_buckets >= 10
    assert report.details["level"] == "coverage+exact" and backend.weight_version == 1
    backend._landed = None  # a fresh read of the weights, not the landing's sums
    assert backend.weight_checksums() == {n: tensor_checksum(t) for n, t in hf_export(dirs["b"])}
    staged = LocalRollout()
    staged.start(str(dirs["a"]), version=0)
    staged.begin_update(1)
    with pytest.raises(WeightSyncError, match="lands in place only"):
        staged.receive_tensors(list(hf_export(dirs["b"]))[:1])
