"""PPO's critic maths (rlcore.algorithms.gae): GAE against a plain reference loop, whitening as
verl's masked_whiten, the clipped value loss against autograd and a hand-computed case, and the
explained variance."""

import math

import pytest
import torch
from rlcore.algorithms.gae import (
    GAEAdvantage,
    clipped_value_loss,
    explained_variance,
    gae,
    gae_per_sample,
    masked_whiten,
    pad,
)
from rlcore.algorithms.spec import AdvantageInput


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float):
    """The textbook recursion, one sequence, plain floats: δ_t = r_t + γV_{t+1} − V_t with V_n = 0."""
    n = len(rewards)
    adv = [0.0] * n
    running = 0.0
    for t in range(n - 1, -1, -1):
        next_v = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def _samples(seed: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    rewards, values = [], []
    for n in lens:
        r = -0.05 * torch.rand(n, generator=g)
        if n:
            r[-1] += float(torch.randint(0, 2, (1,), generator=g))
        rewards.append(r)
        values.append(torch.randn(n, generator=g))
    return rewards, values


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_the_reference_loop_on_sequences_of_different_lengths(gamma, lam):
    lens = [1, 5, 3, 7, 2]
    rewards, values = _samples(0, lens)
    r, mask = pad(rewards)
    v, _ = pad(values)
    v = v + 100.0 * ~mask  # garbage in the padding must not leak into any sequence
    adv, ret = gae(r, v, mask, gamma, lam)
    for i, n in enumerate(lens):
        ref_adv, ref_ret = reference_gae(rewards[i].tolist(), values[i].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(ref_adv, abs=1e-5)
        assert ret[i, :n].tolist() == pytest.approx(ref_ret, abs=1e-5)
        assert bool((adv[i, n:] == 0).all()) and bool((ret[i, n:] == 0).all())


def test_gae_skips_a_masked_gap_inside_a_row():
    """verl's rule: a masked position passes the next value and advantage through, so a row
    with a gap equals the row without it."""
    r = torch.tensor([[0.1, 9.0, 0.2, 1.0]])
    v = torch.tensor([[0.5, 7.0, -0.3, 0.4]])
    mask = torch.tensor([[True, False, True, True]])
    adv, ret = gae(r, v, mask, 0.9, 0.8)
    ref_adv, ref_ret = reference_gae([0.1, 0.2, 1.0], [0.5, -0.3, 0.4], 0.9, 0.8)
    assert adv[0, [0, 2, 3]].tolist() == pytest.approx(ref_adv, abs=1e-6)
    assert ret[0, [0, 2, 3]].tolist() == pytest.approx(ref_ret, abs=1e-6)
    assert float(adv[0, 1]) == 0.0


def test_gae_hand_computed_case():
    # r = [0, 1], V = [0.5, 0.25], γ = 0.5, λ = 0.5
    # δ_1 = 1 − 0.25 = 0.75, A_1 = 0.75; δ_0 = 0 + 0.5·0.25 − 0.5 = −0.375, A_0 = −0.375 + 0.25·0.75 = −0.1875
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2, dtype=torch.bool), 0.5, 0.5)
    assert adv.tolist() == [[-0.1875, 0.75]]
    assert ret.tolist() == [[0.3125, 1.0]]


def test_whitening_is_over_every_response_token_with_bessels_correction():
    x = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = masked_whiten(x, mask)
    vals = [1.0, 2.0, 4.0]
    mean = sum(vals) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in vals) / 2 + 1e-8)
    assert out[mask].tolist() == pytest.approx([(a - mean) / std for a in vals], abs=1e-6)
    assert out[~mask].tolist() == [0.0, 0.0, 0.0]


def test_estimator_uses_the_values_and_whitens_the_step():
    lens = [3, 1, 4]
    rewards, values = _samples(1, lens)
    inp = AdvantageInput(rewards=torch.tensor([float(r.sum()) for r in rewards]), groups=torch.arange(3),
                         token_rewards=rewards, logprobs=[torch.zeros(n) for n in lens], values=values)
    adv = GAEAdvantage(gamma=0.9, lam=0.8)(inp)
    raw = [reference_gae(r.tolist(), v.tolist(), 0.9, 0.8)[0] for r, v in zip(rewards, values, strict=True)]
    flat = torch.tensor([a for seq in raw for a in seq])
    want = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
    assert torch.cat(adv).tolist() == pytest.approx(want.tolist(), abs=1e-5)
    assert [int(a.shape[0]) for a in adv] == lens
    # returns are the value targets: not whitened
    _, ret = gae_per_sample(rewards, values, 0.9, 0.8)
    assert torch.cat(ret).tolist() == pytest.approx(
        [x for r, v in zip(rewards, values, strict=True) for x in reference_gae(r.tolist(), v.tolist(), 0.9, 0.8)[1]],
        abs=1e-5)


def test_clipped_value_loss_hand_computed_case():
    old = torch.tensor([0.0, 0.0, 1.0])
    new = torch.tensor([0.5, -0.1, 1.0])
    ret = torch.tensor([1.0, 1.0, 0.0])
    loss, clipped = clipped_value_loss(new, old, ret, cliprange=0.2)
    # token 0: unclipped (0.5−1)² = 0.25, clipped pred 0.2 → (0.2−1)² = 0.64 → max 0.64, clip active
    # token 1: (−0.1−1)² = 1.21, clip pred −0.1 (inside) → 1.21, not clipped
    # token 2: (1−0)² = 1, same → not clipped
    assert loss.tolist() == pytest.approx([0.32, 0.605, 0.5])
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    off, none = clipped_value_loss(new, old, ret, cliprange=0.0)
    assert off.tolist() == pytest.approx([0.125, 0.605, 0.5]) and none.tolist() == [0.0, 0.0, 0.0]


def test_clipped_value_loss_gradient_matches_autograd_of_the_formula():
    g = torch.Generator().manual_seed(3)
    old, ret = torch.randn(64, generator=g), torch.randn(64, generator=g)
    new = (old + 0.5 * torch.randn(64, generator=g)).requires_grad_(True)
    loss, _ = clipped_value_loss(new, old, ret, cliprange=0.2)
    loss.sum().backward()
    # closed form: where the clipped branch wins and V is outside the band, ∂/∂V = 0; else V − R
    outside = (new.detach() - old).abs() > 0.2
    pred_c = old + (new.detach() - old).clamp(-0.2, 0.2)
    clipped_wins = (pred_c - ret) ** 2 > (new.detach() - ret) ** 2
    want = torch.where(clipped_wins & outside, torch.zeros(64), new.detach() - ret)
    assert torch.allclose(new.grad, want, atol=1e-6)
    assert bool((clipped_wins & outside).any()) and bool((~(clipped_wins & outside)).any())


def test_explained_variance():
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(ret.clone(), ret) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(torch.full((4,), 2.5), ret) == pytest.approx(1 - (5 / 3) / (5 / 3 + 1e-5))
    v = torch.tensor([0.0, 2.0, 2.0, 5.0])
    var = lambda xs: sum((a - sum(xs) / len(xs)) ** 2 for a in xs) / (len(xs) - 1)  # noqa: E731
    want = 1 - var([r - a for r, a in zip(ret.tolist(), v.tolist(), strict=True)]) / (var(ret.tolist()) + 1e-5)
    assert explained_variance(v, ret) == pytest.approx(want)
    assert explained_variance(torch.tensor([1.0]), torch.tensor([2.0])) == 0.0
