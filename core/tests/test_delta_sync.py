"""``sync.delta`` (issue 42 item 3): pushes that carry only what changed since the receiver's
version, into a real local rollout, verified as a full push is (``coverage+exact``): few bytes,
exact weights, a corrupted or lost delta refused naming what is wrong, and the full pushes that
bring a receiver back (first, base mismatch, after a failure, periodic, too large)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch
from rlcore import errors, hookimpl
from rlcore.delta import DeltaEncoder
from rlcore.engines.hf_names import checkpoint_views
from rlcore.rollout_local import LocalRollout
from rlcore.stack import resolve
from rlcore.sync import iter_buckets
from rlcore.testing.conformance import hf_export
from rlcore.testing.models import make_model_dir
from rlcore.types import Cap, RolloutBackendSpec
from rlcore.weight_sync import DiskSync, InprocSync

BUCKET = 64 * 1024
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("delta-model") / "m", "qwen2", seed=1)


@pytest.fixture
def trainer(model_dir):
    """The trainer's weights: the model's tensors in bf16, changed in place between pushes."""
    return {n: t.to(torch.bfloat16).clone() for n, t in hf_export(model_dir)}


def _rollout(model_dir, update="staged") -> LocalRollout:
    b = LocalRollout(dtype="bfloat16", update=update)
    b.start(str(model_dir), version=0)
    return b



def _after_a_full_push(model_dir, trainer) -> tuple[LocalRollout, InprocSync]:
    """A rollout holding version 1 (its first push, full) and the delta sync that pushed it."""
    backend = _rollout(model_dir)
    sync = InprocSync(BUCKET, delta=DeltaEncoder(full_every=0))
    sync.push(list(trainer.items()), backend, 1)
    return backend, sync

def _step(weights: dict[str, torch.Tensor], step: int) -> None:
    """A sparse update: one row of a third of the matrices, three elements of another third, the
    rest untouched (as most of a bf16 model at an RL learning rate)."""
    for i, t in enumerate(weights.values()):
        if i % 3 == 0 and t.dim() == 2:
            t[step % t.shape[0]] += 1.0
        elif i % 3 == 1:
            flat = t.view(-1)
            flat[[(step * 7 + k * 11) % flat.numel() for k in range(3)]] += 0.5


def _assert_holds(backend: LocalRollout, weights: dict[str, torch.Tensor]) -> None:
    held = checkpoint_views(backend.model)
    assert sorted(held) == sorted(weights)
    for name, t in weights.items():
        assert torch.equal(held[name], t), name


class _Wrapped:
    """The rollout seen through a transport: every call goes to it (subclasses change one)."""

    def __init__(self, inner: LocalRollout):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("update", ["staged", "in_place"])
def test_sparse_pushes_send_little_and_the_receiver_holds_the_trainers_weights(model_dir, trainer, update):
    backend = _rollout(model_dir, update)
    sync = InprocSync(BUCKET, delta=DeltaEncoder(max_ratio=0.5, full_every=0))
    reports = []
    for version in range(1, 6):
        if version > 1:
            _step(trainer, version)
        reports.append(sync.push(list(trainer.items()), backend, version))
        _assert_holds(backend, trainer)
        assert backend.weight_version == version
    first, *deltas = reports
    full = first.details["model_bytes"]
    assert first.details["delta"] == "full" and first.details["delta_reason"] == "first" and first.bytes >= full
    for r in deltas:
        d = r.details
        assert d["delta"] == "delta" and d["level"] == "coverage+exact" and r.verified
        assert r.checked == len(trainer), "exact covers every tensor, not only the ones sent"
        assert r.bytes < full / 20, (r.bytes, full)
        assert d["delta_tensors_rows"] > 0 and d["delta_tensors_elements"] > 0 and d["delta_tensors_unchanged"] > 0
        assert sum(d[f"delta_tensors_{k}"] for k in ("unchanged", "rows", "elements", "dense")) == len(trainer)


class _Tampering(_Wrapped):
    """Flips one value of the first delta it carries (a corrupted transport)."""

    def __init__(self, inner, part=".values"):
        super().__init__(inner)
        self.part = part
        self.hit: str | None = None

    def receive_bucket(self, bucket):
        metas = [m for m in bucket.metas if "@delta." in m.name and m.name.endswith(self.part)]
        if metas and self.hit is None:
            bucket = dataclasses.replace(bucket, buffer=bucket.buffer.clone())
            flat = bucket.view(metas[0]).reshape(-1)
            flat[-1] += flat.new_ones(()) * (1.0 if flat.is_floating_point() else 1 << 20)
            self.hit = metas[0].name.split("@delta.")[0]
        self.inner.receive_bucket(bucket)


def test_a_corrupted_delta_fails_exact_naming_the_tensor_and_the_next_push_is_full(model_dir, trainer):
    backend, sync = _after_a_full_push(model_dir, trainer)
    _step(trainer, 2)
    wire = _Tampering(backend)
    with pytest.raises(errors.WeightSyncError, match=r"differ on the receiver") as info:
        sync.push(list(trainer.items()), wire, 2)
    assert wire.hit and wire.hit in str(info.value)
    assert info.value.receiver_version is None  # it committed what it was given: unverified weights
    report = sync.push(list(trainer.items()), backend, 3)
    assert report.details["delta"] == "full" and report.details["delta_reason"] == "after_failure"
    assert report.details["level"] == "coverage+exact"
    _assert_holds(backend, trainer)


def test_an_index_out_of_range_is_refused_before_anything_lands(model_dir, trainer):
    backend, sync = _after_a_full_push(model_dir, trainer)
    before = backend.weight_checksums()
    _step(trainer, 2)
    wire = _Tampering(backend, part=".index")
    with pytest.raises(errors.WeightSyncError, match=r"delta for weight .* refused: indices") as info:
        sync.push(list(trainer.items()), wire, 2)
    assert wire.hit in str(info.value)
    assert info.value.receiver_version == 1 and backend.weight_version == 1
    assert backend.weight_checksums() == before


class _DroppingIndices(_Wrapped):
    """Loses every bucket of int32 tensors (the rows' and elements' indices)."""

    def receive_bucket(self, bucket):
        if bucket.dtype != torch.int32:
            self.inner.receive_bucket(bucket)


def test_a_delta_whose_indices_never_came_is_refused_at_commit(model_dir, trainer):
    backend, sync = _after_a_full_push(model_dir, trainer)
    _step(trainer, 2)
    with pytest.raises(errors.WeightSyncError, match=r"without their index or values.*model\.") as info:
        sync.push(list(trainer.items()), _DroppingIndices(backend), 2)
    assert info.value.receiver_version == 1 and backend.weight_version == 1


class _Lagging(_Wrapped):
    """Reports a stale weight version (a transport that did not see the last push land)."""

    def __init__(self, inner, reports: int):
        super().__init__(inner)
        self.reports = reports

    @property
    def weight_version(self):
        return self.reports


def test_a_lost_delta_is_refused_naming_both_versions_and_the_next_push_is_full(model_dir, trainer, tmp_path):
    backend, sync = _after_a_full_push(model_dir, trainer)
    _step(trainer, 2)
    DiskSync(tmp_path / "disk", BUCKET).push(list(trainer.items()), backend, 2)  # a push the encoder missed
    before = backend.weight_checksums()
    _step(trainer, 3)
    with pytest.raises(errors.WeightSyncError, match=r"lost delta.*version 3 is a delta from version 1.*holds "
                                                     r"version 2") as info:
        sync.push(list(trainer.items()), _Lagging(backend, reports=1), 3)
    assert info.value.receiver_version == 2
    assert backend.weight_version == 2 and backend.weight_checksums() == before, "nothing landed"
    report = sync.push(list(trainer.items()), backend, 3)
    assert (report.details["delta"], report.details["delta_reason"], report.details["level"]) == \
        ("full", "after_failure", "coverage+exact")
    _assert_holds(backend, trainer)
    # the encoder sees a receiver that moved on without it: a full push, no refusal
    _step(trainer, 4)
    DiskSync(tmp_path / "disk", BUCKET).push(list(trainer.items()), backend, 4)
    _step(trainer, 5)
    report = sync.push(list(trainer.items()), backend, 5)
    assert (report.details["delta"], report.details["delta_reason"]) == ("full", "base_mismatch")
    _assert_holds(backend, trainer)


def test_a_push_that_changes_every_element_is_sent_full(model_dir, trainer):
    backend = _rollout(model_dir, "in_place")
    sync = InprocSync(BUCKET, delta=DeltaEncoder(max_ratio=0.5, full_every=0))
    sync.push(list(trainer.items()), backend, 1)
    for t in trainer.values():
        t.neg_()  # every element's bits change, zeros included (-0.0 is not 0.0 here)
    report = sync.push(list(trainer.items()), backend, 2)
    d = report.details
    assert (d["delta"], d["delta_reason"], d["delta_tensors_dense"]) == ("full", "too_large", len(trainer))
    assert report.bytes >= d["model_bytes"] and d["level"] == "coverage+exact"
    _assert_holds(backend, trainer)


def test_every_nth_push_is_full(model_dir, trainer):
    backend = _rollout(model_dir)
    sync = InprocSync(BUCKET, delta=DeltaEncoder(full_every=3))
    kinds = []
    for version in range(1, 8):
        _step(trainer, version)
        d = sync.push(list(trainer.items()), backend, version).details
        kinds.append(d.get("delta_reason", d["delta"]))
    assert kinds == ["first", "delta", "delta", "periodic", "delta", "delta", "periodic"]
    _assert_holds(backend, trainer)


def test_an_encoded_name_in_a_full_push_is_refused_as_an_unknown_tensor(model_dir):
    backend = _rollout(model_dir)
    backend.begin_update(1)
    encoded = [("model.norm.weight@delta.elements.index", torch.zeros(1, dtype=torch.int32))]
    with pytest.raises(errors.WeightSyncError, match=r"model\.norm\.weight@delta\.elements\.index.*holds no tensor"):
        backend.receive_bucket(next(iter_buckets(encoded, BUCKET)))
    backend.abort_update()


def test_sync_delta_needs_a_sync_and_a_backend_that_declare_it(rlcore_plugin_manager, register_plugin, rlcore_config):
    with pytest.raises(errors.MissingCapabilityError) as refused:
        resolve(rlcore_config("sync.delta=true", "sync.name=disk"), rlcore_plugin_manager)
    msg = str(refused.value)
    assert "sync.delta" in msg and f"capability {Cap.DELTA!r}" in msg and "weight_sync 'disk'" in msg
    mod = types.ModuleType("acme_gen")
    mod.PLUGIN_API = 1

    def rollout_backend():  # receives buckets, not deltas
        yield RolloutBackendSpec(name="acme-gen", factory=lambda ctx: None,
                                 capabilities={Cap.LOGPROBS, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS})

    mod.rollout_backend = hookimpl(rollout_backend)
    register_plugin(mod, "acme_gen", distribution="acme-gen", version="1.0")
    with pytest.raises(errors.MissingCapabilityError) as refused:
        resolve(rlcore_config("sync.delta=true", "rollout.backend=acme-gen"), rlcore_plugin_manager)
    msg = str(refused.value)
    assert "sync.delta" in msg and f"capability {Cap.RECEIVE_DELTAS!r}" in msg and "'acme-gen' (acme-gen 1.0)" in msg
    stack = resolve(rlcore_config("sync.delta=true"), rlcore_plugin_manager)
    assert (stack.weight_sync.name, stack.rollout_backend.name) == ("inproc", "local")


@pytest.mark.slow
def test_a_run_with_sync_delta_pushes_verified_deltas_smaller_than_the_model(tmp_path, monkeypatch):
    from rlcore.testing.runs import main, read_metrics

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    out = tmp_path / "run"
    # bf16 at an RL learning rate: most elements do not move from one step to the next
    assert main(["train", str(TINY), "--output", str(out), "training.steps=4", "rollout.n=4",
                 "data.prompts_per_step=4", "output.plot=false", "output.tensorboard=false",
                 "output.checkpoint_every=0", "engine.model.dtype=bfloat16", "training.lr=1e-5",
                 "sync.delta=true"]) == 0
    rows = read_metrics(out)
    assert len(rows) == 4
    assert (rows[0]["sync/delta"], rows[0]["sync/delta_reason"]) == (0.0, "first")
    assert rows[0]["sync_bytes"] >= rows[0]["sync/model_bytes"]
    for r in rows[1:]:
        assert r["sync/delta"] == 1.0 and r["sync_verified"] and r["sync_level"] == "coverage+exact"
        assert r["sync_bytes"] < 0.2 * r["sync/model_bytes"], (r["sync_bytes"], r["sync/model_bytes"])
        assert r["sync/delta_tensors_unchanged"] + r["sync/delta_tensors_elements"] > 0
