"""The overlapped loop with a real vLLM engine as the rollout (docs/async.md).

* Partial rollouts: a push (rlcore.push.push_weights, as the trainer makes it) while a generate
  call runs stops its requests between two engine steps; they resume on the new weights from
  where they stopped, each token keeping the log-prob of the version that sampled it (checked
  against transformers on both versions' weights).
* ``loop.mode: one_step_off`` trains on examples/vllm_tiny.yaml with ``in_flight`` abort and keep:
  every push verified, samples of step n+1 from version n, and the mismatch correction sees
  their log-probs (vLLM's, of that version)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from rlcore.push import push_weights
from rlcore.testing.conformance import hf_export
from rlcore.testing.models import hf_model
from rlcore.types import Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 8


def _logprobs(model, prompt: list[int], response: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([prompt + response.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)


def _responses(samples) -> list[list[int]]:
    return [s.response_ids.tolist() for s in samples]


def test_a_push_mid_generate_resumes_the_requests_on_the_new_weights(tiny_model_dirs):
    backend = VLLMBackend(VLLMSettings(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25), dtype="float32")
    backend.resume_partial = True  # what build_backend sets for loop.in_flight=abort in an overlapped loop
    backend.start(str(tiny_model_dirs["dense_a"]), version=0)
    sync = VLLMWeightSync(32 * 1024, transport="shm")
    got: dict = {}
    try:
        assert backend.resumes_in_flight()
        # request by request, seeded the prompt's seed + copy, draws what one LLM.generate call with n copies draws
        sampled = SamplingSettings(n=3, temperature=1.0, max_new_tokens=8, seed=9)
        some = [Prompt(ids=[5, 6, 7], index=0), Prompt(ids=[3, 4], index=1)]
        partial = backend.generate(some, sampled)
        backend.resume_partial = False
        whole = backend.generate(some, sampled)
        backend.resume_partial = True
        assert [s.response_ids.tolist() for s in partial] == [s.response_ids.tolist() for s in whole]
        torch.testing.assert_close(torch.cat([s.logprobs for s in partial]), torch.cat([s.logprobs for s in whole]))
        # each prompt its own seed, on both paths: one text under two indices samples differently (one
        # seed for the call drew the same stream for both), the same seed samples the same again, and
        # with seed_per_prompt a prompt's samples do not depend on the prompts beside it
        twins = [Prompt(ids=[5, 6, 7], index=0), Prompt(ids=[5, 6, 7], index=4)]
        for per_prompt in (False, True):
            backend.seed_per_prompt = per_prompt
            backend.resume_partial = True
            partial = backend.generate(twins, sampled)
            backend.resume_partial = False
            whole, again = backend.generate(twins, sampled), backend.generate(twins, sampled)
            assert _responses(partial) == _responses(whole) == _responses(again)
            assert _responses(whole[:3]) != _responses(whole[3:])
        assert _responses(backend.generate(twins[1:], sampled)) == _responses(whole[3:])
        assert _responses(backend.generate(twins, SamplingSettings(n=3, temperature=1.0, max_new_tokens=8,
                                                                   seed=10))) != _responses(whole)
        backend.resume_partial = True
        # greedy from [8, 9], the tiny model (dense_a) does not stop within 200 tokens
        params = SamplingSettings(n=2, temperature=0.0, max_new_tokens=200, seed=5)
        worker = threading.Thread(target=lambda: got.update(samples=backend.generate([Prompt(ids=[8, 9], index=0)],
                                                                                       params)), daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while not any(out is not None and len(out.outputs[0].token_ids) >= 5 for out in list(backend.engine._live.values())):
            assert worker.is_alive() and time.monotonic() < deadline, "generate did not start"
            time.sleep(0.005)
        report, _ = push_weights(backend, sync, hf_export(tiny_model_dirs["dense_b"]), 1, release_kv=False)
        worker.join(120)
        assert not worker.is_alive() and report.verified
    finally:
        sync.close()
        backend.shutdown()
    old, new = hf_model(tiny_model_dirs["dense_a"]), hf_model(tiny_model_dirs["dense_b"])
    for s in got["samples"]:
        (v0, first), (v1, switch) = s.weight_versions
        assert (v0, first, v1) == (0, 0, 1) and 5 <= switch < len(s.response_ids) and s.weight_version == 1
        torch.testing.assert_close(s.logprobs[:switch], _logprobs(old, s.prompt_ids, s.response_ids)[:switch],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(s.logprobs[switch:], _logprobs(new, s.prompt_ids, s.response_ids)[switch:],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("in_flight", ["abort", "keep"])
def test_one_step_off_with_vllm_rollouts(tmp_path, in_flight):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(ROOT / "examples" / "vllm_tiny.yaml"),
                           "--output", str(out), f"training.steps={STEPS}", "output.plot=false",
                           "output.checkpoint_every=0", "loop.mode=one_step_off", "algorithm.mismatch.tis_cap=2.0",
                           f"loop.in_flight={in_flight}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["sync_verified"] for r in rows)
    assert [r["loop/staleness_max"] for r in rows] == [0] + [1] * (STEPS - 1)
    # keep: the push waits for the requests in flight; abort: it goes ahead and they resume
    assert all(("loop/push_wait_s" in r) == (in_flight == "keep") for r in rows)
    # step 0 on version 0 (as sync: vLLM's log-probs equal the trainer's), later steps one version old
    assert rows[0]["mismatch/abs_logprob_diff_max"] < 1e-4
    assert min(r["mismatch/abs_logprob_diff_max"] for r in rows[1:]) > 1e-3
    print(f"\n[figure] one_step_off with vLLM: reward {[round(r['reward_mean'], 3) for r in rows]}, "
          f"trainer waited {sum(r['loop/trainer_wait_s'] for r in rows[1:]) / (STEPS - 1):.3f} s/step")


def test_one_step_off_with_two_vllm_replicas_under_ray(tmp_path):
    """The fleet of vLLM replicas (rlcore-ray) as the overlapped loop's rollout: each replica's
    backend is built from the run's config, so it resumes requests across a push (abort)."""
    ray = pytest.importorskip("ray", reason="scripts/suites/vllm.sh installs rlcore-ray into .venvs/vllm")
    from rlcore.testing.runs import main, read_metrics
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(1, 4):
        assert main(["train", str(ROOT / "examples" / "vllm_tiny.yaml"), "--output", str(tmp_path / "run"),
                     "training.steps=4", "data.prompts_per_step=8", "sync.bucket_mb=0.25", "plugins=[vllm,ray]",
                     "cluster.backend=ray", "cluster.rollout.replicas=2", "cluster.timeout_s=300",
                     "output.progress=false", "output.tensorboard=false", "output.plot=false",
                     "output.checkpoint_every=0", "loop.mode=one_step_off"]) == 0
    assert not ray.is_initialized()
    rows = read_metrics(tmp_path / "run")
    assert [r["loop/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4] and all(r["sync_verified"] for r in rows)
    assert all("loop/push_wait_s" not in r for r in rows)  # abort: the pushes did not wait for requests
