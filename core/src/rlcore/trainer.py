"""The training loop. It calls plugins only through the typed manager and the built providers.

One step::

    prompts ─ rollout_backend.generate ─▶ samples ─ reward ─ pack ─▶ PackedBatch ─
      micro-batches by token budget ─▶
        old_logprob pass (no grad)  [forward_request, engine.forward, forward_fn, postprocess]
        ref_logprob pass (KL only)
        mismatch weights, advantages (the algorithm's estimator), aggregation weights
        train pass: the algorithm's policy loss + postprocess loss terms ─ backward ─ optimizer step
      ─ step_end chain ─ pause, release KV ─ weight_sync.push (verified) ─ resume ─ metrics, checkpoint

``loop.mode`` one_step_off / async: a rollout producer thread generates the samples of later
steps while this one trains (rlcore/rollout_producer.py, docs/async.md).
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlcore import __version__, guards
from rlcore.algorithms import objective as objmod
from rlcore.algorithms.advantages import shaped_rewards
from rlcore.algorithms.aggregation import step_weights
from rlcore.algorithms.losses import kl_penalty
from rlcore.algorithms.mismatch import mismatch
from rlcore.algorithms.remax import baselines_for, greedy_rewards
from rlcore.algorithms.spec import AdvantageInput
from rlcore.batch import PackedBatch
from rlcore.critic import checkpoint_entry, restore_critic
from rlcore.environments.conversation import place_turn_rewards
from rlcore.errors import CheckpointError, ConfigError, NonFiniteError
from rlcore.export import MODEL_DIR, export_policy, write_run_config
from rlcore.faults import fault_point
from rlcore.loop_settings import loop_note
from rlcore.lora import lora_on, pushes_adapter
from rlcore.parallel.push_memory import PushMeter
from rlcore.parallel.strategy import RankStrategy
from rlcore.pass_metrics import PassMetrics
from rlcore.push import push_weights, rollout_metrics
from rlcore.ranks import on_writer
from rlcore.rewards import RewardCalls, component_means, keep_components, reward_components, score_on_writer
from rlcore.rollout_producer import apply_staleness, step_source
from rlcore.run_build import build_run, check_started_rollout
from rlcore.run_output import CHECKPOINT_DIR, checkpoint_hf_dir, is_committed
from rlcore.run_stop import StopSignals
from rlcore.sample_batch import pack_samples
from rlcore.sampling_rounds import loss_lengths, mask_overlong, prompt_seed, round_prompts, sample_step
from rlcore.stack import Stack, config_yaml
from rlcore.sync import sync_level
from rlcore.tasks import RewardInput, make_prompts
from rlcore.types import Cap, HeadInput, MicroBatchContext, ModelOutput, Prompt, Sample, StepContext
from rlcore.validation import Validation

#: where the no-grad passes leave their log-probs in the step batch ("old_logprobs" holds the
#: rollout engine's behaviour log-probs, which the importance ratio uses)
RECOMPUTED = "recomputed_logprobs"
SUM_PI_SQUARED = "sum_pi_squared"  #: Σπ² per token from the old-log-prob pass (AlgorithmSpec.head_needs)
PHASE_OUTPUT = {"old_logprob": RECOMPUTED, "ref_logprob": "ref_logprobs"}


class Trainer:
    """Runs the steps of a run that :func:`rlcore.run_build.build_run` builds from ``stack`` (the
    output directory, the checkpoint to resume, the providers). ``strategy``: how the trainer's
    ranks share each step (:mod:`rlcore.parallel.strategy`; default one process). ``run()``
    returns a summary dict."""

    def __init__(self, stack: Stack, resume: bool = False, console: Any = None, *, overwrite: bool = False,
                 allow_config_change: bool = False, strategy: RankStrategy | None = None):
        built = build_run(stack, strategy or RankStrategy(), resume=resume, console=console, overwrite=overwrite,
                          allow_config_change=allow_config_change)
        self.built, self.stack, self.cfg, self.pm = built, built.stack, built.stack.config, built.stack.plugins
        self.strategy, self.ranks = built.strategy, built.strategy.ranks  # several ranks: only the writer writes
        self.out, self.run_dir, self.console = built.out, built.run_dir, built.console
        self.engine, self.tokenizer, self.forward_fn = built.engine, built.tokenizer, built.forward_fn
        self.backend, self.sync, self.reference, self.critic = built.backend, built.sync, built.reference, built.critic
        self.algorithm, self.metrics, self.report = built.algorithm, built.metrics, built.report
        # the policy objective (its β follows algorithm.kl_control), the mismatch correction
        self.objective, self.kl_control, self.correction = built.objective, built.kl_control, built.correction
        a = self.cfg.algorithm
        #: the field the ratio's denominator comes from
        self.proximal = {"recompute": RECOMPUTED, "current": objmod.CURRENT}.get(a.old_logprobs, objmod.ROLLOUT)
        #: old_logprobs current: no no-grad pass; the train pass leaves its log-probs where that pass would
        self.current = self.proximal == objmod.CURRENT
        self.sum_pi_squared = Cap.SUM_PI_SQUARED in built.algorithm_spec.head_needs
        self.router = self.pm.router_hook if self.pm.has_router_hooks() else None
        self.reward_calls = RewardCalls(built.reward_fn, self.cfg.data.reward, self.cfg.data.reward_timeout_seconds)
        self.step = 0
        self.version = 0
        self.wall_before = 0.0  # wall seconds of earlier (resumed) segments
        self.release_kv = False
        #: LoRA (rlcore.lora): pushes carry the adapters only, or full merged weights (a backend without adapters)
        # what the backend has here: a declared capability with a gap in this config (rlcore-vllm's
        # receive_adapters under vllm.mode=http) does not count, so auto merges there
        self.push_adapter = pushes_adapter(self.cfg, {c for c in stack.rollout_backend.capabilities
                                                      if stack.has("rollout_backend", c)})
        self.push_metrics: dict[str, float] = {}
        self.source: Any = None  # where the steps' samples come from (run() builds it)
        self.validation = Validation.from_run(self.cfg, built.task)  # validation.every_steps (rlcore/validation.py)

    # ----------------------------------------------------------------------------- setup --

    def _start_backend(self) -> None:
        self._check_weights_finite("rollout engine starts from them", hint="the model loaded (engine.model.path, or "
                                   "the checkpoint resumed) holds NaN/inf")
        on_writer(self.ranks, lambda: write_run_config(self.out, config_yaml(self.stack)))  # for rlcore export
        model_dir = self.out / "policy_hf"  # what the rollout starts from; the trained model: rlcore/export.py
        if lora_on(self.cfg) and not self.push_adapter:  # a backend that takes full weights starts from them
            on_writer(self.ranks, lambda: self.engine.save_merged(model_dir))
        else:
            self._write_policy_hf(model_dir)
        self.backend.start(str(model_dir), version=self.version)
        self.release_kv = check_started_rollout(self.stack, self.backend, self.report)

    def _write_policy_hf(self, model_dir: Path) -> None:
        """The policy as an HF directory: policy_hf, RUN/model, step-N-hf (written as the strategy says)."""
        self.strategy.write_policy_hf(self.engine, model_dir)

    def _restore(self) -> None:
        point, self.built.resume_from = self.built.resume_from, None
        path = self.out / CHECKPOINT_DIR / str(point.record["state_file"])
        state = self.strategy.rank_state(self.out, point.state, point.record)  # model parallel: this rank's shard
        try:  # a checkpoint of another model or engine fails here: name the file, not a traceback
            self.engine.load_state_dict(state["engine"])
            restore_critic(self.critic, state)
            self.objective = self.kl_control.restore(state, self.objective)
            step = int(state["step"])
            self.version = int(state["version"])
            self.wall_before = float(state["wall_seconds"])
            torch.set_rng_state(state["torch_rng"])
            py = state["python_rng"]
            random.setstate((py[0], tuple(py[1]), py[2]))
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            detail = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())[:400]
            raise CheckpointError(f"checkpoint {path} does not fit this run: {type(exc).__name__}: {detail}") from exc
        self.step = step + 1
        self.metrics.truncate_after(step)
        for d in point.config_diffs:
            self.report.note(f"--allow-config-change: {d}")
        self.console.print(f"resumed from step {step} (weight version {self.version}, {path})")

    def _checkpoint(self, wall: float) -> None:
        self._check_weights_finite("checkpoint")
        run_state = {**self.kl_control.state(), "step": self.step, "version": self.version, "wall_seconds": wall,
                     "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "rlcore_version": __version__}
        record = {"step": self.step, "version": self.version, "rlcore_version": __version__,
                  "config": self.built.fingerprint}
        self.strategy.save_checkpoint(  # the engine's and the critic's state: whole, or each rank's shard
            self.out, lambda: {"engine": self.engine.state_dict(), **checkpoint_entry(self.critic)}, run_state, record,
            keep=int(self.cfg.output.keep_checkpoints))
        export_policy(self, checkpoint_hf_dir(self.out, self.step), self.step, at_checkpoint=True)

    # ------------------------------------------------------------------- non-finite guards --

    def _nonfinite(self, what: str, detail: str, skippable: bool = True) -> NonFiniteError:
        return guards.nonfinite_error(self.step, self.cfg.training.on_nonfinite, what, detail, skippable)

    def _check_weights_finite(self, before: str, hint: str = "resume from the last checkpoint") -> None:
        guards.check_weights_finite(self.engine, self.step, before, hint)

    # ----------------------------------------------------------------------------- steps --

    def _prompts(self, step: int, round_: int = 0) -> tuple[list[Prompt], list[Any]]:
        source = getattr(self.built.task, "source", None)  # data.train_files: by step and round (rlcore/datasets)
        if source is not None:
            task_prompts = source.prompts(step, round_, round_prompts(self.cfg))
        else:
            rng = random.Random(prompt_seed(self.cfg, step, round_))  # round 0: the step's own prompts
            task_prompts = make_prompts(self.built.task, rng, round_prompts(self.cfg), f"step {step} round {round_}")
        prompts = [
            Prompt(ids=self.tokenizer(tp.text, add_special_tokens=False)["input_ids"], index=i, meta=tp.meta)
            for i, tp in enumerate(task_prompts)
        ]
        return prompts, task_prompts

    def _rewards(self, samples: list[Sample], prompts: list[Prompt], task_prompts: list[Any],
                 step: int) -> list[float]:
        """Scored on the writer, each call time-limited and checked; named components kept on the samples
        (rlcore/rewards.py)."""
        inputs = []
        for s in samples:
            tp, resp = task_prompts[s.prompt_index], s.response_ids.tolist()
            text = self.tokenizer.decode(resp, skip_special_tokens=True)
            inputs.append(RewardInput(tp.text, text, s.prompt_ids, resp, tp.meta, s.finish_reason))
        return keep_components(score_on_writer(self.ranks, self.reward_calls, inputs, lambda i: (
            f"sample {i} of step {step} (prompt {samples[i].prompt_index}: {inputs[i].prompt_text!r}, "
            f"response {inputs[i].response_text!r})")), samples, self.cfg.data.reward)

    def _forward_pass(self, batch: PackedBatch, phase: str, engine: Any, divisor: float,
                      grad: bool) -> dict[str, float]:
        """Run this rank's micro-batches of the step's ``batch`` through engine + head (+ loss and
        backward in ``train``; ``divisor``: the step's aggregation divisor, see
        rlcore.algorithms.aggregation); the no-grad passes leave their log-probs in ``batch``. The
        pass's metrics, reduced over the micro-batches and the ranks."""
        cfg = self.cfg
        train = phase == "train"
        metrics = PassMetrics()
        mbs = self.strategy.micro_batches(batch, int(cfg.training.micro_batch_tokens))
        step_loss_tokens = batch.num_loss_tokens
        keep_logprobs = not train or self.current
        logprob_out = torch.zeros(batch.num_tokens, device=batch.device) if keep_logprobs else None
        sum_sq_out = torch.zeros(batch.num_tokens, device=batch.device) \
            if phase == "old_logprob" and self.sum_pi_squared else None
        for i, mb in enumerate(mbs):
            ctx = MicroBatchContext(step=self.step, phase=phase, index=i, count=len(mbs), batch=mb, config=cfg,
                                    num_tokens_in_step=step_loss_tokens)
            req = self.pm.forward_request(ctx)
            with torch.set_grad_enabled(grad):
                out = engine.forward(mb, record_routes=req.record_routes, router=self.router, micro_batch=ctx,
                                     **req.engine_kwargs())
                hw = engine.head()
                request = None  # Cap.FUSED_LOSS: the head forms the loss and its gradients itself
                if train and Cap.FUSED_LOSS in self.stack.forward_fn.capabilities:
                    request = objmod.loss_request(mb, self.objective, divisor, self.proximal, self.correction)
                head = self.forward_fn(self._head_input(mb, out, hw, compute_entropy=train, loss=request,
                                                        sum_sq=sum_sq_out is not None))
                native = self._native_logprobs(mb, ctx, engine, hw) if req.native_logprobs else None
                results = self.pm.postprocess(ctx, ModelOutput(out, head, hw, self.forward_fn, native))
                for _plugin, res in results:
                    for k, v in res.metrics.items():
                        metrics.add_mean(k, v)
                    for k, v in res.batch_updates.items():
                        batch.write_back(mb, k, v.detach())
                if train:
                    terms = [(f"loss/{plugin}/{name}", term) for plugin, res in results
                             for name, term in res.loss_terms.items()]
                    terms += [(f"loss/engine/{name}", term) for name, term in out.aux_losses.items()]
                    self._backward(mb, head, terms, divisor, metrics, f"train micro-batch {i} of {len(mbs)}")
                if keep_logprobs:
                    start = mb.token_offset - batch.token_offset
                    logprob_out[start: start + mb.num_tokens] = head.logprobs.detach().float()
                if sum_sq_out is not None:
                    sum_sq_out[start: start + mb.num_tokens] = head.sum_pi_squared.detach().float()
        if train:
            self.strategy.reduce_gradients(engine.parameters())
        if logprob_out is not None:
            self.strategy.reduce_logprobs(logprob_out)
            batch.fields[PHASE_OUTPUT.get(phase, RECOMPUTED)] = logprob_out
        if sum_sq_out is not None:
            self.strategy.reduce_logprobs(sum_sq_out)
            batch.fields[SUM_PI_SQUARED] = sum_sq_out
        return self.strategy.reduce_metrics(metrics).result()

    def _backward(self, mb: PackedBatch, head: Any, terms: list[tuple[str, torch.Tensor]], divisor: float,
                  metrics: PassMetrics, where: str) -> None:
        """The micro-batch's policy loss plus the plugins' and the engine's loss terms, backward."""
        loss, token_sums = objmod.micro_batch_loss(mb, head.logprobs, head.entropy, self.objective, divisor,
                                                   self.proximal, head_loss=head.loss, correction=self.correction)
        for key, term in terms:
            loss = loss + term
            metrics.add_sum(key, term.detach())
        if not bool(torch.isfinite(loss.detach())):
            raise self._nonfinite("loss", f"{float(loss.detach())} in {where}")
        loss.backward()
        metrics.add_sum("loss", loss.detach())
        tokens = token_sums.pop("_tokens")  # the statistics are sums over them: averaged over the pass's tokens
        metrics.add_token_sums(token_sums, tokens)

    def _head_input(self, mb: PackedBatch, out: Any, hw: Any, compute_entropy: bool, loss: Any = None,
                    sum_sq: bool = False) -> HeadInput:
        return HeadInput(hidden=out.hidden, weight=hw.weight, labels=mb.labels(), vocab=hw.vocab,
                         loss_mask=mb.loss_mask, temperature=float(self.cfg.rollout.temperature),
                         sequence_parallel=out.sequence_parallel, compute_entropy=compute_entropy, loss=loss,
                         compute_sum_pi_squared=sum_sq)

    def _native_logprobs(self, mb: PackedBatch, ctx: MicroBatchContext, engine: Any, hw: Any) -> torch.Tensor:
        """The micro-batch's log-probs with every router routing natively (``forward_request``
        asked ``native_logprobs``): one more forward, no router_hook chain, no gradient."""
        with torch.no_grad():
            out = engine.forward(mb, micro_batch=ctx)
            return self.forward_fn(self._head_input(mb, out, hw, compute_entropy=False)).logprobs.detach().float()

    def _sample(self, step: int, backend: Any) -> Any:
        """Step ``step``'s samples and rewards from ``backend``: generation rounds, DAPO's dynamic
        sampling and overlong shaping (rlcore/sampling_rounds.py). Called in the step (sync) or
        by the rollout producer, ahead of it: everything here derives from ``step``."""
        sampled = sample_step(self.cfg, step, backend, self.version, self.engine.info.eos_token_id,
                              lambda r: self._prompts(step, r), lambda *a: self._rewards(*a, step=step),
                              environment=self.built.environment, check_version=self.cfg.loop.mode == "sync")
        sampled.metrics.update(rollout_metrics(self.backend))  # acceptance per draft depth
        return sampled

    def _train_step(self) -> dict[str, Any]:
        """One step (see the module docstring); its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        produced, loop_metrics = self.source.take(self.step)
        sampled = produced.sampled
        samples, rewards, rescore, stale_metrics = apply_staleness(sampled.samples, sampled.rewards, self.version,
                                                                  cfg.loop, self.step, produced.start_version)
        t_gen = loop_metrics.get("loop/trainer_wait_s", sampled.generate_seconds)  # sync: this step generated
        batch = pack_samples(samples, rewards, self.engine, self.step)
        mask_overlong(batch, samples, cfg.algorithm)
        device = getattr(self.engine, "device", None)
        if device is not None:  # one host-to-device copy per step; micro-batches are views of it
            batch = batch.to(device)
        a = cfg.algorithm
        weights = step_weights(a.loss_agg, batch.loss_mask, batch.seq_index(), batch.num_seqs, int(a.norm_tokens))
        batch.fields[objmod.AGG_NUMERATOR] = weights.numerator

        metrics: dict[str, Any] = {**sampled.metrics, **loop_metrics}
        if cfg.loop.mode != "sync":
            metrics.update(stale_metrics)
        greedy = greedy_rewards(cfg, self.backend, self.version, self.engine.info.eos_token_id,
                                *self._prompts(self.step, 0), lambda *a: self._rewards(*a, step=self.step),
                                metrics) if self.algorithm.greedy_baseline else None  # ReMax
        self.engine.train(False)
        if not self.current:  # old_logprobs current: the train pass's own log-probs are the proximal policy's
            t_old = time.perf_counter()
            old_metrics = self._forward_pass(batch, "old_logprob", self.engine, weights.divisor, grad=False)
            metrics["old_logprob_seconds"] = time.perf_counter() - t_old  # inside train_seconds too
            metrics.update({f"old/{k}": v for k, v in old_metrics.items()})
            metrics.update(self._mismatch_metrics(batch))
        if bool(rescore.any()):  # loop.stale=rescore: too-stale samples' behaviour log-probs are the trainer's
            stale_tokens = rescore.to(batch.loss_mask.device)[batch.seq_index()]
            batch.fields[objmod.ROLLOUT] = torch.where(stale_tokens, batch.fields[RECOMPUTED],
                                                       batch.fields[objmod.ROLLOUT])
        if self.reference is not None:
            self._forward_pass(batch, "ref_logprob", self.reference, weights.divisor, grad=False)
        metrics.update(self._algorithm_inputs(batch, samples, rewards, greedy))
        problem = guards.advantages_problem(batch.fields["advantages"], batch.seq_fields.get("advantage"), rewards)
        if problem:
            raise self._nonfinite("advantages", problem)
        metrics.update(self.critic.update(batch, self.step) if self.critic else {})  # before the policy's, as verl
        self.engine.train(True)
        # algorithm.critic.warmup_steps: the critic alone learns; the policy is pushed unchanged
        frozen = self.critic is not None and self.critic.policy_frozen(self.step)
        train_metrics, grad_norm = {}, 0.0
        # algorithm.updates_per_step > 1: PPO-style epochs over the step's batch; from the second
        # update on the ratio moves away from 1 and the losses' clipping rules differ
        for _update in range(0 if frozen else int(cfg.algorithm.updates_per_step)):
            self.engine.zero_grad()
            train_metrics = self._forward_pass(batch, "train", self.engine, weights.divisor, grad=True)
            problem = guards.grad_norm_problem(self.engine.parameters())
            if problem:
                raise self._nonfinite("grad_norm", problem)
            grad_norm = self.engine.optimizer_step(cfg.training.grad_clip)
            if not math.isfinite(grad_norm):  # an engine whose gradients grad_norm_problem cannot see
                self._check_weights_finite("push")  # the optimizer stepped with it: stop if it hurt the weights
                raise self._nonfinite("grad_norm",
                                      f"{grad_norm} reported by the optimizer step (which left the weights finite)")
        if self.current:  # measured on the train pass's log-probs: the weights the updates had
            metrics.update(self._mismatch_metrics(batch))
            metrics.update(mismatch(batch.fields[RECOMPUTED], batch.fields[objmod.ROLLOUT], batch.loss_mask,
                                    batch.seq_index(), batch.num_seqs, self.correction).metrics)
        t_train = time.perf_counter() - t0 - t_gen
        self.objective, kl_metrics = self.kl_control.step_end(self.objective, batch)  # the next step's β

        resp_lens = [len(s.response_ids) for s in samples]
        metrics.update({**train_metrics, **kl_metrics})
        metrics.update({
            "reward_mean": sum(rewards) / len(rewards),
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)),
            "grad_norm": grad_norm,
            "response_len": sum(resp_lens) / len(resp_lens),
            "samples": len(samples),
            "tokens": batch.num_tokens,
            "generate_seconds": t_gen,
            "train_seconds": t_train,
        })
        metrics.update(self.pm.step_end(StepContext(self.step, batch, metrics, cfg)))
        return metrics

    @staticmethod
    def _mismatch_metrics(batch: PackedBatch) -> dict[str, float]:
        """``|trainer − rollout|`` log-prob statistics over the loss tokens."""
        d = (batch.fields[RECOMPUTED] - batch.fields[objmod.ROLLOUT]).abs()[batch.loss_mask]
        return {"logprob_mismatch_mean": float(d.mean()) if d.numel() else 0.0,
                "logprob_mismatch_max": float(d.max()) if d.numel() else 0.0}

    def _algorithm_inputs(self, batch: PackedBatch, samples: list[Sample], rewards: list[float],
                          greedy: dict[int, float] | None = None) -> dict[str, float]:
        """Fill the step batch's mismatch weights and advantages (after the no-grad passes:
        both may need the trainer's and the reference's log-probs)."""
        a = self.cfg.algorithm
        mask = batch.loss_mask
        seq_index = batch.seq_index()
        # old_logprobs current: no trainer log-probs yet; the loss computes the weights per token from its own
        mm = None if self.current else mismatch(batch.fields[RECOMPUTED], batch.fields[objmod.ROLLOUT], mask,
                                                seq_index, batch.num_seqs, self.correction)
        if mm is not None and mm.correction is not None:
            batch.fields[objmod.CORRECTION] = mm.correction.to(batch.fields[RECOMPUTED].device)
        counts = batch.seq_sum(mask.to(torch.long)).tolist()
        lens = loss_lengths(samples, a)  # 0 for a sample overlong filtering masks
        if counts != lens:
            raise RuntimeError(f"loss tokens per sequence {counts} differ from the response lengths {lens}")

        def per_sample(x: torch.Tensor) -> list[torch.Tensor]:
            return list(torch.split(x[mask].detach().float().cpu(), counts))

        out: dict[str, float] = {}
        penalty = None
        if a.kl_in == "reward" and a.kl_coef > 0:
            penalty = per_sample(-self.kl_control.beta * kl_penalty(batch.fields[RECOMPUTED], batch.fields["ref_logprobs"],
                                                                 a.kl_estimator))
            out["kl_reward_penalty"] = float(sum(float(p.sum()) for p in penalty)) / max(len(penalty), 1)
        token_rewards, seq_rewards = shaped_rewards(rewards, counts, penalty, self.algorithm.token_level_rewards)
        place_turn_rewards(token_rewards, samples, rewards)  # an environment's per-turn rewards on their turns
        components = reward_components(samples)  # GDPO's; metrics reward/<name>
        out.update(component_means(components))
        inp = AdvantageInput(rewards=seq_rewards, groups=torch.tensor([s.prompt_index for s in samples]),
                             token_rewards=token_rewards, logprobs=per_sample(batch.fields[objmod.ROLLOUT]),
                             baseline_rewards=baselines_for(greedy, samples), reward_components=components,
                             recomputed_logprobs=None if self.current else per_sample(batch.fields[RECOMPUTED]),
                             sum_pi_squared=per_sample(batch.fields[SUM_PI_SQUARED]) if self.sum_pi_squared else None,
                             correction=None if mm is None or mm.correction is None else per_sample(mm.correction))
        inp = self.critic.advantage_input(batch, inp) if self.critic else inp  # PPO: values, returns
        adv = self.algorithm.advantages(inp)
        if len(adv) != len(samples) or [int(x.shape[0]) for x in adv] != counts:
            spec = self.built.algorithm_spec
            raise RuntimeError(
                f"algorithm {spec.name!r} ({spec.source()}) returned advantages of lengths "
                f"{[tuple(x.shape) for x in adv]}, expected one [n_i] tensor per sample with n_i = {counts}"
            )
        flat = torch.zeros(batch.num_tokens, dtype=torch.float32)
        if adv:
            flat[mask.cpu()] = torch.cat([x.float().cpu() for x in adv])
        batch.fields[objmod.ADVANTAGES] = flat.to(mask.device)
        batch.seq_fields["advantage"] = torch.stack([x.mean() if x.numel() else torch.zeros(()) for x in adv]).to(mask.device)
        out["advantage_abs_mean"] = float(flat[mask.cpu()].abs().mean()) if bool(mask.any()) else 0.0
        out.update(mm.metrics if mm is not None else {})
        return out

    def _push(self, version: int) -> Any:
        meter = self.strategy.push_meter()  # the writer's memory during the push (distributed ranks)
        with self.source.pushing(version) as loop_metrics, meter:  # the producer starts no request meanwhile
            report, metrics = push_weights(self.backend, self.sync, self._export_for_push(meter), version,
                                           self.release_kv)
        self.push_metrics = {**metrics, **meter.metrics(), **loop_metrics}
        return report

    def _export_for_push(self, meter: PushMeter) -> Any:
        weights = self.engine.export_adapter() if self.push_adapter else self.engine.export_hf_weights()
        for n, (name, t) in enumerate(weights):
            meter.sample()  # a gathered full tensor is alive next to the bucket being filled
            yield name, t
            if n == 0:
                fault_point("push")

    # ------------------------------------------------------------------------------- run --

    def _validate(self, step: int) -> dict[str, float]:
        """The ``val/*`` metrics of the current weights (rlcore/validation.py)."""
        return self.validation.run(step, self.version, self.backend, self.tokenizer, self.engine.info.eos_token_id,
                                   lambda *a: self._rewards(*a, step=step), environment=self.built.environment)

    def _step_source(self) -> Any:
        """Where the steps' samples come from (``loop.mode``; rlcore/rollout_producer.py)."""
        mode = self.cfg.loop.mode
        why = ("the trainer runs as several ranks" if self.ranks.distributed else
               "the algorithm's greedy baseline (ReMax) generates inside the step" if self.algorithm.greedy_baseline
               else None)
        if mode != "sync" and why:
            raise ConfigError(f"loop.mode={mode} overlaps generation with training, but {why}: use loop.mode=sync",
                              key="loop.mode")
        return step_source(self.cfg.loop, self._sample, self.backend, int(self.cfg.training.steps))

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        # SIGINT/SIGTERM: stop at the step boundary, a second one at once (rlcore/run_stop.py)
        self.stop = StopSignals(self.out, lambda: self.step).install(not self.ranks.distributed)
        started = completed = False
        try:
            self.source = self._step_source()
            if self.built.resume_from is not None:
                self._restore()
            self.report.banner([loop_note(cfg.loop)])  # loop_note: ahead_steps past the bound
            self._start_backend()
            started = completed = self.stop.stepping = True
            self.source.start(self.step, self.version)
            t_start = time.perf_counter()
            limit = float(cfg.training.max_wall_seconds or 0)
            while self.step < cfg.training.steps:
                if self.stop.requested is not None:
                    completed = False
                    break
                val = self._validate(self.step) if self.validation and self.validation.due_before(self.step) else {}
                t0 = time.perf_counter()
                try:
                    m = self._train_step()
                    self._check_weights_finite("push")
                except NonFiniteError as exc:
                    self.engine.zero_grad()
                    record = {"step": self.step, "weight_version": self.version, "nonfinite": exc.what,
                              "wall_seconds": self.wall_before + time.perf_counter() - t_start, **val}
                    if not (exc.skippable and cfg.training.on_nonfinite == "skip"):
                        self.metrics.write(dict(record, stopped=str(exc)))
                        raise
                    self.metrics.write(dict(record, skipped=str(exc)))
                    self.report.skipped(self.step, exc)
                    self.source.finished(self.step)
                    self.step += 1
                    continue
                self.version += 1
                report = self._push(self.version)
                self.source.finished(self.step)
                wall = self.wall_before + time.perf_counter() - t_start
                step_s = time.perf_counter() - t0
                m.update({
                    "step": self.step,
                    "weight_version": self.version,
                    "sync_seconds": report.seconds,
                    "sync_bytes": report.bytes,
                    "sync_buckets": report.num_buckets,
                    "sync_verified": report.verified,
                    "sync_level": sync_level(report),
                    "step_seconds": step_s,
                    "wall_seconds": wall,
                    "tokens_per_second": m["tokens"] / max(step_s, 1e-9),
                    **self.push_metrics,
                    **val,
                })
                if self.validation and self.validation.due_at_end(self.step):  # the trained weights
                    m.update(self._validate(self.step))
                self.metrics.write(m)
                self.report.step(m, report)
                if cfg.output.checkpoint_every and (self.step + 1) % cfg.output.checkpoint_every == 0:
                    self._checkpoint(wall)
                self.step += 1
                if limit and self.ranks.broadcast(wall > limit):  # every rank stops at the same step
                    self.console.print(f"[yellow]stopping:[/] training.max_wall_seconds={limit:g} reached")
                    completed = self.step >= cfg.training.steps
                    break
            self.source.close()  # a producer that does not stop is an error here (its LoopStallError)
            wall = self.wall_before + time.perf_counter() - t_start
            self._checkpoint_final(wall)
            export_policy(self, self.out / MODEL_DIR, self.step - 1, at_checkpoint=False)  # the trained model
        finally:
            self.stop.uninstall()
            self.metrics.close()
            self._close_source()  # the producer thread is stopped and joined before the backend goes
            self.backend.shutdown()
            self.sync.close()
            if callable(getattr(self.engine, "close", None)):  # its process groups, before the launcher's world
                self.engine.close()
            self._end_run(started)
        summary = self.report.summary(completed) if self.ranks.writer else {"completed": completed, "rank": self.ranks.rank}
        return dict(summary, stopped_by=None if completed else self.stop.requested)

    def _close_source(self) -> None:
        """On the way out of a failed run: stop the producer; one that does not stop is reported,
        not raised over the error that ended the run (its thread is a daemon: it cannot keep the
        process alive)."""
        try:
            if self.source is not None:
                self.source.close()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
            print(f"rlcore: {exc}", file=sys.stderr, flush=True)

    def _end_run(self, started: bool) -> None:
        """Release the output directory; a start that failed first removes what a new run created.
        A run that stops before it recorded a step (its first rollout, environment or reward raised)
        failed to start too: it holds nothing to keep, and keeping it would make the retry need
        --overwrite (a --resume start deletes nothing either way)."""
        if self.run_dir is not None:
            metrics = self.out / "metrics.jsonl"
            recorded = self.step > 0 or (metrics.is_file() and metrics.stat().st_size > 0)
            self.run_dir.release() if started and recorded else self.run_dir.abandon()

    def _checkpoint_final(self, wall: float) -> None:
        # the last step's checkpoint may be committed already: a committed file is never rewritten
        if self.step > 0 and not on_writer(self.ranks, lambda: is_committed(self.out, self.step - 1)):
            self.step -= 1
            self._checkpoint(wall)
            self.step += 1
