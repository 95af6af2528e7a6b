"""What "verified" means for the built-in syncs (issue 12 item 5): a push is checked against what
the receiver holds (names, shapes, every tensor present) before anything is swapped in, a partial
push fails and leaves the old version, every refusal names the tensor, and the report states its
verification level (coverage / exact / probe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rlcore.errors import WeightSyncError
from rlcore.rollout_local import LocalRollout
from rlcore.testing.conformance import hf_export
from rlcore.testing.models import make_model_dir
from rlcore.types import SyncReport
from rlcore.weight_sync import DiskSync, InprocSync


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-models")
    return {
        "a": make_model_dir(root / "a", "qwen2", seed=1),
        "b": make_model_dir(root / "b", "qwen2", seed=2),
        "tied_a": make_model_dir(root / "tied_a", "qwen2", seed=1, tie_word_embeddings=True),
        "tied_b": make_model_dir(root / "tied_b", "qwen2", seed=2, tie_word_embeddings=True),
    }


def _syncs(tmp_path):
    return {"inproc": InprocSync(bucket_bytes=64 * 1024), "disk": DiskSync(tmp_path / "sync", bucket_bytes=64 * 1024)}


def _started(model_dir) -> LocalRollout:
    b = LocalRollout(seed=0)
    b.start(str(model_dir), version=0)
    return b


@pytest.mark.parametrize("method", ["inproc", "disk"])
def test_partial_push_fails_and_keeps_the_old_version(dirs, tmp_path, method):
    """On main, a push without some tensors was reported verified (only the names sent were
    compared) and the receiver served a mix of versions."""
    backend = _started(dirs["a"])
    before = backend.weight_checksums()
    weights = [(n, t) for n, t in hf_export(dirs["b"]) if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"partial push.*model\.layers\.1\.self_attn\.k_proj\.weight") as info:
        _syncs(tmp_path)[method].push(weights, backend, 1)
    assert info.value.receiver_version == 0
    assert backend.weight_version == 0
    assert backend.weight_checksums() == before, "nothing of the partial push was swapped in"


@pytest.mark.parametrize("method", ["inproc", "disk"])
@pytest.mark.parametrize("change", ["extra column", "extra rows", "short"])
def test_wrong_shape_is_refused_naming_tensor_and_shapes(dirs, tmp_path, method, change):
    backend = _started(dirs["a"])
    before = backend.weight_checksums()
    name = "model.layers.0.mlp.down_proj.weight"
    weights = hf_export(dirs["b"])
    idx = [n for n, _ in weights].index(name)
    t = weights[idx][1]
    bad = {"extra column": torch.cat([t, t[:, :1]], 1), "extra rows": torch.cat([t, t[:2]], 0), "short": t[:-1]}[change]
    weights[idx] = (name, bad)
    with pytest.raises(WeightSyncError) as info:
        _syncs(tmp_path)[method].push(weights, backend, 1)
    msg = str(info.value)
    assert name in msg and str(tuple(bad.shape)) in msg and str(tuple(t.shape)) in msg
    assert backend.weight_version == 0 and backend.weight_checksums() == before


def test_unknown_tensor_is_refused_by_name(dirs, tmp_path):
    backend = _started(dirs["a"])
    weights = hf_export(dirs["b"]) + [("model.layers.9.mlp.up_proj.weight", torch.zeros(4, 4))]
    with pytest.raises(WeightSyncError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        _syncs(tmp_path)["inproc"].push(weights, backend, 1)
    assert backend.weight_version == 0


@pytest.mark.parametrize("method", ["inproc", "disk"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_full_push_reports_level_and_covers_the_head(dirs, tmp_path, method, tied):
    a, b = (dirs["tied_a"], dirs["tied_b"]) if tied else (dirs["a"], dirs["b"])
    backend = _started(a)
    weights = hf_export(b)
    names = [n for n, _ in weights]
    assert ("lm_head.weight" in names) is (not tied), "the export carries an untied head, not a tied one"
    report = _syncs(tmp_path)[method].push(weights, backend, 1)
    assert report.verified and report.details.get("level") == "coverage+exact"
    # the engine computes with the pushed head: its logits equal a fresh model's from b
    from rlcore.testing.models import hf_model

    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        got = backend.model(ids).logits
        want = hf_model(b)(ids).logits
    torch.testing.assert_close(got, want)
    if not tied:  # an untied head that does not arrive is a partial push
        backend2 = _started(a)
        with pytest.raises(WeightSyncError, match="lm_head.weight"):
            _syncs(tmp_path)[method].push([(n, t) for n, t in weights if n != "lm_head.weight"], backend2, 1)


def test_unverified_push_still_checks_coverage(dirs, tmp_path):
    backend = _started(dirs["a"])
    report = InprocSync(bucket_bytes=64 * 1024, verify=False).push(hf_export(dirs["b"]), backend, 1)
    assert not report.verified and report.details.get("level") == "coverage"


def test_levels_and_manifest_from_checkpoint(dirs):
    from rlcore.sync import WeightManifest, sync_level, verification_level

    assert verification_level() == "none"
    assert verification_level("exact", "coverage") == "coverage+exact"
    assert verification_level("probe", "coverage") == "coverage+probe"
    with pytest.raises(ValueError, match="checksum"):
        verification_level("checksum")
    assert sync_level(SyncReport(1, 0, 0, 0, 0.0, verified=True)) == "unstated"
    assert sync_level(SyncReport(1, 0, 0, 0, 0.0, verified=False)) == "none"

    untied = WeightManifest.from_checkpoint(dirs["a"])
    assert "lm_head.weight" in untied.shapes and "lm_head.weight" in untied.missing([])
    tied = WeightManifest.from_checkpoint(dirs["tied_a"])
    assert json.loads((Path(dirs["tied_a"]) / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tied.missing([]), "a tied head is covered by the embedding"
    emb = tied.shapes["model.embed_tokens.weight"]
    assert tied.refusal("model.embed_tokens.weight", emb) is None
    why = tied.refusal("model.embed_tokens.weight", (emb[0] + 1, emb[1]))
    assert "model.embed_tokens.weight" in why and str(emb) in why


def test_metrics_and_progress_line_state_the_level(tmp_path, capsys):
    from rlcore.cli import main

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    assert main(["train", str(root / "examples" / "tiny.yaml"), "--output", str(out), "training.steps=1",
                 "output.checkpoint_every=0", "output.plot=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows[0]["sync_level"] == "coverage+exact" and rows[0]["sync_verified"]
    assert "✓ coverage+exact v1" in capsys.readouterr().out


# ---------------------------------------------------------------- rollout.local_update: in_place

def _in_place(model_dir) -> LocalRollout:
    b = LocalRollout(seed=0, update="in_place")
    b.start(str(model_dir), version=0)
    return b


def test_in_place_push_lands_the_same_weights_as_a_staged_one(dirs):
    """In place, a push needs no copy of the model (nor buckets: the sender's tensors are copied
    straight into the live weights) and lands exactly what a staged push lands."""
    staged, in_place = _started(dirs["a"]), _in_place(dirs["a"])
    weights = hf_export(dirs["b"])
    for backend in (staged, in_place):
        report = InprocSync(bucket_bytes=64 * 1024).push(weights, backend, 1)
        assert report.details.get("level") == "coverage+exact" and report.num_buckets > 1
        assert backend.weight_version == 1 and not backend.holds_unknown_weights
    assert in_place.weight_checksums() == staged.weight_checksums()
    from rlcore.types import Prompt, SamplingSettings

    out = in_place.generate([Prompt([3, 4, 5], 0)], SamplingSettings(n=2, temperature=1.0, max_new_tokens=3))
    assert len(out) == 2 and all(s.weight_version == 1 for s in out)


def test_in_place_partial_push_leaves_unknown_weights_and_refuses_to_generate(dirs):
    """Part of a failed in-place push has landed: the rollout must not sample from the mix; it says
    so, refuses to generate, and a complete push makes it whole again."""
    from rlcore.errors import RolloutError
    from rlcore.types import Prompt, SamplingSettings

    backend = _in_place(dirs["a"])
    weights = hf_export(dirs["b"])
    partial = [(n, t) for n, t in weights if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"partial push.*k_proj.*unknown weights") as info:
        InprocSync(bucket_bytes=64 * 1024).push(partial, backend, 1)
    assert info.value.receiver_version is None and backend.holds_unknown_weights
    with pytest.raises(RolloutError, match=r"unknown weights .*version 1"):
        backend.generate([Prompt([3, 4, 5], 0)], SamplingSettings(n=1, max_new_tokens=2))
    InprocSync(bucket_bytes=64 * 1024).push(weights, backend, 2)
    assert backend.weight_version == 2 and not backend.holds_unknown_weights
    assert backend.weight_checksums() == _in_place(dirs["b"]).weight_checksums()
    assert len(backend.generate([Prompt([3, 4, 5], 0)], SamplingSettings(n=1, max_new_tokens=2))) == 1


def _export_failing_after(model_dir, n: int):
    """The export of ``model_dir`` that raises after ``n`` tensors (a trainer rank lost mid-push)."""
    for i, item in enumerate(hf_export(model_dir)):
        if i == n:
            raise RuntimeError("gather lost a rank")
        yield item


def test_in_place_push_failing_mid_stream_names_the_unknown_weights(dirs):
    """A push whose weight stream raises after a bucket landed: the sync's error says the receiver
    holds unknown weights (not "stays on version 0", which was true only when staged)."""
    backend = _in_place(dirs["a"])
    with pytest.raises(WeightSyncError, match=r"gather lost a rank.*unknown weights") as info:
        InprocSync(bucket_bytes=4 * 1024).push(_export_failing_after(dirs["b"], 8), backend, 1)
    assert info.value.receiver_version is None and backend.holds_unknown_weights


def test_staged_push_failing_mid_stream_keeps_serving_the_old_version(dirs):
    backend = _started(dirs["a"])
    before = backend.weight_checksums()
    with pytest.raises(WeightSyncError, match=r"stays on version 0") as info:
        InprocSync(bucket_bytes=4 * 1024).push(_export_failing_after(dirs["b"], 8), backend, 1)
    assert info.value.receiver_version == 0 and not backend.holds_unknown_weights
    assert backend.weight_checksums() == before


def test_local_update_is_checked_by_name():
    from rlcore.errors import ConfigError
    from rlcore.stack import load_config

    with pytest.raises(ConfigError, match=r"rollout\.local_update.*in_place") as info:
        load_config(None, ["rollout.local_update=inplace"])
    assert info.value.key == "rollout.local_update"
    # a backend that does not declare in_place_load is refused when the stack resolves:
    # core/tests/test_capability_checks.py
    assert load_config(None, ["rollout.local_update=in_place"])[0].rollout.local_update == "in_place"
