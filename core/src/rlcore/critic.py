"""PPO's critic in the training loop: built on the training engine (``Cap.VALUE_MODEL``), its
value pass before the advantages, its update, and its part of the checkpoint.

The trainer calls four things (rlcore/trainer.py):

* :func:`build_critic` once: a :class:`Critic` when the selected algorithm's settings have a
  ``critic`` group (``algorithm.name: ppo``), else ``None``;
* :meth:`Critic.advantage_input` after the no-grad passes: the values ``V_t`` of the step's
  response tokens (no gradient), the GAE returns ``R_t`` (the value targets), and the
  :class:`~rlcore.algorithms.spec.AdvantageInput` with the values for the GAE estimator;
* :meth:`Critic.update` before the policy's update (verl's order): ``algorithm.updates_per_step``
  optimizer steps on ``½·max((V−R)², (clip(V, V_old ± c) − R)²)``, token-mean over the step's
  response tokens (:func:`rlcore.algorithms.gae.clipped_value_loss`);
* :meth:`Critic.policy_frozen` for each step: during ``algorithm.critic.warmup_steps`` the
  trainer skips the policy's updates (the weights are still pushed and the step logged);
* :meth:`Critic.state_dict` / :meth:`Critic.load_state_dict` in the checkpoint (model and
  optimizer), so that a resumed run continues the uninterrupted one; model-parallel ranks keep
  it in each rank's shard beside the engine's (:mod:`rlcore.parallel.model_parallel`).

Data-parallel ranks run the critic on the whole step batch (the same values and updates on
every rank, from the same seed): correct, not sharded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlcore import guards
from rlcore.algorithms.gae import clipped_value_loss, explained_variance, gae_per_sample
from rlcore.algorithms.spec import AdvantageInput
from rlcore.batch import PackedBatch
from rlcore.errors import MissingCapabilityError
from rlcore.pass_metrics import PassMetrics
from rlcore.types import Cap

#: the step batch's per-token fields the critic writes ([T], zero off the loss mask)
VALUES = "values"
RETURNS = "returns"


class Critic:
    """A value model (:class:`rlcore.types.value.ValueModel`) and what PPO does with it.
    ``algorithm``: the resolved ``algorithm:`` section (``critic``, ``gamma``, ``lam``)."""

    def __init__(self, model: Any, algorithm: Any, training: Any):
        self.model = model
        self.settings = algorithm.critic
        self.gamma, self.lam = float(algorithm.gamma), float(algorithm.lam)
        self.updates = int(algorithm.updates_per_step)
        self.warmup_steps = int(self.settings.warmup_steps)
        self.micro_batch_tokens = int(training.micro_batch_tokens)
        self.on_nonfinite = str(training.on_nonfinite)
        self.grad_clip = float(training.grad_clip if self.settings.grad_clip < 0 else self.settings.grad_clip)
        lr = float(self.settings.lr or training.lr)
        model.setup_optimizer(lr, tuple(training.betas), float(training.weight_decay))
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------------- before the advantages --

    def advantage_input(self, batch: PackedBatch, inp: AdvantageInput) -> AdvantageInput:
        """Value pass (no gradient), returns, and ``inp`` with the values."""
        mask = batch.loss_mask
        flat = torch.zeros(batch.num_tokens, dtype=torch.float32, device=mask.device)
        self.model.train(False)
        with torch.no_grad():
            for mb in batch.micro_batches(self.micro_batch_tokens):
                start = mb.token_offset - batch.token_offset
                flat[start: start + mb.num_tokens] = self.model.values(mb).detach().float().to(mask.device)
        flat = flat * mask
        counts = inp.response_lengths
        values = list(torch.split(flat[mask].cpu(), counts))
        _, returns = gae_per_sample(inp.token_rewards, values, self.gamma, self.lam, whiten=False)
        ret = torch.zeros(batch.num_tokens, dtype=torch.float32)
        if returns:
            ret[mask.cpu()] = torch.cat(returns)
        batch.fields[VALUES] = flat
        batch.fields[RETURNS] = ret.to(mask.device)
        v, r = flat[mask].cpu(), ret[mask.cpu()]
        self._stats = {
            "critic/values_mean": float(v.mean()) if v.numel() else 0.0,
            "critic/returns_mean": float(r.mean()) if r.numel() else 0.0,
            "critic/explained_variance": explained_variance(v, r),
        }
        return dataclasses.replace(inp, values=values)

    # ------------------------------------------------------------------------------- update --

    def policy_frozen(self, step: int) -> bool:
        """Whether step ``step`` (0-based) is one of the warmup steps that train only the critic."""
        return step < self.warmup_steps

    def update(self, batch: PackedBatch, step: int) -> dict[str, float]:
        """``algorithm.updates_per_step`` optimizer steps on the clipped value loss; metrics of
        the last one. A non-finite loss or gradient raises before the critic's optimizer steps
        (skippable in the first update: nothing has stepped yet)."""
        n_tokens = max(int(batch.num_loss_tokens), 1)
        cliprange = float(self.settings.cliprange_value)
        self.model.train(True)
        metrics: dict[str, float] = {}
        for update in range(self.updates):
            self.model.zero_grad()
            pass_metrics = PassMetrics()
            for i, mb in enumerate(batch.micro_batches(self.micro_batch_tokens)):
                m = mb.loss_mask.to(torch.float32)
                pred = self.model.values(mb)
                per_token, clipped = clipped_value_loss(pred, mb.fields[VALUES].to(pred.device),
                                                        mb.fields[RETURNS].to(pred.device), cliprange)
                loss = (per_token * m.to(pred.device)).sum() / n_tokens
                if not bool(torch.isfinite(loss.detach())):
                    raise guards.nonfinite_error(step, self.on_nonfinite, "critic loss",
                                                 f"{float(loss.detach())} in micro-batch {i}", skippable=update == 0)
                loss.backward()
                pass_metrics.add_sum("critic/vf_loss", loss.detach())
                pass_metrics.add_token_sums({"critic/vf_clipfrac": (clipped * m.to(clipped.device)).sum()}, m.sum())
            problem = guards.grad_norm_problem(self.model.parameters())
            if problem:
                raise guards.nonfinite_error(step, self.on_nonfinite, "critic grad_norm", problem,
                                             skippable=update == 0)
            grad_norm = self.model.optimizer_step(self.grad_clip)
            metrics = {**pass_metrics.result(), "critic/grad_norm": grad_norm}
        return {**self._stats, **metrics, "critic/policy_frozen": float(self.policy_frozen(step))}

    # ---------------------------------------------------------------------------- checkpoint --

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.model.load_state_dict(state)


def build_critic(engine: Any, engine_name: str, cfg: Any) -> Critic | None:
    """A :class:`Critic` when ``algorithm`` has a ``critic`` group (PPO), else None. An engine
    without ``make_value_model`` is refused naming it (``rlcore check`` refuses it earlier, from
    the engine's declared capabilities)."""
    if "critic" not in cfg.algorithm:
        return None
    make = getattr(engine, "make_value_model", None)
    if make is None:
        raise MissingCapabilityError(
            f"algorithm.name={cfg.algorithm.name} trains a value model (critic), but engine {engine_name!r} cannot "
            f"build one (no {Cap.VALUE_MODEL!r} capability: make_value_model); use engine.name=hf")
    return Critic(make(seed=int(cfg.training.seed)), cfg.algorithm, cfg.training)


def checkpoint_entry(critic: Critic | None) -> dict[str, Any]:
    """The critic's part of the trainer's checkpoint state (nothing without a critic)."""
    return {} if critic is None else {"critic": critic.state_dict()}


def restore_critic(critic: Critic | None, state: dict[str, Any]) -> None:
    """Load the critic's part of a checkpoint (a KeyError when it has none: the trainer reports
    the checkpoint as not fitting this run)."""
    if critic is not None:
        critic.load_state_dict(state["critic"])
