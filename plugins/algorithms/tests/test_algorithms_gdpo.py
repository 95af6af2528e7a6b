"""GDPO (algorithm.name=gdpo): reward components normalised within their groups separately,
weighted, summed, then whitened over the step's tokens; reward functions that return named
components (rlcore/rewards.py) and their per-step metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rlcore.algorithms import AdvantageInput, GRPOAdvantage
from rlcore.errors import ConfigError
from rlcore.stack import load_stack
from rlcore.testing.runs import main, read_metrics
from rlcore_algorithms.advantages import GDPOAdvantage

TINY = str(Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml")
S3 = math.sqrt(3.0)


def _input(components: dict[str, list[float]] | None, groups: list[int], lens: list[int],
           rewards: list[float] | None = None) -> AdvantageInput:
    comps = None if components is None else {k: torch.tensor(v) for k, v in components.items()}
    total = rewards if rewards is not None else [sum(vs) for vs in zip(*components.values(), strict=True)]
    return AdvantageInput(rewards=torch.tensor(total), groups=torch.tensor(groups),
                            token_rewards=[torch.zeros(n) for n in lens], logprobs=[torch.zeros(n) for n in lens],
                            reward_components=comps)


# group 0: four samples, group 1: two; components 'correct' and 'format' (weight 0.5)
CASE = _input({"correct": [1, 0, 0, 0, 1, 1], "format": [1, 1, 0, 1, 0, 1]}, [0, 0, 0, 0, 1, 1],
              [1, 2, 1, 1, 3, 1])
# by hand (population std): group 0 correct: mean 1/4, std √3/4 -> (√3, −1/√3, −1/√3, −1/√3);
# format: mean 3/4, std √3/4 -> (1/√3, 1/√3, −√3, 1/√3), times 0.5; group 1 correct: equal -> 0;
# format: mean 1/2, std 1/2 -> (−1, 1), times 0.5
BY_HAND = [S3 + 0.5 / S3, -1 / S3 + 0.5 / S3, -1 / S3 - 0.5 * S3, -1 / S3 + 0.5 / S3, -0.5, 0.5]


def test_components_are_normalised_per_group_separately_then_weighted_and_summed():
    adv = GDPOAdvantage(weights=(("format", 0.5),), batch_norm=False)(CASE)
    assert [int(a.shape[0]) for a in adv] == [1, 2, 1, 1, 3, 1]
    for a, want in zip(adv, BY_HAND, strict=True):
        torch.testing.assert_close(a, torch.full_like(a, want), rtol=0, atol=1e-5)


def test_batch_norm_whitens_the_sum_over_every_response_token_of_the_step():
    adv = GDPOAdvantage(weights=(("format", 0.5),))(CASE)
    tokens = [v for v, n in zip(BY_HAND, [1, 2, 1, 1, 3, 1], strict=True) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / len(tokens)
    flat = torch.cat(adv)
    torch.testing.assert_close(flat, (torch.tensor(tokens) - mean) / math.sqrt(var + 1e-8), rtol=0, atol=1e-5)


def test_grpo_on_the_summed_reward_differs_where_gdpo_keeps_the_components_apart():
    """The paper's point: (1, 0) and (0, 1) in a group sum to the same reward, so GRPO gives them the
    same advantage; GDPO with unequal weights does not."""
    inp = _input({"correct": [1, 0, 0], "format": [0, 1, 0]}, [0, 0, 0], [1, 1, 1])
    grpo = GRPOAdvantage()(inp)
    assert float(grpo[0]) == pytest.approx(float(grpo[1]))
    gdpo = GDPOAdvantage(weights=(("correct", 2.0),), batch_norm=False)(inp)
    assert float(gdpo[0]) > float(gdpo[1])


@pytest.mark.parametrize("std", ["population", "unbiased", "none"])
def test_a_single_component_gives_grpos_advantages(std):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (12,), generator=g).float().tolist()
    groups, lens = [i // 4 for i in range(12)], [1 + i % 3 for i in range(12)]
    grpo = GRPOAdvantage(std=std)(_input(None, groups, lens, rewards))
    for inp in (_input(None, groups, lens, rewards), _input({"score": rewards}, groups, lens)):
        gdpo = GDPOAdvantage(std=std, batch_norm=False)(inp)
        for a, b in zip(gdpo, grpo, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = AdvantageInput(rewards=torch.tensor(rewards), groups=torch.tensor(groups),
                           token_rewards=[torch.zeros(n) for n in lens], logprobs=[torch.zeros(n) for n in lens])
    for a, b in zip(GDPOAdvantage(std=std, batch_norm=False)(plain), grpo, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_weight_for_a_component_the_reward_does_not_return_names_the_key():
    with pytest.raises(ConfigError, match=r"algorithm\.reward_weights\.style") as err:
        GDPOAdvantage(weights=(("style", 1.0),))(CASE)
    assert err.value.key == "algorithm.reward_weights.style"


# ------------------------------------------------------------------------------ settings --

@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.reward_weights.correct=inf", "algorithm.reward_weights.correct"),
    ("algorithm.kl_in=reward", "algorithm.kl_in"),
    ("algorithm.dapo.overlong.buffer_tokens=2", "algorithm.dapo.overlong.buffer_tokens"),
    ("algorithm.std=median", "algorithm.std"),
    ("algorithm.batch_norm=maybe", "algorithm.batch_norm"),
])
def test_gdpo_settings_errors_name_the_key(override, key):
    extra = ["algorithm.kl_coef=0.1"] if "kl_in" in override else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_stack(TINY, ["plugins=[algorithms]", "algorithm.name=gdpo", override, *extra])
    assert err.value.key == key


def test_gdpo_trains_on_a_two_component_reward_and_logs_each_component(tmp_path):
    assert main(["train", TINY, "--output", str(tmp_path), "plugins=[algorithms]", "algorithm.name=gdpo", "training.steps=2",
                 "data.reward=rlcore.tasks:successor_reward_parts", "algorithm.reward_weights.brief=0.5",
                 "rollout.n=4", "data.prompts_per_step=4", "output.checkpoint_every=0", "output.plot=false",
                 "output.tensorboard=false", "output.progress=false"]) == 0
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert 0 <= r["reward/correct"] <= 1 and 0 <= r["reward/brief"] <= 1
        assert r["reward_mean"] == pytest.approx(r["reward/correct"] + r["reward/brief"])
        assert math.isfinite(r["loss"])
