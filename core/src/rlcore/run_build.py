"""Building a run, before its first step: the output directory, the checkpoint to resume, and
the providers. :func:`build_run` hands :class:`rlcore.trainer.Trainer` a :class:`BuiltRun`; the
trainer only runs steps.

In order: the preflight checks (nothing is touched before they pass), the output directory (the
writer takes it: lock, run marker; a new run needs it empty, ``--resume`` a committed checkpoint
in it), the checkpoint (read by the writer and handed to every rank, so a damaged one or one of
another config fails before the model loads), the device platform, then the providers: engine,
forward_fn, rollout backend, weight sync, environment (each from its spec's factory), the KL reference, the
algorithm (its objective, KL control and mismatch correction) and PPO's critic. A start that fails removes what a new run created
(:meth:`rlcore.run_output.RunDirectory.abandon`). The rank strategy decides which rank writes and
may wrap the stack (:meth:`rlcore.parallel.strategy.RankStrategy.prepare_stack`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore import __version__
from rlcore.algorithms.kl_control import KLControl
from rlcore.algorithms.losses import TokenObjective
from rlcore.algorithms.mismatch import MismatchCorrection
from rlcore.config import training_fingerprint
from rlcore.critic import Critic, build_critic
from rlcore.datasets import DatasetTask, build_task, context_limit, data_files, engine_positions
from rlcore.environments.conversation import NamedEnvironment
from rlcore.errors import ConfigError, RLCoreError, RolloutError
from rlcore.manager import hook_error
from rlcore.parallel.strategy import RankStrategy
from rlcore.platforms import resolve_device
from rlcore.preflight import preflight
from rlcore.ranks import on_writer
from rlcore.run_output import (
    MetricsWriter,
    NullMetrics,
    RunDirectory,
    load_checkpoint,
    prepare_output_dir,
    quiet_transformers,
)
from rlcore.run_report import RunReport
from rlcore.stack import Stack, check_engine_head
from rlcore.tasks import Task, load_callable, resolve_reward
from rlcore.tracking.selection import Trackers, run_versions
from rlcore.types import BuildContext, Cap


@dataclass
class ResumePoint:
    """The committed checkpoint ``--resume`` continues from (:func:`rlcore.run_output.load_checkpoint`)."""

    state: dict[str, Any]
    record: dict[str, Any]
    #: the config changes ``--allow-config-change`` let through, each said as a note
    config_diffs: list[str]


@dataclass
class BuiltRun:
    """What the loop runs with: the run directory, the checkpoint to resume, the providers."""

    stack: Stack  # as the rank strategy prepared it
    strategy: RankStrategy
    out: Path
    #: the writer's hold on ``out`` (lock, what a failed start removes); ``None`` on other ranks
    run_dir: RunDirectory | None
    fingerprint: dict[str, Any]
    resume_from: ResumePoint | None
    console: Any
    task: Task
    reward_fn: Callable[..., Any]
    platform: Any
    device: Any
    engine: Any
    tokenizer: Any
    forward_fn: Any
    backend: Any
    sync: Any
    #: the frozen KL reference (``algorithm.kl_coef > 0``)
    reference: Any
    algorithm_spec: Any
    algorithm: Any
    #: the policy loss with its KL and entropy terms (β as configured; adaptive KL moves it per step)
    objective: TokenObjective
    kl_control: KLControl
    #: the rollout/trainer mismatch correction (``algorithm.mismatch``)
    correction: MismatchCorrection
    critic: Critic | None
    metrics: MetricsWriter | NullMetrics
    report: RunReport
    #: the environment that takes the model's turns (``environment.name``: built-in ``single_turn``,
    #: one prompt and one completion scored by ``data.reward``); ``None`` only where a run is built
    #: by hand (the same single-turn rollout)
    environment: Any = None


def build_run(stack: Stack, strategy: RankStrategy, *, resume: bool = False, console: Any = None,
              overwrite: bool = False, allow_config_change: bool = False) -> BuiltRun:
    """Everything the loop needs, built (see the module docstring)."""
    taken: list[RunDirectory] = []
    engines: list[Any] = []
    try:
        return _build(stack, strategy, resume, console, overwrite, allow_config_change, taken, engines)
    except BaseException:  # a failed start leaves nothing that makes the retry refuse
        for engine in engines:  # what it initialised process-wide (megatron's groups), as the trainer's end does
            if callable(getattr(engine, "close", None)):
                engine.close()
        for run_dir in taken:
            run_dir.abandon()
        raise


def _build(stack: Stack, strategy: RankStrategy, resume: bool, console: Any, overwrite: bool,
           allow_config_change: bool, taken: list[RunDirectory], engines: list[Any]) -> BuiltRun:
    ranks = strategy.ranks
    cfg = stack.config
    checked = preflight(stack)  # what would fail later (rlcore/preflight.py), refused before the output directory is touched
    out = Path(cfg.output.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")

    def take_directory() -> None:  # one run and one process per directory
        taken.append(prepare_output_dir(out, resume=resume, overwrite=overwrite, info={"rlcore_version": __version__}))

    on_writer(ranks, take_directory)
    fingerprint = training_fingerprint(cfg, stack.plugins.plugin_settings())
    resume_from = None
    if resume:  # a checkpoint that is damaged or from another config fails here, before the model loads
        resume_from = ResumePoint(*on_writer(ranks, lambda: load_checkpoint(out, fingerprint, allow_config_change)))
    if console is None:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True, quiet=not (cfg.output.progress and ranks.writer))

    quiet_transformers()
    torch.manual_seed(cfg.training.seed)
    random.seed(cfg.training.seed)
    if data_files(cfg):  # data.train_files: the files preflight read (rlcore/datasets)
        task: Task = checked.task if isinstance(checked.task, DatasetTask) else build_task(cfg)
    else:
        task = load_callable(cfg.data.task, "data.task")(cfg.data)
    reward_fn = resolve_reward(load_callable(cfg.data.reward, "data.reward"), cfg.data)  # a factory: its reward
    stack = strategy.prepare_stack(stack)
    sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}
    platform = device = None

    def ctx_for(spec: Any, engine: Any = None) -> BuildContext:
        section = sections.get(spec.plugin)
        return BuildContext(config=cfg, settings=cfg[section] if section else None, output_dir=str(out),
                            engine=engine, extras={"task": task}, device=device, platform=platform,
                            engine_capabilities=frozenset(  # what it declares less what this config or platform lacks
                                c for c in stack.engine.capabilities if stack.has("engine", c))
                            if engine is not None else frozenset())

    # the device platform first: a vendor extension (torch_npu) is imported by its factory
    platform_ctx = ctx_for(stack.platform) if stack.platform is not None else BuildContext(config=cfg)
    resolved = resolve_device(cfg.engine.device, ctx=platform_ctx, spec=stack.platform)
    platform, device = resolved.platform, resolved.device

    engine = _make(stack.engine, "engine", ctx_for(stack.engine))
    engines.append(engine)
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("the training engine provides no tokenizer; set engine.model.path", key="engine.model.path")
    check_engine_head(stack, engine)
    if isinstance(task, DatasetTask):  # rendered with this engine's tokenizer, measured against its positions
        limit = context_limit(cfg, engine_positions(engine))
        task.source.prepare(tokenizer, limit, str(cfg.data.overlong))
        console.print(task.source.summary(limit))
        if task.val is not None:  # data.val_files: the validation prompts (rlcore.validation)
            task.val.prepare(tokenizer, limit, str(cfg.data.overlong))
            console.print(f"validation {task.val.summary(limit)}")
    forward_fn = _make(stack.forward_fn, "forward_fn", ctx_for(stack.forward_fn, engine))
    backend = _make(stack.rollout_backend, "rollout_backend", ctx_for(stack.rollout_backend, engine))
    sync = _make(stack.weight_sync, "weight_sync", ctx_for(stack.weight_sync, engine))
    # what takes the model's turns (a stack built by hand may have none: the single-turn rollout); its
    # reset/step/final_reward raising is an error naming its plugin, as a hook's is
    environment = None
    if stack.environment:
        spec = stack.environment
        env_ctx = ctx_for(spec, engine)  # its tools first, each from its own plugin's factory (environment.tools)
        env_ctx.extras["tools"] = [_make(t, "tool", ctx_for(t, engine)) for t in stack.tools]
        environment = NamedEnvironment(_make(spec, "environment", env_ctx), str(spec.plugin),
                                       str(spec.distribution), spec.name, tokenizer, multi_turn=spec.multi_turn)
    engine.setup_optimizer(cfg.training)
    reference = engine.make_reference() if cfg.algorithm.kl_coef > 0 else None
    algorithm_spec = stack.algorithm or stack.plugins.select("algorithm", cfg.algorithm.name, key="algorithm.name")
    a = cfg.algorithm
    algorithm = algorithm_spec.factory(a)
    objective = TokenObjective(algorithm.loss, kl_coef=float(a.kl_coef) if a.kl_in == "loss" else 0.0,
                               kl_estimator=a.kl_estimator, entropy_coef=float(a.entropy_coef))
    critic = build_critic(engine, stack.engine.name, cfg)  # PPO's value model (rlcore/critic.py)
    strategy.built(engine, reference)
    return BuiltRun(
        stack=stack, strategy=strategy, out=out, run_dir=taken[0] if taken else None, fingerprint=fingerprint,
        resume_from=resume_from, console=console, task=task, reward_fn=reward_fn, platform=platform,
        device=device, engine=engine, tokenizer=tokenizer, forward_fn=forward_fn, backend=backend, sync=sync,
        reference=reference, algorithm_spec=algorithm_spec, algorithm=algorithm, objective=objective,
        kl_control=KLControl.from_config(a), correction=MismatchCorrection.from_config(a.mismatch), critic=critic,
        metrics=(MetricsWriter(out, Trackers.start(stack.trackers, out, cfg, run_versions(stack.plugins)))
                 if ranks.writer else NullMetrics()),
        report=RunReport(console, stack, algorithm_spec.name, out), environment=environment,
    )


def _make(spec: Any, hook: str, ctx: BuildContext) -> Any:
    """``spec.factory(ctx)``: what raises there is one line naming the plugin, the provider and its
    factory (:func:`rlcore.manager.hook_error`), as a hook's exception is; rlcore's own errors pass."""
    try:
        return spec.factory(ctx)
    except RLCoreError:
        raise
    except Exception as exc:
        raise hook_error(str(spec.plugin), str(spec.distribution), f"the factory of {hook} {spec.name!r}", exc) from exc


def check_started_rollout(stack: Stack, backend: Any, report: RunReport) -> bool:
    """After ``backend.start``: what the running instance lacks against its declaration (a note
    when this config uses it, an error when this config requires it); returns whether the KV
    cache is released during weight pushes (``rollout.release_kv_cache``)."""
    cfg = stack.config
    declared = stack.rollout_backend.capabilities
    runtime = backend.capabilities()
    # what this running instance lacks and this config uses (stack.wanted); any other gap is no news
    lost = sorted((declared - runtime) & set(stack.wanted.get("rollout_backend", {})))
    reasons = backend.lacking() if hasattr(backend, "lacking") else {}
    for cap in lost:
        why = reasons.get(cap, "not available in this running instance")
        report.note(f"rollout backend {stack.rollout_backend.name!r} lacks {cap!r}: {why}")
    mode = cfg.rollout.release_kv_cache
    can = Cap.RELEASE_KV_CACHE in runtime
    if mode == "always" and not can:
        raise RolloutError("rollout.release_kv_cache is 'always' but the backend cannot release its KV cache here")
    if mode == "auto" and not can:
        report.note("KV cache stays resident during weight sync (backend cannot release it)")
    if cfg.rollout.return_routed_experts and Cap.ROUTED_EXPERTS not in runtime:
        raise RolloutError("rollout.return_routed_experts is set but the backend cannot return routed experts here")
    return mode != "never" and can
