"""A multi-turn sample in the packed batch (issue 29): observations in the sequence but out of the
loss mask; each turn's routed experts (replay) are the rows the engine reported when it generated
that turn; a conversation that spans weight versions says so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rlcore.batch import PackedBatch
from rlcore.environments.conversation import Limits, run_conversations
from rlcore.errors import BatchShapeError
from rlcore.sample_batch import pack_samples
from rlcore.types import EnvStep, Prompt, Sample, SamplingSettings

OBS = [5, 6]


class TwoObservations:
    def reset(self, prompt, task_prompt):
        return None

    def step(self, state, turn):
        return EnvStep(done=False, observation_ids=OBS)

    def final_reward(self, state):
        return None


def test_pack_masks_the_tokens_a_response_mask_leaves_out():
    mask = torch.tensor([True, False, False, True])
    b = PackedBatch.pack([[1, 2, 3, 4, 5, 6], [1, 2, 3]], [2, 1], response_masks=[mask, None],
                         target_fields={"old_logprobs": [torch.tensor([-1.0, 0.0, 0.0, -2.0]), torch.tensor([-3.0, -4.0])]})
    # label-aligned: position t predicts token t + 1; sequence 0's response starts at token 2
    assert b.loss_mask.tolist() == [False, True, False, False, True, False, True, True, False]
    assert b.fields["old_logprobs"][b.loss_mask].tolist() == [-1.0, -2.0, -3.0, -4.0]
    with pytest.raises(BatchShapeError, match=r"response_masks\[0\] must be a bool tensor of the sequence's 4"):
        PackedBatch.pack([[1, 2, 3, 4, 5, 6]], [2], response_masks=[torch.tensor([True, False])])


class Backend:
    """Generates ``k`` tokens per turn (ids 20, 21, ...) with routes whose every row is the turn's
    number, and a weight version that moves one per call: a real backend's outputs, deterministic,
    so the stitching is checked row by row (the local backend's own routes: test below)."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for p in prompts:
            for _ in range(params.n):
                ids = torch.arange(20, 20 + params.max_new_tokens)
                routes = torch.full((len(p.ids) + len(ids) - 1, 2, 1), self.calls, dtype=torch.int16)
                out.append(Sample(p.index, list(p.ids), ids, torch.full((len(ids),), -0.5), self.calls,
                                  routed_experts=routes))
        return out


def test_routes_of_each_turn_come_from_the_turn_that_generated_it():
    prompts = [Prompt(ids=[1, 2, 3], index=0)]
    [s] = run_conversations(TwoObservations(), Backend(), prompts, [None], SamplingSettings(n=1, max_new_tokens=2),
                            Limits(3, 0, 9))
    # sequence: 1 2 3 | 20 21 | 5 6 | 20 21 | 5 6 | 20 21   (P = 3, 13 tokens, 12 route rows)
    rows = s.routed_experts[:, 0, 0].tolist()
    # rows 2..3 produced turn 0's tokens (call 1), rows 6..7 turn 1's (call 2), the rest from the last call's prefill
    assert rows == [3, 3, 1, 1, 3, 3, 2, 2, 3, 3, 3, 3]
    assert s.weight_version == 1 and s.weight_versions == ((1, 0), (2, 4), (3, 8))
    assert s.response_mask.tolist() == [True, True, False, False] * 2 + [True, True]
    assert s.logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0] * 2 + [-0.5, -0.5]


def test_the_local_backends_routes_over_a_conversation(tmp_path):
    from rlcore.rollout_local import LocalRollout
    from rlcore.testing.models import make_model_dir

    path = make_model_dir(tmp_path / "moe", arch="qwen3_moe")
    backend = LocalRollout(seed=0)
    backend.start(str(path))
    seen = []

    class Keep:
        def generate(self, prompts, params):
            got = backend.generate(prompts, params)
            seen.append(got)
            return got

    params = SamplingSettings(n=2, max_new_tokens=3, seed=4, return_routed_experts=True)
    samples = run_conversations(TwoObservations(), Keep(), [Prompt(ids=[3, 4, 5], index=0)], [None], params,
                                Limits(2, 0, 9))
    backend.shutdown()
    for i, s in enumerate(samples):
        first, last = seen[0][i], seen[1][i]
        n = len(s.prompt_ids) + len(s.response_ids)
        assert s.routed_experts.shape[0] == n - 1
        P, R = len(first.prompt_ids), len(first.response_ids)
        assert torch.equal(s.routed_experts[P - 1: P + R - 1], first.routed_experts[P - 1: P + R - 1])
        assert torch.equal(s.routed_experts[P + R - 1:], last.routed_experts[P + R - 1:])
    engine = SimpleNamespace(info=SimpleNamespace(route_layout=None, pad_token_id=0))
    batch = pack_samples(samples, [1.0, 0.0], engine, 0)
    assert int(batch.loss_mask.sum()) == sum(int(s.response_mask.sum()) for s in samples) == 2 * 2 * 3
