"""The ``rlcore`` command line: ``plugins``, ``check``, ``train``, ``export``, ``init``, ``--version``.

``rlcore plugins`` imports plugin modules only (never their engines, which load in factories)
and not torch; it runs in well under a second.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence

from rlcore import __version__
from rlcore.errors import RLCoreError


def _console():
    from rich.console import Console

    con = Console(highlight=False)
    if not con.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
        con = Console(highlight=False, width=200)
    return con


def _cmd_plugins(args: argparse.Namespace) -> int:
    from rlcore.manager import PluginManager

    pm = PluginManager()
    selected: list[str] = []
    if args.config:
        from rlcore.config import raw_plugins, read_raw

        selected = PluginManager.requested_plugins(raw_plugins(read_raw(args.config)))
    else:
        selected = PluginManager.requested_plugins(None)
    records = pm.describe(selected)
    if args.roles:
        return _print_roles(records, as_json=args.json)
    if args.hook:
        records = [r for r in records if args.hook in r.hooks]
    if args.json:
        print(json.dumps([r.to_json() for r in records], indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"rlcore {__version__} plugins")
    for col in ("name", "distribution", "version", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("hooks")
    table.add_column("provides")
    for r in records:
        provides = "; ".join(f"{k}: {', '.join(v)}" for k, v in r.provides.items() if v)
        status = r.status + (f" ({r.error})" if r.error else "")
        table.add_row(r.name, r.distribution, r.version, status, ", ".join(r.hooks), provides)
    _console().print(table)
    return 0


def _print_roles(records: list, *, as_json: bool) -> int:
    """``rlcore plugins --roles``: the role table (rlcore.hookspecs.ROLES) with the names the
    installed plugins provide for each role."""
    from rlcore.listing import role_rows

    rows = role_rows(records)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"rlcore {__version__} roles")
    for col in ("role", "selected by", "descriptor", "selects", "provided"):
        table.add_column(col, no_wrap=col != "provided")
    for row in rows:
        table.add_row(row["role"], row["selected_by"], row["descriptor"], row["selects"],
                      ", ".join(row["provided"]))
    _console().print(table)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from rlcore.preflight import preflight
    from rlcore.stack import config_yaml, load_stack

    stack = load_stack(args.config, args.overrides)
    # what train would hit (device, model, task, sizes, prompt lengths), before "config OK"
    checked = preflight(stack).lines(stack.config)
    desc = {**stack.describe(), "checked": checked}
    if args.json:
        print(json.dumps(desc, indent=2))
        return 0
    con = _console()
    con.print(f"[bold]rlcore {__version__}[/] stack for {args.config}")
    con.print("plugins: " + ", ".join(f"{p['name']} ({p['distribution']})" for p in desc["plugins"]))
    for role in ("engine", "forward_fn", "rollout_backend", "weight_sync"):
        s = desc[role]
        caps = escape("[" + ", ".join(s["capabilities"]) + "]")
        con.print(f"  {role:16s} {s['name']:14s} from {s['distribution']}  {caps}")
    if desc.get("algorithm"):
        a = desc["algorithm"]
        con.print(f"  {'algorithm':16s} {a['name']:14s} from {a['distribution']}  loss_agg {a['loss_agg']}")
    if desc.get("platform"):
        pl = desc["platform"]
        con.print(f"  {'platform':16s} {pl['name']:14s} from {pl['distribution']}  device {pl['device']}, "
                  f"{pl['dist_backend']} between ranks")
    if desc.get("launcher"):
        la = desc["launcher"]
        con.print(f"  {'launcher':16s} {la['name']:14s} from {la['distribution']}  {escape(la['describe'])}")
    trackers = ", ".join(f"{t['name']} ({t['distribution']})" for t in desc.get("trackers", []))
    con.print(f"  {'trackers':16s} {escape(trackers) or '(none: metrics.jsonl only)'}")
    for hook, names in desc["chains"].items():
        con.print(f"  chain {hook:12s} {' -> '.join(names) if names else '(none)'}")
    for note in desc["notes"]:
        con.print(f"  [yellow]note:[/] {escape(note)}")
    for line in checked:
        con.print(f"  checked: {escape(line)}")
    if args.show_config:
        con.print(config_yaml(stack))
    con.print("[green]config OK[/]")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from rlcore.run_stop import StopNow, StopToException
    from rlcore.stack import load_stack

    overrides = list(args.overrides)
    if args.output:
        overrides.append(f"output.dir={args.output}")
    stack = load_stack(args.config, overrides)
    flags = {"resume": args.resume, "overwrite": args.overwrite, "allow_config_change": args.allow_config_change}
    try:
        with StopToException():  # SIGTERM while the trainer is built unwinds like Ctrl-C (its clean-up runs)
            summary = stack.launcher.factory(stack.config).train(stack, **flags)
    except KeyboardInterrupt as exc:  # a second signal, or one before the first step: stopped at once
        signum = exc.signum if isinstance(exc, StopNow) else signal.SIGINT
        return _stopped(args, signal.Signals(signum), getattr(exc, "out", None) or stack.config.output.dir, None)
    if summary.get("stopped_by") is not None:  # the first signal: stopped at the step boundary
        return _stopped(args, signal.Signals(summary["stopped_by"]), summary.get("output"), summary.get("steps"))
    return 0 if summary.get("completed", False) else 1


def _stopped(args: argparse.Namespace, sig: signal.Signals, out: str | None, steps: int | None) -> int:
    """Say how the run stopped and how to continue it; the exit code a shell expects (128 + signal)."""
    from rlcore.run_output import list_checkpoints
    from rlcore.run_stop import exit_code, resume_command

    found = list_checkpoints(out) if out else []
    how = f"by {sig.name} after step {found[-1][0]}" if steps is not None and found else f"at once by {sig.name}"
    if not found:
        print(f"rlcore: stopped {how}; there is no checkpoint to resume from" + (f" in {out}" if out else ""),
              file=sys.stderr)
        return exit_code(sig)
    extra = ["--allow-config-change"] if args.allow_config_change else []
    print(f"rlcore: stopped {how}; the last checkpoint is {found[-1][1].with_suffix('.pt')}; continue with: "
          f"{resume_command(args.config, args.overrides, out, extra)}", file=sys.stderr)
    return exit_code(sig)


def _cmd_export(args: argparse.Namespace) -> int:
    # the run is read as data: nothing in it is imported (rlcore.export.reading_untrusted_run)
    from rlcore.export import export_checkpoint

    dest = export_checkpoint(args.run, args.step, args.out, args.overrides,
                             allow_config_change=args.allow_config_change,
                             on_note=lambda note: print(f"rlcore: note: {note}", file=sys.stderr))
    print(f"exported {dest}")
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    """Write a starter config: one of the example configs shipped in the wheel (rlcore/examples,
    the repository's examples/), verbatim under a header that says how to run it."""
    import os
    import shlex
    from importlib.resources import files
    from pathlib import Path

    shipped = {p.name[: -len(".yaml")]: p for p in (files("rlcore") / "examples").iterdir() if p.name.endswith(".yaml")}
    if args.list:
        for name in sorted(shipped):
            first = next((ln.lstrip("# ").strip() for ln in shipped[name].read_text().splitlines() if ln.strip()), "")
            print(f"{name:24s} {first}")
        return 0
    name = args.example[: -len(".yaml")] if args.example.endswith(".yaml") else args.example
    if name not in shipped:
        raise RLCoreError(f"--example {args.example}: no such example config; the shipped ones are "
                          f"{', '.join(sorted(shipped))} (rlcore init --list says what each is)")
    path = Path(args.path)
    if path.is_dir():
        raise RLCoreError(f"{path} is a directory; give the file to write, e.g. {path / 'rlcore.yaml'}")
    if not path.parent.is_dir():
        raise RLCoreError(f"the directory {path.parent} of {path} does not exist")
    shown, runs = shlex.quote(str(path)), shlex.quote(f"runs/{path.stem}")
    text = (f"# Written by `rlcore init` (rlcore {__version__}) from its example config {name}.yaml. Edit it, then:\n"
            f"#   rlcore check {shown}\n#   rlcore train {shown} --output {runs}\n#\n" + shipped[name].read_text())
    try:
        if args.force:  # replaced whole or not at all
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            with open(path, "x") as f:  # "x": never over a file, also one created since is_dir() above
                f.write(text)
    except FileExistsError:
        raise RLCoreError(f"{path} exists; pass --force to replace it, or give another path") from None
    except OSError as exc:
        raise RLCoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
    print(f"wrote {path} (example {name}); next: rlcore check {shown}; rlcore train {shown} --output {runs}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlcore", description="RL post-training with pluggable engines and kernels")
    p.add_argument("--version", action="version", version=f"rlcore {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("plugins", help="list installed plugins, their status, hooks and provided names")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--hook", help="only plugins implementing this hook")
    pl.add_argument("--config", help="mark the plugins this config selects as active")
    pl.add_argument("--roles", action="store_true",
                    help="the role table: each provider hook, the config key that selects it, what is installed")
    pl.set_defaults(func=_cmd_plugins)

    ck = sub.add_parser("check", help="validate a config and print the resolved stack")
    ck.add_argument("config")
    ck.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. rollout.n=8")
    ck.add_argument("--json", action="store_true")
    ck.add_argument("--show-config", action="store_true", help="also print the resolved config")
    ck.set_defaults(func=_cmd_check)

    tr = sub.add_parser("train", help="run RL training")
    tr.add_argument("config")
    tr.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. training.steps=10")
    tr.add_argument("--output", "-o", help="output directory (metrics, plot, checkpoints)")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in the output directory (an error if there is none)")
    tr.add_argument("--overwrite", action="store_true",
                    help="delete the rlcore run already in the output directory and start over")
    tr.add_argument("--allow-config-change", action="store_true",
                    help="with --resume: accept a checkpoint written by a config that differs in keys that "
                         "affect training (each difference is printed)")
    tr.set_defaults(func=_cmd_train)

    it = sub.add_parser("init", help="write a starter config (an example config shipped with rlcore)")
    it.add_argument("path", nargs="?", default="rlcore.yaml", help="the file to write (default: rlcore.yaml)")
    it.add_argument("--example", default="tiny", help="which shipped example (default: tiny, GRPO on a tiny "
                                                      "local model, CPU); --list shows them")
    it.add_argument("--list", action="store_true", help="list the shipped example configs and exit")
    it.add_argument("--force", action="store_true", help="replace the file if it exists")
    it.set_defaults(func=_cmd_init)

    ex = sub.add_parser("export", help="write a checkpoint of a run as a Hugging Face model directory")
    ex.add_argument("run", help="the run directory (its --output)")
    ex.add_argument("overrides", nargs="*", help="dotlist changes to the run's config, e.g. engine.device=cpu")
    ex.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    ex.add_argument("--out", help="where to write it (default: RUN/export-step-N; must not exist)")
    ex.add_argument("--allow-config-change", action="store_true",
                    help="export even though the run's config.yaml (or an override) differs from the config the "
                         "checkpoint was written with in keys that change what the weights mean (each is printed)")
    ex.set_defaults(func=_cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # dotlist overrides may come after options (train CONFIG --output DIR rollout.n=8)
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        args.overrides = list(args.overrides) + extra
    try:
        return int(args.func(args) or 0)
    except RLCoreError as exc:
        print(f"rlcore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
