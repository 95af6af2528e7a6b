"""Validation on ``data.val_files`` (``validation.*``, docs/data.md "Validation").

Every ``validation.every_steps`` steps (0: off) the trainer runs the validation prompts through the
run's own rollout backend with the current weights and scores them with the run's own reward
(``data.reward``):

* ``val/accuracy``: the mean reward of one greedy response per prompt (``top_k = 1``, as ReMax's
  greedy baseline: every backend takes it; temperature 1, so no backend clamps it);
* with ``validation.n`` > 1, ``n`` samples per prompt at ``validation.temperature`` (unset:
  ``rollout.temperature``; ``rollout.top_p`` / ``top_k``): ``val/pass@k`` (``k = n``), the
  unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374) ``1 - C(n-c, k) / C(n, k)`` averaged over the prompts, ``c`` the samples whose
  reward is at least ``validation.correct_threshold``; and ``val/mean@k``, the mean reward of the
  samples;
* ``val/prompts``, ``val/seconds``, ``val/weight_version`` (the weights measured).

When: before step 0 (the initial weights) and before every step ``s`` with ``s % every_steps ==
0``, in that step's metrics record; and after the last step (the trained weights), in the last
step's record (the last step then skips its own before-step validation). The sampled responses draw
from a seed of their own (:func:`validation_seed`): the training's prompts, samples and torch /
Python RNG state are the same with validation on or off, and a resumed run validates as the
uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError


def check_validation(cfg: Any) -> None:
    """Config-time rules of ``validation.*`` across keys (no file is opened here; the ranges of
    its values are in :data:`rlcore.config._RANGES`)."""
    if int(cfg.validation.every_steps) <= 0:  # off (a negative value: _RANGES' refusal)
        return
    from rlcore.datasets.files import file_list

    if not file_list(cfg.data.val_files, "data.val_files"):
        raise ConfigError("validation.every_steps is set but data.val_files is empty: name the validation files "
                          "(data.val_files), or set validation.every_steps=0", key="validation.every_steps")
    if str(cfg.loop.mode) != "sync":
        raise ConfigError(f"validation.every_steps: validation runs with loop.mode=sync only (loop.mode="
                          f"{cfg.loop.mode} generates ahead of the trainer meanwhile); use loop.mode=sync, or set "
                          f"validation.every_steps=0", key="validation.every_steps")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct samples of ``n``: ``1 - C(n-c,k)/C(n,k)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def validation_seed(cfg: Any, step: int) -> int:
    """The sampling seed of the sampled validation responses at ``step``: a hash of the rollout's
    base seed and the step, below 2**62, apart from every training seed by construction of its
    derivation (those are ``base * 1_000_003 + step + round * 2**53``)."""
    from rlcore.rollout_seeds import base_seed

    digest = hashlib.sha256(f"rlcore.validation:{base_seed(cfg)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def val_metrics(greedy: Sequence[float], sampled: Sequence[Sequence[float]] | None, threshold: float,
                ) -> dict[str, float]:
    """``val/accuracy`` from the greedy rewards (one per prompt); with ``sampled`` (each prompt's
    ``n`` rewards), ``val/pass@k`` and ``val/mean@k`` (``k = n``)."""
    out = {"val/accuracy": sum(greedy) / max(len(greedy), 1), "val/prompts": float(len(greedy))}
    if sampled:
        n = len(sampled[0])
        out["val/pass@k"] = sum(pass_at_k(n, sum(r >= threshold for r in rs), n) for rs in sampled) / len(sampled)
        out["val/mean@k"] = sum(sum(rs) for rs in sampled) / (n * len(sampled))
        out["val/k"] = float(n)
    return out


@dataclass
class Validation:
    """The validation of one run (``validation.*``): :meth:`due_before` and :meth:`due_at_end` say
    when, :meth:`run` measures. ``prompts``: the validation :class:`~rlcore.datasets.DatasetPrompts`
    (prepared)."""

    cfg: Any
    prompts: Any

    @classmethod
    def from_run(cls, cfg: Any, task: Any) -> Validation | None:
        if not int(cfg.validation.every_steps):
            return None
        val = getattr(task, "val", None)
        if val is None or not val.kept:  # check_validation refused the config already; a hand-built run
            raise ConfigError("validation.every_steps is set but the run has no validation prompts (data.val_files)",
                              key="validation.every_steps")
        return cls(cfg, val)

    @property
    def every(self) -> int:
        return int(self.cfg.validation.every_steps)

    def due_before(self, step: int) -> bool:
        """Whether the weights ``step`` starts from are validated before it trains (the last step's
        are validated after it instead, unless it is step 0)."""
        last = int(self.cfg.training.steps) - 1
        return step % self.every == 0 and (step == 0 or step != last)

    def due_at_end(self, step: int) -> bool:
        """Whether the weights ``step`` produced are validated after it: the run's last step."""
        return step > 0 and step == int(self.cfg.training.steps) - 1

    def run(self, step: int, version: int, backend: Any, tokenizer: Any, eos_token_id: int | None,
            score: Callable[[list, list, list], list[float]], environment: Any = None) -> dict[str, float]:
        """Greedy (and with ``n`` > 1 sampled) responses to every validation prompt from ``backend``
        at weight ``version``, scored by ``score`` (the trainer's rewards); the ``val/*`` metrics."""
        from rlcore.types import Prompt, SamplingSettings

        t = time.perf_counter()
        v, r = self.cfg.validation, self.cfg.rollout
        count = len(self.prompts.kept)
        count = min(count, int(v.max_prompts)) if int(v.max_prompts) else count
        task_prompts = [self.prompts.prompt(k) for k in range(count)]  # file order
        prompts = [Prompt(ids=tokenizer(tp.text, add_special_tokens=False)["input_ids"], index=i, meta=tp.meta)
                   for i, tp in enumerate(task_prompts)]
        stop = tuple(x for x in [eos_token_id] if x is not None)
        greedy = SamplingSettings(n=1, temperature=1.0, top_p=1.0, top_k=1, max_new_tokens=r.max_new_tokens,
                                  seed=validation_seed(self.cfg, step), stop_token_ids=stop)
        greedy_rewards = self._generate(greedy, prompts, task_prompts, version, backend, score, environment)
        sampled = None
        n = int(v.n)
        if n > 1:
            temperature = float(r.temperature if v.temperature is None else v.temperature)
            params = SamplingSettings(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                      max_new_tokens=r.max_new_tokens, seed=validation_seed(self.cfg, step) + 1,
                                      stop_token_ids=stop)
            rewards = self._generate(params, prompts, task_prompts, version, backend, score, environment,
                                     per_prompt=n)
            sampled = [rewards[i * n:(i + 1) * n] for i in range(len(prompts))]
        out = val_metrics(greedy_rewards, sampled, float(v.correct_threshold))
        out.update({"val/seconds": time.perf_counter() - t, "val/weight_version": float(version)})
        return out

    def _generate(self, params: Any, prompts: list, task_prompts: list, version: int, backend: Any,
                  score: Callable[[list, list, list], list[float]], environment: Any,
                  per_prompt: int = 1) -> list[float]:
        """The rewards of the responses, ordered by prompt (``per_prompt`` each)."""
        from rlcore.errors import RolloutError
        from rlcore.sampling_rounds import generate_round, round_rewards

        got = generate_round(self.cfg, backend, prompts, task_prompts, params, environment)
        rewards = round_rewards(environment, got, prompts, task_prompts, score)
        stale = [s.weight_version for s in got if s.weight_version != version]
        if stale:
            raise RolloutError(f"rollout returned validation samples of weight version {stale[0]}, expected {version}")
        if len(got) != len(prompts) * per_prompt:
            raise RolloutError(f"rollout returned {len(got)} validation samples for {len(prompts)} prompts x "
                               f"{per_prompt}")
        order = sorted(range(len(got)), key=lambda i: got[i].prompt_index)  # stable: copies keep their order
        return [float(rewards[i]) for i in order]
