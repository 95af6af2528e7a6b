"""``rollout.seed_per_prompt``: the local rollout's samples do not depend on how a step's prompts
are split into calls (what rollout replicas do), and they follow the processed distribution."""

from __future__ import annotations

import torch
from rlcore.rollout_local import LocalRollout, inverse_cdf
from rlcore.types import Prompt, SamplingSettings
from rlcore_ray.fleet import split_prompts


def _backend(model_dir, per_prompt=True):
    b = LocalRollout(seed=0, seed_per_prompt=per_prompt)
    b.start(str(model_dir), version=0)
    return b


def _key(samples):
    return [(s.prompt_index, s.response_ids.tolist(), s.finish_reason) for s in samples]


def test_split_calls_draw_the_same_samples_as_one_call(tiny_model_dirs):
    backend = _backend(tiny_model_dirs["dense_a"])
    prompts = [Prompt(ids=[5 + i, 7, 9 + (i % 3)], index=i) for i in range(7)]
    params = SamplingSettings(n=4, temperature=1.0, max_new_tokens=6, seed=1234)
    whole = backend.generate(prompts, params)
    for parts in (2, 3):
        shares = split_prompts(prompts, parts)
        assert sorted(len(s) for s in shares)[-1] - sorted(len(s) for s in shares)[0] <= 1
        split = [s for share in shares for s in backend.generate(share, params)]
        assert _key(split) == _key(whole)
        for a, b in zip(split, whole, strict=True):
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    # not vacuous: the copies of a prompt differ, and another step seed draws other samples
    assert len({tuple(s.response_ids.tolist()) for s in whole}) > len(prompts)
    other = backend.generate(prompts, SamplingSettings(n=4, temperature=1.0, max_new_tokens=6, seed=1235))
    assert _key(other) != _key(whole)


def test_one_generator_per_call_depends_on_the_split(tiny_model_dirs):
    """Why the setting exists: the default sampler draws the whole call from one generator."""
    backend = _backend(tiny_model_dirs["dense_a"], per_prompt=False)
    prompts = [Prompt(ids=[5 + i, 7, 9], index=i) for i in range(6)]
    params = SamplingSettings(n=4, temperature=1.0, max_new_tokens=6, seed=99)
    whole = backend.generate(prompts, params)
    split = [s for share in split_prompts(prompts, 2) for s in backend.generate(share, params)]
    assert _key(split) != _key(whole)


def test_inverse_cdf_follows_the_distribution_and_never_picks_masked_tokens():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]]).repeat(20000, 1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = inverse_cdf(probs, u)
    freq = torch.bincount(tok, minlength=5).double() / tok.numel()
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq, probs[0].double(), atol=0.015)
    assert int(inverse_cdf(probs[:1], torch.tensor([1.0 - 1e-12]))) == 4  # rounding never runs past the end
