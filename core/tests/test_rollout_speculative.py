"""Speculative sampling in the local rollout with MTP drafts (issue 14 items 4-6, local parts):
the output distribution is the target's (chi-square), greedy output is unchanged, acceptance is
reported per depth, a lagging draft fails the push, and the KV-cache release is measured."""

from __future__ import annotations

import itertools

import pytest
import torch
from rlcore import errors
from rlcore.config import TinyModelConfig
from rlcore.engines.tiny import save_tiny
from rlcore.rollout_speculative import DraftStats, accept_drafts


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells with an
    expected count below 5 pooled into one)."""
    n = float(counts.sum())
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _markov(V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # target p(x_{t+1} | x_t)
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # a poor draft q(x_{t+1} | x_t)
    return P, Q


def _sample_chain(P, Q, length, depths, gen, rule):
    seq = [0]
    while len(seq) - 1 < length:
        a = seq[-1]
        drafts, q_rows, ctx = [], [], a
        for _ in range(depths):
            y = int(torch.multinomial(Q[ctx], 1, generator=gen))
            drafts.append(y)
            q_rows.append(Q[ctx])
            ctx = y
        p = torch.stack([P[a]] + [P[y] for y in drafts])  # the target at the last token and after each draft
        emitted, _ = rule(p, torch.stack(q_rows), torch.tensor(drafts), gen, False)
        seq.extend(emitted)
    return tuple(seq[1: length + 1])


def _joint(P, length, V):
    probs = torch.zeros(V ** length)
    for i, xs in enumerate(itertools.product(range(V), repeat=length)):
        pr, a = 1.0, 0
        for x in xs:
            pr *= float(P[a, x])
            a = x
        probs[i] = pr
    return probs


def _counts(samples, length, V):
    counts = torch.zeros(V ** length)
    for xs in samples:
        counts[sum(x * V ** (length - 1 - i) for i, x in enumerate(xs))] += 1
    return counts


def test_speculative_sampling_keeps_the_target_distribution_chi_square():
    V, L, N = 3, 3, 6000
    P, Q = _markov(V)
    gen = torch.Generator().manual_seed(1)
    samples = [_sample_chain(P, Q, L, 2, gen, accept_drafts) for _ in range(N)]
    p_value = chi_square_p(_counts(samples, L, V), _joint(P, L, V))
    assert p_value > 1e-3, p_value

    # the same test has the power to see a wrong rule: accepting every draft samples from q
    def accept_all(p, q, drafts, gen, greedy):
        return [*drafts.tolist(), int(torch.multinomial(p[-1], 1, generator=gen))], len(drafts)

    wrong = [_sample_chain(P, Q, L, 2, gen, accept_all) for _ in range(N)]
    assert chi_square_p(_counts(wrong, L, V), _joint(P, L, V)) < 1e-6


def test_greedy_acceptance_is_argmax_agreement():
    p = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out, accepted = accept_drafts(p, q, torch.tensor([1, 2]), torch.Generator(), greedy=True)
    assert (out, accepted) == ([1, 0], 1)  # depth 2's draft 2 is not the argmax 0: replaced by it


def test_draft_stats_follow_vllms_per_position_definition():
    s = DraftStats()
    s.add(2, 2)
    s.add(2, 0)
    s.add(2, 1)
    s.add(1, 1)  # a round cut short by max_new_tokens drafts depth 1 only
    m = s.metrics()
    assert m["rollout/acceptance_d1"] == pytest.approx(3 / 4) and m["rollout/acceptance_d2"] == pytest.approx(1 / 3)
    assert m["rollout/accept_length"] == pytest.approx(1 + (2 + 0 + 1 + 1) / 4)  # tokens per target forward


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimo")
    save_tiny(d, TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, mtp_layers=2, seed=3),
              ["a", "b", "c"])
    return d


def _rollout(path, depths, seed=0):
    from rlcore.rollout_local import LocalRollout

    r = LocalRollout(seed=seed, draft_depths=depths)
    r.start(str(path))
    return r


def test_greedy_output_and_logprobs_are_unchanged_by_drafting(mimo_dir):
    from rlcore.types import Prompt, SamplingSettings

    params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=5)
    prompts = [Prompt(ids=[3, 4, 5], index=0), Prompt(ids=[5, 4], index=1)]
    plain = _rollout(mimo_dir, 0).generate(prompts, params)
    for depths in (1, 2):
        r = _rollout(mimo_dir, depths)
        spec = r.generate(prompts, params)
        for a, b in zip(plain, spec, strict=True):
            assert a.response_ids.tolist() == b.response_ids.tolist()
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
        m = r.rollout_metrics()
        assert set(m) >= {f"rollout/acceptance_d{k}" for k in range(1, depths + 1)}
        assert all(0 <= m[f"rollout/acceptance_d{k}"] <= 1 for k in range(1, depths + 1))


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_model_chi_square(mimo_dir):
    """Temperature 1 on the tiny MiMo model (6 tokens): the joint distribution of the first two
    sampled tokens with 1-depth drafts equals the target model's exact one."""
    from rlcore.engines.mimo import load_causal_lm
    from rlcore.types import Prompt, SamplingSettings

    model = load_causal_lm(str(mimo_dir), torch.float32).eval()
    prompt = [3, 4]
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        seconds = torch.tensor([[*prompt, a] for a in range(V)])
        p2 = torch.softmax(model(seconds).logits[:, -1], -1)
    eos = int(model.config.eos_token_id)
    exact = (p1[:, None] * p2).flatten()  # cell a * V + b; a sample that stops at eos is cell eos * V
    exact.view(V, V)[eos] = 0.0
    exact[eos * V] = p1[eos]
    r = _rollout(mimo_dir, 1, seed=7)
    N = 300
    out = r.generate([Prompt(ids=prompt, index=0)], SamplingSettings(n=N, temperature=1.0, max_new_tokens=2))
    counts = torch.zeros(V * V)
    for s in out:
        ids = s.response_ids.tolist()
        counts[ids[0] * V + (ids[1] if len(ids) > 1 else 0)] += 1
    assert chi_square_p(counts, exact) > 1e-3
    assert 0 < r.rollout_metrics()["rollout/acceptance_d1"] < 1  # both the accept and the residual path ran


def test_push_reports_draft_version_and_kv_release_and_fails_on_a_lagging_draft(mimo_dir):
    from rlcore.engines.hf import HFEngine
    from rlcore.push import check_draft_version, push_weights
    from rlcore.types import Prompt, SamplingSettings
    from rlcore.weight_sync import InprocSync

    engine = HFEngine.from_pretrained(mimo_dir)
    r = _rollout(mimo_dir, 2)
    r.generate([Prompt(ids=[3, 4], index=0)], SamplingSettings(n=1, temperature=1.0, max_new_tokens=3))
    report, metrics = push_weights(r, InprocSync(1 << 16), engine.export_hf_weights(), 1, release_kv=True)
    assert report.verified and r.weight_version == 1 and r.draft_weight_version == 1
    assert metrics["rollout/draft_weight_version"] == 1
    assert metrics["rollout/kv_cache_freed_bytes"] == 0  # none resident between generate() calls
    assert metrics["rollout/kv_cache_peak_bytes"] > 0
    with pytest.raises(errors.WeightSyncError, match="draft is at weight version 1 but the policy was pushed as version 2"):
        check_draft_version(r, 2)
    assert check_draft_version(_rollout(mimo_dir, 0), 5) == {}  # not drafting: nothing to lag


def test_draft_settings_are_checked_at_config_time(tmp_path):
    from pathlib import Path

    from rlcore.rollout_local import LocalRollout
    from rlcore.stack import load_stack

    tiny = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
    with pytest.raises(errors.ConfigError, match="rollout.draft_depths=1 but engine.model.tiny.mtp_layers=0"):
        load_stack(tiny, ["rollout.draft_depths=1"])
    with pytest.raises(errors.ConfigError, match="rollout.draft_depths"):
        load_stack(tiny, ["rollout.draft_depths=-1"])
    save_tiny(tmp_path, TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48), ["a"])
    with pytest.raises(errors.RolloutError, match="has 0"):
        LocalRollout(draft_depths=1).start(str(tmp_path))
