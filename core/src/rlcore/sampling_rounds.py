"""One step's samples and rewards: generation rounds, and DAPO's dynamic sampling and overlong
shaping (Yu et al. 2025, "DAPO", arXiv:2503.14476; settings: :mod:`rlcore.algorithm_settings`,
``algorithm.dapo``; docs/algorithms.md).

* **Rounds.** A step generates ``rollout.n`` samples for each of its prompts and scores them: one
  round. Round 0 draws the prompts and sampling seed the step always had; round ``r`` adds
  ``r * 2**53`` to both (:func:`prompt_seed`, :func:`sampling_seed`), past every round-0 value
  (``training.seed`` and ``rollout.seed`` are below 2**32, so round-0 values stay below 2**52 +
  step), so rounds repeat exactly when a resumed run redoes the step.
* **Dynamic sampling** (``dynamic_sampling.enable``, DAPO §3.2): a group (the samples of
  one prompt) whose ``metric`` is exactly equal for all its samples gives every group-baseline
  estimator a zero advantage; it is dropped, and rounds go on until ``data.prompts_per_step``
  groups are kept (groups beyond that in the last round are left unused) or ``max_rounds`` rounds
  ran. At the cap, ``on_max_rounds: train`` (the default) trains on the groups kept and
  ``stop`` ends the run; a step that kept no group at all stops the run either way (there is
  nothing to learn from and nothing sensible to train on).
* **Soft overlong punishment** (``overlong.buffer_tokens`` > 0, DAPO §3.4, ``R_length``): with
  ``L = rollout.max_new_tokens``, ``B = buffer_tokens`` and ``|y|`` the response's tokens, the
  reward gets ``0`` for ``|y| <= L − B``, ``((L − B) − |y|) / B · penalty_factor`` up to ``L``,
  ``−penalty_factor`` beyond; before dynamic sampling and the advantages.
* **Overlong filtering** (``overlong.filter``, DAPO §3.4): a sample the rollout cut at ``L``
  (finish reason ``length``) keeps its reward in its group's baseline but is masked out of the
  loss, through the packed batch's loss mask (:func:`mask_overlong`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlcore.environments.conversation import Limits, conversation_metrics, run_conversations, trained_lengths
from rlcore.errors import RolloutError
from rlcore.faults import fault_point
from rlcore.rollout_seeds import SEED_STRIDE, step_seed
from rlcore.types import Prompt, Sample, SamplingSettings

#: what separates the rounds of one step in the prompt and sampling seeds (see the module docstring)
ROUND_STRIDE = 1 << 53


def prompt_seed(cfg: Any, step: int, round_: int = 0) -> int:
    """The seed of the prompt generator of ``round_`` of ``step`` (round 0: the step's own)."""
    return int(cfg.training.seed) * SEED_STRIDE + int(step) + int(round_) * ROUND_STRIDE


def sampling_seed(cfg: Any, step: int, round_: int = 0) -> int:
    """The sampling seed the trainer asks for in ``round_`` of ``step`` (round 0: ``step_seed``)."""
    return step_seed(cfg, step) + int(round_) * ROUND_STRIDE


def round_prompts(cfg: Any) -> int:
    """Prompts per round: ``dynamic_sampling.prompts_per_round`` when dynamic sampling sets it,
    else ``data.prompts_per_step``."""
    ds = cfg.algorithm.dapo.dynamic_sampling
    return int(ds.prompts_per_round or cfg.data.prompts_per_step) if ds.enable else int(cfg.data.prompts_per_step)


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (0 when ``buffer_tokens`` is 0)."""
    if buffer_tokens <= 0:
        return 0.0
    exceed = length - (max_tokens - buffer_tokens)
    return -min(exceed / buffer_tokens, 1.0) * factor if exceed > 0 else 0.0


def uniform_groups(values: Sequence[float], groups: Sequence[int]) -> set[int]:
    """The groups whose ``values`` are all exactly equal (``np.std == 0`` in verl's recipe; exact
    equality here, so a mean's rounding never keeps a uniform group)."""
    seen: dict[int, set[float]] = {}
    for v, g in zip(values, groups, strict=True):
        seen.setdefault(int(g), set()).add(float(v))
    return {g for g, vals in seen.items() if len(vals) == 1}


def is_masked(sample: Sample, algorithm: Any) -> bool:
    """Whether overlong filtering masks ``sample`` out of the loss."""
    return bool(algorithm.dapo.overlong.filter) and sample.finish_reason == "length"


def loss_lengths(samples: Sequence[Sample], algorithm: Any) -> list[int]:
    """The loss tokens each sample has in the step batch: its trained tokens (the engine's; a
    multi-turn sample's observations are not trained), 0 for a sample overlong filtering masks."""
    return [0 if is_masked(s, algorithm) else n for s, n in zip(samples, trained_lengths(samples), strict=True)]


def mask_overlong(batch: Any, samples: Sequence[Sample], algorithm: Any) -> None:
    """Overlong filtering: the loss mask of the packed ``batch`` loses every token of each masked
    sample (the aggregation's normaliser, KL and entropy terms and the token metrics follow it)."""
    masked = torch.tensor([is_masked(s, algorithm) for s in samples], dtype=torch.bool)
    if bool(masked.any()):
        batch.loss_mask &= ~masked.to(batch.loss_mask.device)[batch.seq_index()]


@dataclass
class SampledStep:
    """The step's samples (kept groups; ``prompt_index`` numbers the groups 0, 1, ... in the order
    kept), the rewards the estimator sees (with the overlong penalty), metrics, and the seconds
    spent in the rollout backend's ``generate``."""

    samples: list[Sample]
    rewards: list[float]
    metrics: dict[str, float]
    generate_seconds: float


def sample_step(cfg: Any, step: int, backend: Any, version: int, eos_token_id: int | None,
                prompts_for: Callable[[int], tuple[list[Prompt], list[Any]]],
                score: Callable[[list[Sample], list[Prompt], list[Any]], list[float]], *,
                environment: Any = None, check_version: bool = True) -> SampledStep:
    """Generate and score rounds until the step is full (see the module docstring).
    ``prompts_for(round)``: the round's prompts and task prompts; ``score``: their rewards.
    ``environment``: the :class:`~rlcore.types.Environment` that takes the model's turns
    (:func:`rlcore.environments.conversation.run_conversations`; ``None``: one prompt, one
    completion, as ``single_turn`` gives); its rewards (per turn, and a final one in place of
    ``score``'s when it gives one) are added to the samples'. ``check_version``: every sample must come from weight ``version`` (the
    synchronous loop); off, the caller accounts for staleness itself."""
    dapo = cfg.algorithm.dapo
    ds, ov = dapo.dynamic_sampling, dapo.overlong
    want = int(cfg.data.prompts_per_step)
    samples: list[Sample] = []
    rewards: list[float] = []
    penalties: list[float] = []
    generated_rewards: list[float] = []  # every round's, kept or not: the policy's own reward rate
    seconds, generated, filtered, kept, rounds = 0.0, 0, 0, 0, 0
    for r in range(int(ds.max_rounds) if ds.enable else 1):
        rounds = r + 1
        t = time.perf_counter()
        prompts, task_prompts = prompts_for(r)
        params = SamplingSettings(
            n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens, seed=sampling_seed(cfg, step, r),
            stop_token_ids=tuple(x for x in [eos_token_id] if x is not None),
            return_routed_experts=cfg.rollout.return_routed_experts,
        )
        got = generate_round(cfg, backend, prompts, task_prompts, params, environment)
        fault_point("rollout")
        seconds += time.perf_counter() - t
        stale = [v for s in got for v in _versions_of(s) if v != version] if check_version else []
        if stale:
            raise RolloutError(f"rollout returned samples of weight version {stale[0]}, expected {version}")
        raw = round_rewards(environment, got, prompts, task_prompts, score)
        pen = [overlong_penalty(len(s.response_ids), int(cfg.rollout.max_new_tokens), int(ov.buffer_tokens),
                                float(ov.penalty_factor)) for s in got]
        shaped = [x + p for x, p in zip(raw, pen, strict=True)]
        if not ds.enable:
            samples, rewards, penalties = got, shaped, pen
            break
        generated_rewards += raw
        groups = [s.prompt_index for s in got]
        drop = uniform_groups(raw if ds.metric == "reward" else shaped, groups)
        generated += len(prompts)
        filtered += len(drop)
        new_index: dict[int, int] = {}
        for s, x, p in zip(got, shaped, pen, strict=True):
            g = s.prompt_index
            if g in drop or (g not in new_index and kept + len(new_index) >= want):
                continue
            new_index.setdefault(g, kept + len(new_index))
            samples.append(replace(s, prompt_index=new_index[g]))
            rewards.append(x)
            penalties.append(p)
        kept += len(new_index)
        if kept >= want:
            break
    metrics: dict[str, float] = {}
    if ds.enable:
        metrics.update({"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups_generated": generated,
                        "dynamic_sampling/groups_filtered": filtered, "dynamic_sampling/groups_kept": kept,
                        "dynamic_sampling/cap_hit": float(kept < want),
                        "dynamic_sampling/reward_generated": sum(generated_rewards) / len(generated_rewards)})
        _check_cap(ds, kept, want, rounds, generated, filtered, step)
    # an environment object built outside run_build (no spec's flag on it) counts as multi-turn, the spec's default
    if environment is not None and getattr(environment, "multi_turn", True):
        metrics.update(conversation_metrics(samples))
    if ov.filter or ov.buffer_tokens:
        truncated = sum(s.finish_reason == "length" for s in samples)
        metrics.update({"overlong/truncated": truncated, "overlong/masked": truncated if ov.filter else 0,
                        "overlong/punished": sum(p < 0 for p in penalties),
                        "overlong/penalty_mean": sum(penalties) / max(len(penalties), 1)})
    return SampledStep(samples, rewards, metrics, seconds)


def generate_round(cfg: Any, backend: Any, prompts: list[Prompt], task_prompts: list[Any], params: SamplingSettings,
                   environment: Any = None) -> list[Sample]:
    """One round's samples: ``backend.generate``, or the conversations ``environment`` takes turns in."""
    if environment is None:
        return backend.generate(prompts, params)
    return run_conversations(environment, backend, prompts, task_prompts, params,
                             Limits.from_config(cfg.environment), f"environment {cfg.environment.name!r}")


def round_rewards(environment: Any, samples: list[Sample], prompts: list[Prompt], task_prompts: list[Any],
                  score: Callable[[list[Sample], list[Prompt], list[Any]], list[float]]) -> list[float]:
    """The rewards of :func:`generate_round`'s samples: ``score``'s, or with an environment its own
    (:func:`_env_rewards`)."""
    if environment is None:
        return score(samples, prompts, task_prompts)
    return _env_rewards(environment, samples, prompts, task_prompts, score)


def _versions_of(s: Sample) -> list[int]:
    """Every weight version a sample's tokens came from."""
    return [s.weight_version, *(v for v, _ in s.weight_versions or ())]


def _env_rewards(environment: Any, samples: list[Sample], prompts: list[Prompt], task_prompts: list[Any],
                 score: Callable[[list[Sample], list[Prompt], list[Any]], list[float]]) -> list[float]:
    """Each conversation's reward: the environment's final reward where it gives one, else
    ``score``'s (``data.reward``, called only for those samples), plus its turns' rewards."""
    final = [s.extras.get("final_reward") for s in samples]
    ask = [i for i, f in enumerate(final) if f is None]
    scored = dict(zip(ask, score([samples[i] for i in ask], prompts, task_prompts), strict=True)) if ask else {}
    out = []
    for i, s in enumerate(samples):
        r = float(final[i]) if final[i] is not None else scored[i]
        turns = s.extras.get("turn_rewards") or ()
        out.append(r + sum(v for _, v in turns) if turns else r)
    return out


def _check_cap(ds: Any, kept: int, want: int, rounds: int, generated: int, filtered: int, step: int) -> None:
    """A step that ran ``max_rounds`` rounds short of ``want`` groups: stop when nothing was kept or
    ``on_max_rounds`` is ``stop``."""
    if kept >= want or (kept and ds.on_max_rounds == "train"):
        return
    what = (f"dynamic sampling kept {kept} of the {want} groups step {step} needs after {rounds} rounds "
            f"(algorithm.dapo.dynamic_sampling.max_rounds): {filtered} of {generated} groups had the same "
            f"{ds.metric} for every sample")
    if not kept:
        raise RolloutError(f"{what}, so there is nothing to train on; the policy may have solved (or cannot yet "
                           f"solve) every prompt: raise max_rounds, or make the task harder (easier)")
    raise RolloutError(f"{what}; on_max_rounds is 'stop': raise max_rounds, or set on_max_rounds=train to train "
                       f"on the groups kept")
