"""What a run tells its user: the banner, one line per step, and the closing summary (with the
reward plot). The loop in rlcore.trainer decides; this module only words it, so a change of
wording never touches the loop and the loop stays free of formatting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from rlcore import __version__
from rlcore.loop_settings import ahead_steps, max_staleness
from rlcore.run_output import METRICS_FILE, plot_rewards, read_metrics
from rlcore.sync import sync_level


def critic_fields(m: dict[str, Any]) -> str:
    """The critic's value loss and explained variance, for the step line ("" without a critic)."""
    if "critic/vf_loss" not in m and "critic/explained_variance" not in m:
        return ""
    text = "critic"
    if "critic/vf_loss" in m:
        text += f" vf_loss {m['critic/vf_loss']:.4f}"
    if "critic/explained_variance" in m:
        text += f" ev {m['critic/explained_variance']:.2f}"
    return text + (" (policy frozen)" if m.get("critic/policy_frozen") else "")


def environment_fields(m: dict[str, Any]) -> str:
    """A multi-turn environment's turns (mean/max), tool calls and failures over every tool, and
    the share of samples cut short by a limit, for the step line ("" for single-turn)."""
    if "env/turns_mean" not in m:
        return ""
    text = f"env turns {m['env/turns_mean']:.1f}/{m.get('env/turns_max', m['env/turns_mean']):.0f}"
    calls = [v for k, v in m.items() if k.startswith("env/tool_calls/")]
    if calls:
        failed = sum(v for k, v in m.items() if k.startswith("env/tool_failures/"))
        text += f" tools {sum(calls):.0f} ({failed:.0f} failed)"
    # end reasons an environment chooses are its own; rlcore's limits (max_turns, max_tool_calls,
    # max_total_tokens) cutting conversations short is what a user watches for
    cut = sum(v for k, v in m.items() if k.startswith("env/end/max_"))
    if cut:
        text += f" cut {cut:.0%}"
    return text


def validation_fields(m: dict[str, Any]) -> str:
    """The validation of the step's record (rlcore.validation), for the step line ("" without one)."""
    if "val/accuracy" not in m:
        return ""
    text = f"val acc {m['val/accuracy']:.3f}"
    if "val/pass@k" in m:
        k = int(m.get("val/k", 0))
        text += f" pass@{k} {m['val/pass@k']:.3f} mean@{k} {m['val/mean@k']:.3f}"
    return text + f" (v{int(m.get('val/weight_version', 0))}, {m.get('val/seconds', 0.0):.1f}s)"


class RunReport:
    def __init__(self, console: Any, stack: Any, algorithm_name: str, out: Path):
        self.console, self.stack, self.out = console, stack, out
        self.cfg = stack.config
        self.algorithm = f"{algorithm_name} ({self.cfg.algorithm.loss_agg})"

    def note(self, text: str) -> None:
        # a note may name an extra, e.g. rlcore[tensorboard]: escaped, it is not markup
        self.console.print(f"[yellow]note:[/] {escape(text)}")

    def banner(self, extra_notes: list[str]) -> None:
        s, pm = self.stack, self.stack.plugins
        plugins = ", ".join(f"{n}-{pm.plugin_label(n).split(' ')[-1]}" for n in pm.active)
        self.console.print(f"[bold]rlcore {__version__}[/] | plugins: {plugins}")
        self.console.print(
            f"engine {s.engine.name} | forward {s.forward_fn.name} | rollout {s.rollout_backend.name} | "
            f"sync {s.weight_sync.name} | algorithm {self.algorithm} | output {self.out}"
        )
        loop = s.config.loop
        if loop.mode != "sync":  # generation overlaps training (docs/async.md)
            self.console.print(f"loop {loop.mode} | max_staleness {max_staleness(loop)} | ahead {ahead_steps(loop)} "
                               f"step(s) | stale {loop.stale} | in flight at a push: {loop.in_flight}")
        for text in [*s.notes, *(n for n in extra_notes if n)]:
            self.note(text)

    def skipped(self, step: int, why: Exception) -> None:
        self.console.print(f"[yellow]step {step:4d} skipped:[/] {escape(str(why))}")

    def step(self, m: dict[str, Any], report: Any) -> None:
        if report.details.get("draft_warning"):
            self.console.print(f"[bold red]warning:[/] {escape(report.details['draft_warning'])}")
        level = sync_level(report)
        ok = f"[green]✓ {level}[/]" if report.verified else f"[yellow]unverified ({level})[/]"
        self.console.print(
            f"step {m['step']:4d}/{self.cfg.training.steps}  reward {m['reward_mean']:.3f}  "
            f"kl {m.get('kl', 0.0):.4f}  entropy {m.get('entropy', 0.0):.3f}  "
            + "".join(f"{part}  " for part in (critic_fields(m), environment_fields(m), validation_fields(m)) if part)
            + f"tok/s {m['tokens_per_second']:7.0f}  sync {report.seconds * 1e3:6.1f} ms {ok} v{report.version}  "
            f"wall {m['wall_seconds']:.1f}s"
            + (f"  stale {m['loop/staleness_mean']:.1f}/{m['loop/staleness_max']:.0f}"
               f" waited {m['loop/trainer_wait_s']:.2f}s" if "loop/staleness_max" in m else "")
        )

    def summary(self, completed: bool) -> dict[str, Any]:
        """The summary ``Trainer.run`` returns, printed as one line; the plot written when asked."""
        rows = read_metrics(self.out)
        png = None
        if self.cfg.output.plot:
            s = self.stack
            png = plot_rewards(self.out, title=f"rlcore {self.algorithm} · {s.engine.name}/{s.rollout_backend.name}")
        skipped = sum(1 for r in rows if "skipped" in r)
        summary: dict[str, Any] = {"completed": completed, "steps": len(rows), "skipped": skipped, "output": str(self.out)}
        rows = [r for r in rows if "reward_mean" in r]
        if rows:
            k = min(5, len(rows))
            summary.update({
                "start_reward": sum(r["reward_mean"] for r in rows[:k]) / k,
                "end_reward": sum(r["reward_mean"] for r in rows[-k:]) / k,
                "wall_seconds": rows[-1]["wall_seconds"],
                "plot": str(png) if png else None,
            })
            word = "done" if completed else "stopped"
            self.console.print(
                f"[bold]{word}[/]: {len(rows)} steps, reward {summary['start_reward']:.3f} (first {k}) -> "
                f"{summary['end_reward']:.3f} (last {k}), wall {summary['wall_seconds']:.1f}s; "
                f"metrics {self.out / METRICS_FILE}" + (f", plot {png}" if png else "")
            )
        return summary
