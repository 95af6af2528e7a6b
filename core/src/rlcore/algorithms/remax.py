"""The greedy baseline core generates for an algorithm that asks for one (ReMax, in
rlcore-algorithms: ``A_t = G_t − r(x, ŷ_greedy)``, Li et al. 2023, arXiv:2310.10505; verl's trainer
generates the greedy responses with ``do_sample=False``).

An algorithm whose ``Algorithm.greedy_baseline`` is set gets, from :func:`greedy_rewards` (called
by the trainer after the step's sampling), the reward of one greedy response per prompt
(``top_k = 1``, the same weights, token budget and stop tokens) in
``AdvantageInput.baseline_rewards``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def greedy_rewards(cfg: Any, backend: Any, version: int, eos_token_id: int | None, prompts: list, task_prompts: list,
                   score: Callable[[list, list, list], list[float]], metrics: dict) -> dict[int, float]:
    """One greedy response per prompt and its reward, ``{prompt index: reward}``; adds the
    metrics ``remax/greedy_reward_mean`` and ``remax/greedy_seconds`` to ``metrics``."""
    from rlcore.errors import RolloutError
    from rlcore.types import SamplingSettings

    t = time.perf_counter()
    params = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=1, max_new_tokens=cfg.rollout.max_new_tokens,
                              seed=0, stop_token_ids=tuple(x for x in [eos_token_id] if x is not None))  # greedy: any seed
    got = backend.generate(prompts, params)
    stale = [s.weight_version for s in got if s.weight_version != version]
    if stale:
        raise RolloutError(f"rollout returned greedy samples of weight version {stale[0]}, expected {version}")
    rewards = score(got, prompts, task_prompts)
    metrics.update({"remax/greedy_reward_mean": sum(rewards) / max(len(rewards), 1),
                    "remax/greedy_seconds": time.perf_counter() - t})
    return {s.prompt_index: float(r) for s, r in zip(got, rewards, strict=True)}


def baselines_for(greedy: dict[int, float] | None, samples: list) -> torch.Tensor | None:
    """``[N]``: each sample's prompt's greedy reward (``None`` when there are none)."""
    return None if greedy is None else torch.tensor([greedy[s.prompt_index] for s in samples], dtype=torch.float32)
