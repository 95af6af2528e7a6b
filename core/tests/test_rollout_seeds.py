"""rlcore.rollout_seeds: the seed fallback every rollout backend uses."""

from __future__ import annotations

from types import SimpleNamespace

from rlcore.rollout_seeds import SEED_STRIDE, CallSeeds, base_seed


def _cfg(rollout_seed, training_seed):
    return SimpleNamespace(rollout=SimpleNamespace(seed=rollout_seed), training=SimpleNamespace(seed=training_seed))


def test_base_seed_prefers_rollout_seed():
    assert base_seed(_cfg(None, 7)) == 7
    assert base_seed(_cfg(3, 7)) == 3
    assert base_seed(_cfg(0, 7)) == 0  # 0 is a seed, not "unset"


def test_requested_seeds_win_and_do_not_advance_the_fallback():
    seeds = CallSeeds(5)
    assert seeds.next(None) == 5 * SEED_STRIDE
    assert seeds.next(42) == 42
    assert seeds.next(None) == 5 * SEED_STRIDE + 1
    assert [CallSeeds(5).next(None) for _ in range(2)] == [5 * SEED_STRIDE] * 2  # a new backend repeats the run



def test_step_seed_follows_rollout_seed_and_falls_back_to_training_seed():
    from rlcore.rollout_seeds import step_seed

    assert step_seed(_cfg(None, 7), 3) == 7 * SEED_STRIDE + 3  # what the trainer always asked for
    assert step_seed(_cfg(5, 7), 3) == 5 * SEED_STRIDE + 3  # rollout.seed is no longer overwritten
