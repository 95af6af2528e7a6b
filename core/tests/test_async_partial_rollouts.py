"""Partial rollouts in the local rollout backend (loop.in_flight=abort, docs/async.md): a push that
lands while ``generate`` runs is taken at the next token; the rows still running resume on the new
weights from where they stopped, every token keeps the log-prob of the version that sampled it
(what the importance-sampling correction divides by), and ``Sample.weight_versions`` records
where the version changed. Checked against plain transformers on each version's weights."""

from __future__ import annotations

import threading
import time

import torch
from rlcore.rollout_local import LocalRollout
from rlcore.testing.conformance import hf_export
from rlcore.testing.models import hf_model
from rlcore.types import Prompt, SamplingSettings
from rlcore.weight_sync import InprocSync

#: greedy from this prompt, dense_a does not stop within 200 tokens: the push lands mid-request
PROMPTS = [Prompt(ids=[8, 9], index=0)]


def _wait(predicate, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _logprobs(model, prompt: list[int], response: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([prompt + response.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)


def test_a_push_mid_generation_resumes_rows_on_the_new_weights(tiny_model_dirs):
    backend = LocalRollout(seed=0)
    backend.start(str(tiny_model_dirs["dense_a"]), version=0)
    assert backend.resumes_in_flight()
    params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=200, seed=11)
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(samples=backend.generate(PROMPTS, params)), daemon=True)
    before = backend.decode_steps
    worker.start()
    _wait(lambda: backend.decode_steps >= before + 3, "generate did not start decoding")
    InprocSync(bucket_bytes=64 * 1024).push(hf_export(tiny_model_dirs["dense_b"]), backend, 1)
    worker.join(60)
    assert not worker.is_alive(), "generate did not return after the push"
    samples = got["samples"]
    resumed = [s for s in samples if s.weight_versions]
    assert resumed, "no row was still running when the push landed"
    old, new = hf_model(tiny_model_dirs["dense_a"]), hf_model(tiny_model_dirs["dense_b"])
    for s in samples:
        n = len(s.response_ids)
        if not s.weight_versions:  # finished before the push: wholly version 0
            assert s.weight_version == 0
            torch.testing.assert_close(s.logprobs, _logprobs(old, s.prompt_ids, s.response_ids), atol=1e-4, rtol=0)
            continue
        (v0, first0), (v1, switch) = s.weight_versions
        assert (v0, first0, v1) == (0, 0, 1) and 0 < switch < n and s.weight_version == 1
        on_old = _logprobs(old, s.prompt_ids, s.response_ids)
        on_new = _logprobs(new, s.prompt_ids, s.response_ids)
        torch.testing.assert_close(s.logprobs[:switch], on_old[:switch], atol=1e-4, rtol=0)
        torch.testing.assert_close(s.logprobs[switch:], on_new[switch:], atol=1e-4, rtol=0)
        assert (on_old[switch:] - on_new[switch:]).abs().max() > 1e-2  # the versions differ where it matters
    assert backend.weight_version == 1


def test_in_place_updates_do_not_resume_in_flight(tiny_model_dirs):
    """In-place pushes write live weights bucket by bucket: the loop must wait for requests in flight."""
    backend = LocalRollout(seed=0, update="in_place")
    assert not backend.resumes_in_flight()
