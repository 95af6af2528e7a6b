"""DAPO's dynamic sampling and overlong shaping (rlcore.sampling_rounds, algorithm.dapo): the
pieces against hand-computed cases, then the real trainer on the embedded default: a step that
needs several rounds, the cap, a resumed run redoing the rounds, the metrics, a learning run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rlcore.batch import PackedBatch
from rlcore.errors import ConfigError, RolloutError
from rlcore.rollout_seeds import step_seed
from rlcore.sampling_rounds import (
    ROUND_STRIDE,
    loss_lengths,
    mask_overlong,
    overlong_penalty,
    prompt_seed,
    sample_step,
    sampling_seed,
    uniform_groups,
)
from rlcore.types import Prompt, Sample

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
QUIET = ["output.plot=false", "output.tensorboard=false", "output.progress=false"]
DS = "algorithm.dapo.dynamic_sampling."
OV = "algorithm.dapo.overlong."

# ------------------------------------------------------------------------ hand-computed ----


def test_soft_overlong_penalty_at_given_lengths():
    # L = 20, B = 4: zero up to 16 tokens, then -1/4 per token down to -factor at 20, clamped beyond
    got = [overlong_penalty(n, 20, 4, 1.0) for n in (0, 15, 16, 17, 18, 19, 20, 25)]
    assert got == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(18, 20, 4, 0.5) == -0.25
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(1, 4, 4, 2.0) == -0.5  # buffer = L: from the first token


def test_uniform_groups_are_those_with_one_value():
    values = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.3]
    groups = [0, 0, 0, 0, 1, 1, 2, 2, 3]
    assert uniform_groups(values, groups) == {1, 2, 3}  # a group of one sample has one value
    assert uniform_groups([0.1 + 0.2, 0.3], [0, 0]) == set()  # exact: 0.30000000000000004 != 0.3


def _cfg(training_seed=3, rollout_seed=None):
    return SimpleNamespace(training=SimpleNamespace(seed=training_seed), rollout=SimpleNamespace(seed=rollout_seed))


def test_round_zero_is_the_step_as_before_and_rounds_never_collide():
    cfg = _cfg()
    assert prompt_seed(cfg, 7) == 3 * 1_000_003 + 7  # what Trainer._prompts seeded before rounds
    assert sampling_seed(cfg, 7) == step_seed(cfg, 7)
    assert sampling_seed(_cfg(3, 5), 7, 2) == step_seed(_cfg(3, 5), 7) + 2 * ROUND_STRIDE
    # the largest round-0 seed (seeds below 2**32, a billion steps) is below the smallest round-1 seed
    big = _cfg(2**32 - 1, 2**32 - 1)
    assert prompt_seed(big, 10**9) < prompt_seed(_cfg(0), 0, 1)
    assert sampling_seed(big, 10**9, 256) < 2**63  # within int64 up to algorithm_settings.MAX_ROUNDS_LIMIT
    seeds = {prompt_seed(cfg, s, r) for s in range(50) for r in range(5)}
    assert len(seeds) == 250


def _dapo(enable=True, metric="reward", max_rounds=4, on_max_rounds="train", prompts_per_round=0, filter=False,
          buffer_tokens=0, penalty_factor=1.0):
    return SimpleNamespace(dynamic_sampling=SimpleNamespace(
        enable=enable, metric=metric, max_rounds=max_rounds, on_max_rounds=on_max_rounds,
        prompts_per_round=prompts_per_round), overlong=SimpleNamespace(
        filter=filter, buffer_tokens=buffer_tokens, penalty_factor=penalty_factor))


class ScriptedRollout:
    """A rollout whose samples are scripted per round: ``lengths[r][prompt]`` response lengths
    (``max_new_tokens`` or more: finish reason 'length'); the reward scripts say what each scores."""

    def __init__(self, lengths, max_new_tokens=4):
        self.lengths, self.max_new_tokens, self.calls = lengths, max_new_tokens, []

    def generate(self, prompts, params):
        r = len(self.calls)
        self.calls.append((len(prompts), params.seed))
        out = []
        for p in prompts:
            for n in self.lengths[r][p.index]:
                out.append(Sample(prompt_index=p.index, prompt_ids=list(p.ids), response_ids=torch.ones(n, dtype=torch.long),
                                  logprobs=torch.zeros(n), weight_version=0,
                                  finish_reason="length" if n >= self.max_new_tokens else "stop"))
        return out


def _run_scripted(dapo, lengths, rewards, prompts_per_step=2):
    """``rewards[r][prompt]``: the rewards of that prompt's samples in round r."""
    cfg = SimpleNamespace(algorithm=SimpleNamespace(dapo=dapo), data=SimpleNamespace(prompts_per_step=prompts_per_step),
                          training=SimpleNamespace(seed=0),
                          rollout=SimpleNamespace(seed=None, n=len(lengths[0][0]), temperature=1.0, top_p=1.0, top_k=-1,
                                                  max_new_tokens=4, return_routed_experts=False))
    backend = ScriptedRollout(lengths)
    asked = []

    def prompts_for(r):
        asked.append(r)
        count = len(lengths[r])
        return [Prompt(ids=[r, i], index=i) for i in range(count)], [f"r{r}p{i}" for i in range(count)]

    def score(samples, prompts, task_prompts):
        r = len(backend.calls) - 1
        pos: dict[int, int] = {}
        out = []
        for s in samples:
            k = pos.get(s.prompt_index, 0)
            pos[s.prompt_index] = k + 1
            out.append(rewards[r][s.prompt_index][k])
        return out

    return sample_step(cfg, 5, backend, 0, None, prompts_for, score), backend, asked


def test_uniform_groups_are_dropped_and_rounds_go_on_until_the_step_is_full():
    lengths = [[[2, 2]] * 3, [[2, 2]] * 3]
    rewards = [[[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]],  # round 0: only prompt 1 varies
               [[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]  # round 1: prompts 1 and 2 vary; one is needed
    res, backend, asked = _run_scripted(_dapo(), lengths, rewards)
    assert asked == [0, 1]
    assert [seed for _, seed in backend.calls] == [step_seed(_cfg(0), 5), step_seed(_cfg(0), 5) + ROUND_STRIDE]
    # kept: round 0 prompt 1 (group 0), round 1 prompt 1 (group 1); round 1 prompt 2 is surplus
    assert [s.prompt_index for s in res.samples] == [0, 0, 1, 1]
    assert [s.prompt_ids for s in res.samples] == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert res.rewards == [0.0, 1.0, 1.0, 0.0]
    assert res.metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/groups_generated": 6,
                           "dynamic_sampling/groups_filtered": 3, "dynamic_sampling/groups_kept": 2,
                           "dynamic_sampling/cap_hit": 0.0, "dynamic_sampling/reward_generated": 5 / 12}


def test_the_cap_trains_on_the_groups_kept_or_stops():
    lengths = [[[2, 2]] * 2] * 2
    rewards = [[[1.0, 1.0], [0.0, 1.0]], [[1.0, 1.0], [0.0, 0.0]]]  # one varied group in two rounds
    res, _, _ = _run_scripted(_dapo(max_rounds=2), lengths, rewards)
    assert len(res.samples) == 2 and res.metrics["dynamic_sampling/cap_hit"] == 1.0
    assert res.metrics["dynamic_sampling/groups_kept"] == 1 and res.metrics["dynamic_sampling/rounds"] == 2
    with pytest.raises(RolloutError, match=r"kept 1 of the 2 groups step 5 needs after 2 rounds.*on_max_rounds is 'stop'"):
        _run_scripted(_dapo(max_rounds=2, on_max_rounds="stop"), lengths, rewards)
    none = [[[1.0, 1.0], [0.0, 0.0]]] * 2
    with pytest.raises(RolloutError, match="kept 0 of the 2 groups .* nothing to train on"):
        _run_scripted(_dapo(max_rounds=2), lengths, none)


def test_the_overlong_penalty_shapes_the_reward_and_may_be_the_filter_metric():
    # max_new_tokens 4, buffer 2: length 4 gets -1 (x factor 0.5), length 3 -0.5 x 0.5, length 2 nothing
    lengths = [[[4, 2], [3, 3]]]
    rewards = [[[1.0, 1.0], [0.0, 0.0]]]  # both uniform by reward; prompt 0 not by shaped reward
    res, _, _ = _run_scripted(_dapo(metric="shaped_reward", max_rounds=1, buffer_tokens=2, penalty_factor=0.5),
                              lengths, rewards, prompts_per_step=1)
    assert res.rewards == [0.5, 1.0]
    assert res.metrics["overlong/punished"] == 1 and res.metrics["overlong/truncated"] == 1
    assert res.metrics["overlong/masked"] == 0 and res.metrics["overlong/penalty_mean"] == -0.25
    off, _, _ = _run_scripted(_dapo(enable=False, buffer_tokens=2, penalty_factor=0.5), lengths, rewards)
    assert off.rewards == [0.5, 1.0, -0.25, -0.25] and "dynamic_sampling/rounds" not in off.metrics


def test_overlong_filtering_masks_truncated_samples_through_the_loss_mask():
    samples = [Sample(0, [5, 6], torch.tensor([1, 2, 3]), torch.zeros(3), 0, finish_reason="length"),
               Sample(0, [5], torch.tensor([4, 0]), torch.zeros(2), 0, finish_reason="stop"),
               Sample(1, [7, 8], torch.tensor([1, 2, 3]), torch.zeros(3), 0, finish_reason="length")]
    algorithm = SimpleNamespace(dapo=_dapo(filter=True))
    batch = PackedBatch.pack([s.prompt_ids + s.response_ids.tolist() for s in samples],
                             [len(s.prompt_ids) for s in samples], align=4)
    before = batch.loss_mask.clone()
    mask_overlong(batch, samples, algorithm)
    # label-aligned: sample 1 (prompt 1 token, response 2) predicts its response from positions 0..1 of
    # its padded slot [8, 12); samples 0 and 2 are masked whole
    assert before.nonzero().flatten().tolist() == [1, 2, 3, 8, 9, 13, 14, 15]
    assert batch.loss_mask.nonzero().flatten().tolist() == [8, 9]
    assert loss_lengths(samples, algorithm) == [0, 2, 0]
    assert batch.seq_sum(batch.loss_mask.long()).tolist() == [0, 2, 0]
    off = SimpleNamespace(dapo=_dapo(filter=False))
    assert loss_lengths(samples, off) == [3, 2, 3]


# ------------------------------------------------------------------------------- config ----


@pytest.mark.parametrize("override, key", [
    (DS + "metric=accuracy", DS + "metric"),
    (DS + "on_max_rounds=retry", DS + "on_max_rounds"),
    (DS + "max_rounds=0", DS + "max_rounds"),
    (DS + "max_rounds=257", DS + "max_rounds"),
    (DS + "prompts_per_round=-1", DS + "prompts_per_round"),
    (OV + "buffer_tokens=5", OV + "buffer_tokens"),  # tiny.yaml: max_new_tokens 4
    (OV + "buffer_tokens=-1", OV + "buffer_tokens"),
    (OV + "penalty_factor=-0.5", OV + "penalty_factor"),
    (OV + "penalty_factor=nan", OV + "penalty_factor"),
    (DS + "max_rounds=lots", DS + "max_rounds"),
    ("algorithm.dapo.filter=true", "algorithm.dapo.filter"),
])
def test_bad_settings_are_refused_naming_the_key(override, key):
    from rlcore.stack import load_config

    with pytest.raises(ConfigError) as exc:
        load_config(TINY, [override])
    assert exc.value.key == key and key in str(exc.value)


def test_settings_that_cannot_hold_together_are_refused():
    from rlcore.stack import load_config

    with pytest.raises(ConfigError, match="needs rollout.n >= 2") as exc:
        load_config(TINY, [DS + "enable=true", "rollout.n=1"])
    assert exc.value.key == DS + "enable"
    with pytest.raises(ConfigError, match="soft overlong penalty, which is off") as exc:
        load_config(TINY, [DS + "enable=true", DS + "metric=shaped_reward"])
    assert exc.value.key == DS + "metric"
    cfg, _ = load_config(TINY, [DS + "enable=true", DS + "metric=shaped_reward", OV + "buffer_tokens=2"])
    assert cfg.algorithm.dapo.overlong.buffer_tokens == 2 and cfg.algorithm.dapo.dynamic_sampling.max_rounds == 10


# ------------------------------------------------------------------------------ trainer ----

REWARDS = '''
from rlcore.tasks import successor_reward


def low_answers_always_right(x):
    """Prompts whose answer is 0-4 score 1 for every sample (uniform groups); the rest score the
    task's reward plus a tenth of the response's token-id sum mod 5 (their samples almost never tie)."""
    if x.meta["answer"] in "01234":
        return 1.0
    return successor_reward(x) + (sum(x.response_ids) % 5) / 10


def constant(x):
    return 0.5
'''


@pytest.fixture(autouse=True)
def one_thread():
    """Oversubscribed intra-op threads on a small shared CPU cost ~10x (every comparison below is
    within this process, under the same setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "dapo_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "dapo_rewards"
    sys.modules.pop("dapo_rewards", None)


def _train(out, *overrides, resume=False):
    from rlcore.run_output import read_metrics
    from rlcore.stack import load_config, resolve
    from rlcore.trainer import Trainer

    cfg, pm = load_config(TINY, [*QUIET, f"output.dir={out}", *overrides])
    Trainer(resolve(cfg, pm), resume=resume).run()
    return read_metrics(out)


def test_a_step_needs_several_rounds_and_reports_them(tmp_path, rewards_module):
    rows = _train(tmp_path / "run", "training.steps=3", "data.prompts_per_step=4", "rollout.n=4",
                  "output.checkpoint_every=0", f"data.reward={rewards_module}:low_answers_always_right",
                  DS + "enable=true")
    assert len(rows) == 3
    for row in rows:
        assert row["dynamic_sampling/groups_kept"] == 4 and row["samples"] == 16
        assert row["dynamic_sampling/groups_generated"] == 4 * row["dynamic_sampling/rounds"]
        # at least the prompts answered 0-4 were dropped (their groups are all 1)
        assert row["dynamic_sampling/groups_filtered"] >= 1
        assert row["dynamic_sampling/cap_hit"] == 0.0
    assert max(row["dynamic_sampling/rounds"] for row in rows) > 1
    # the cap: one round cannot fill the step; trains on fewer groups
    capped = _train(tmp_path / "capped", "training.steps=1", "data.prompts_per_step=4", "rollout.n=4",
                    "output.checkpoint_every=0", f"data.reward={rewards_module}:low_answers_always_right",
                    DS + "enable=true", DS + "max_rounds=1")
    assert any(r["dynamic_sampling/cap_hit"] == 1.0 for r in capped)
    for r in capped:
        assert r["samples"] == 4 * r["dynamic_sampling/groups_kept"] and r["dynamic_sampling/rounds"] == 1


def test_a_step_without_any_varied_group_stops_the_run(tmp_path, rewards_module):
    with pytest.raises(RolloutError, match="kept 0 of the 4 groups step 0 needs after 2 rounds"):
        _train(tmp_path / "run", "training.steps=1", "data.prompts_per_step=4", "rollout.n=4",
               f"data.reward={rewards_module}:constant", DS + "enable=true", DS + "max_rounds=2")


@pytest.mark.slow
def test_a_resumed_run_redoes_the_rounds(tmp_path, rewards_module):
    over = ["data.prompts_per_step=4", "rollout.n=4", f"data.reward={rewards_module}:low_answers_always_right",
            DS + "enable=true", "output.checkpoint_every=2"]
    whole = _train(tmp_path / "whole", "training.steps=4", *over)
    _train(tmp_path / "cut", "training.steps=2", *over)
    resumed = _train(tmp_path / "cut", "training.steps=4", *over, resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    keys = ("dynamic_sampling/rounds", "dynamic_sampling/groups_filtered", "reward_mean", "response_len", "samples")
    for a, b in zip(whole, resumed, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}  # the sampled trajectory: discrete
        # the same process, the same kernels: the continuous values agree to float rounding of the
        # checkpoint round trip (weights and optimizer state are stored exactly)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_overlong_filtering_and_punishment_in_the_trainer(tmp_path):
    rows = _train(tmp_path / "run", "training.steps=2", "data.prompts_per_step=4", "rollout.n=4",
                  "output.checkpoint_every=0", OV + "filter=true", OV + "buffer_tokens=2", OV + "penalty_factor=0.5")
    for row in rows:
        # a tiny model rarely says EOS within 4 tokens: most samples are cut, each masked and punished
        assert row["overlong/masked"] == row["overlong/truncated"] > 0
        assert row["overlong/punished"] >= row["overlong/truncated"]
        assert -0.5 <= row["overlong/penalty_mean"] < 0
        assert row["loss"] is not None and row["grad_norm"] is not None


def test_a_step_whose_every_sample_is_masked_trains_on_nothing(tmp_path):
    # one new token, and the untrained model's first token is not the stop token in any of these 8 draws
    rows = _train(tmp_path / "run", "training.steps=1", "data.prompts_per_step=2", "rollout.n=4",
                  "rollout.max_new_tokens=1", "output.checkpoint_every=0", OV + "filter=true",
                  "algorithm.kl_coef=0.05", "algorithm.loss_agg=seq-mean-token-mean")
    row = rows[0]
    assert row["overlong/masked"] == row["samples"] == 8
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["kl"] == 0.0


@pytest.mark.slow
def test_dynamic_sampling_learns_the_embedded_default(tmp_path):
    """25 steps of examples/tiny.yaml with dynamic sampling (docs/algorithms/dapo_curves.png: 0.15 ->
    0.51 over these steps on 2026-11-27, plain GRPO 0.12 -> 0.33). The reward of every sample
    generated measures the policy; the kept groups' reward_mean is biased by the filter."""
    rows = _train(tmp_path / "run", "training.steps=25", "output.checkpoint_every=0", DS + "enable=true")
    gen = [r["dynamic_sampling/reward_generated"] for r in rows]
    assert all(r["dynamic_sampling/groups_kept"] == 16 or r["dynamic_sampling/cap_hit"] for r in rows)
    assert sum(gen[-5:]) / 5 > sum(gen[:5]) / 5 + 0.2, gen


def _rank_main(rank: int, port: int, out: str, overrides: list[str]) -> None:
    from rlcore.parallel.worker import config_yaml, run_rank
    from rlcore.stack import load_stack

    torch.set_num_threads(1)
    run_rank(config_yaml(load_stack(TINY, [*overrides, f"output.dir={out}"]).config), rank, 2,
             f"127.0.0.1:{port}")


@pytest.mark.slow
def test_data_parallel_ranks_take_the_same_rounds_as_one(tmp_path, gloo_ranks):
    """Rewards are scored on the writer and handed to every rank (rlcore.rewards), samples too, so
    every rank drops the same groups and asks for the same rounds (each a collective)."""
    over = [*QUIET, "training.steps=2", "rollout.n=4", "data.prompts_per_step=6", "output.checkpoint_every=0",
            DS + "enable=true"]
    one = _train(tmp_path / "one", *over)
    gloo_ranks(_rank_main, str(tmp_path / "two"), over).check()
    from rlcore.run_output import read_metrics

    two = read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [0, 1] and one[0]["dynamic_sampling/rounds"] > 1
    # step 0 samples from the same weights on both; after it, two shards' sums in another order leave
    # the weights ~1e-5 apart (test_cluster_dp), which may flip a draw on a probability edge
    a, b = one[0], two[0]
    for k in ("dynamic_sampling/rounds", "dynamic_sampling/groups_filtered", "dynamic_sampling/groups_kept",
              "samples", "reward_mean"):
        assert a[k] == b[k], k
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
