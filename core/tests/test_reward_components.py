"""A reward function may return named components (``{name: value}``): each checked, kept on the
samples and summed into the reward (:mod:`rlcore.rewards`; GDPO, in rlcore-algorithms, normalises
them apart: plugins/algorithms/tests/test_algorithms_gdpo.py)."""

from __future__ import annotations

import pytest
import torch
from rlcore.errors import NonFiniteError, RewardError
from rlcore.rewards import call_reward, component_means, keep_components, reward_components
from rlcore.types import Sample


def _sample() -> Sample:
    return Sample(prompt_index=0, prompt_ids=[1], response_ids=torch.tensor([2]), logprobs=torch.zeros(1),
                  weight_version=0)

def test_a_reward_may_return_named_components_checked_one_by_one():
    assert call_reward(lambda x: {"a": 1, "b": torch.tensor(0.5)}, "f", None, "sample 0") == {"a": 1.0, "b": 0.5}
    with pytest.raises(NonFiniteError, match=r"component 'b'"):
        call_reward(lambda x: {"a": 1.0, "b": float("nan")}, "f", None, "sample 0")
    with pytest.raises(RewardError, match=r"component 'b'.*real number"):
        call_reward(lambda x: {"a": 1.0, "b": "high"}, "f", None, "sample 0")
    with pytest.raises(RewardError, match="at least one component"):
        call_reward(lambda x: {}, "f", None, "sample 0")
    with pytest.raises(RewardError, match="non-empty strings"):
        call_reward(lambda x: {1: 1.0}, "f", None, "sample 0")

def test_components_are_kept_on_the_samples_and_summed_into_the_reward():
    samples = [_sample(), _sample()]
    assert keep_components([{"a": 1.0, "b": 0.5}, {"a": 0.0, "b": 1.0}], samples, "f") == [1.5, 1.0]
    comps = reward_components(samples)
    assert {k: v.tolist() for k, v in comps.items()} == {"a": [1.0, 0.0], "b": [0.5, 1.0]}
    assert component_means(comps) == {"reward/a": 0.5, "reward/b": 0.75}
    assert keep_components([1.0, 0.0], [_sample(), _sample()], "f") == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"reward function f returned components \['a'\] for sample 1"):
        keep_components([{"a": 1.0, "b": 0.5}, {"a": 0.0}], [_sample(), _sample()], "f")
    with pytest.raises(RewardError, match="same reward components"):
        keep_components([{"a": 1.0}, 0.5], [_sample(), _sample()], "f")
