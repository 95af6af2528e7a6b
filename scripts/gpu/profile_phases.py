#!/usr/bin/env python3
"""Where the time goes (issue 31 item 5): per-phase and per-kernel device-time tables from
``torch.profiler``, written as markdown for docs/benchmarks/.

Parts (``--parts``):

* ``hf`` (and ``megatron``): one forward + backward pass of the engine over ``--seqs`` sequences
  of ``--min-len``..``--max-len`` tokens (the spread of scripts/gpu/packed_attention_bench.py,
  micro-batches of at most ``--mb-tokens`` padded-row tokens), padded rows vs packed, bf16, after
  one unprofiled warm-up pass. Phases are ``record_function`` ranges: the bench's own (pack,
  engine forward, head, backward, in ``packed_attention_bench.run_pass``) and ranges this script
  opens around the model's modules through forward hooks (embedding, norm, qkv projection,
  attention, output projection, mlp; no library code is edited). A backward kernel is charged to
  ``backward: <phase>`` of the forward op whose autograd node launched it (autograd's sequence
  number), so the attention's backward shows apart from the MLP's.
* ``fused``: one call of the fused loss head (``Cap.FUSED_LOSS``, loss + dX + dW), of the fused
  log-prob head + core's torch loss, and of the four-GEMM floor, with the inputs and shapes of
  plugins/fused/bench/bench_fused_loss.py (H 4096, V 151936, bf16, PPO-clip + entropy, ``--tokens``).
  The head has no ``record_function`` ranges inside (its phase marks are CUDA events); its
  kernels are grouped by kind: cuBLAS GEMMs, each Triton kernel by name, torch's other kernels.

Each table gives the phase's summed kernel time (all streams), its share, the kernel count and the
profiled region's wall time (CUDA events; the gap between wall and kernel time is host time and
idle GPU). On CPU (``--device cpu``, tiny shapes) the same tables are built from the CPU ops' self
time: the check of this script, not a measurement. Writes ``profile.md`` and ``profile.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "plugins" / "fused" / "bench")]

import packed_attention_bench as pab  # noqa: E402 - the path above

PHASE = pab.PHASE
BACKWARD_RANGE = pab.PHASE_BACKWARD  # run_pass's range around loss.backward()

#: the last component of a module's name -> the phase its forward is charged to (hf Qwen2 and
#: megatron-core GPTModel names); the innermost range wins, so "attention" is what the attention
#: module does besides its projections (rope, the attention kernel, reshapes)
MODULE_PHASES = {
    "embed_tokens": "embedding", "embedding": "embedding",
    "input_layernorm": "norm", "post_attention_layernorm": "norm", "pre_mlp_layernorm": "norm",
    "norm": "norm", "final_layernorm": "norm", "q_layernorm": "norm", "k_layernorm": "norm",
    "self_attn": "attention", "self_attention": "attention",
    "q_proj": "qkv projection", "k_proj": "qkv projection", "v_proj": "qkv projection",
    "linear_qkv": "qkv projection",
    "core_attention": "attention core",
    "o_proj": "output projection", "linear_proj": "output projection",
    "mlp": "mlp",
    "rotary_emb": "rope tables", "rotary_pos_emb": "rope tables",
}
GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|sm\d+_", re.I)


class ModuleRanges:
    """Opens a ``record_function`` range named after :data:`MODULE_PHASES` around every matching
    submodule's forward (forward pre-hook / hook), for as long as the context is open."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            phase = MODULE_PHASES.get(name.rsplit(".", 1)[-1])
            if phase is None:
                continue
            stack: list = []

            def enter(_m, _args, phase=phase, stack=stack):
                rf = record_function(PHASE + phase)
                rf.__enter__()
                stack.append(rf)

            def leave(_m, _args, _out, stack=stack):
                stack.pop().__exit__(None, None, None)

            self.handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def kernel_kind(name: str) -> str:
    """What launched a kernel, from its name: cuBLAS/CUTLASS GEMMs, a Triton kernel (its function
    name), or one of torch's own kernels."""
    if name.startswith("triton_"):  # Inductor's names: torch.compile'd code (the loss objective)
        return "Triton, torch.compile'd"
    if "flash" in name.lower() or "fmha" in name.lower():
        return "attention kernel (flash / fused)"
    if GEMM.search(name) and not name.startswith(("void at::", "at::")):
        return "GEMM (cuBLAS)"
    if name.endswith("_kernel") and not name.startswith(("void ", "at::")):
        return f"Triton {name}"
    return "torch kernels (elementwise, reductions, copies)"


def _own_phase(evt) -> str | None:
    """The innermost phase range enclosing ``evt`` (itself included) on its thread."""
    e = evt
    while e is not None:
        if e.name.startswith(PHASE):
            return e.name[len(PHASE):]
        e = e.cpu_parent
    return None


EVALUATE = "autograd::engine::evaluate_function: "


def _backward_node(evt):
    """The autograd node ``evt`` runs in, as ``(sequence_nr, forward thread, name)``, or None in
    the forward. The engine's ``evaluate_function`` range holds the node's own call (scope
    BACKWARD_FUNCTION, which carries the forward op's sequence number) and the gradient sums
    around it, which belong to the same node."""
    e = evt
    while e is not None:
        if e.scope == 1:  # BACKWARD_FUNCTION
            return e.sequence_nr, e.fwd_thread, e.name
        if e.name.startswith(EVALUATE):
            node = next((c for c in e.cpu_children if c.scope == 1), None)
            if node is not None:
                return node.sequence_nr, node.fwd_thread, node.name
            return -1, None, e.name[len(EVALUATE):]
        e = e.cpu_parent
    return None


def device_times(prof, on_cuda: bool) -> list[tuple[str, str, float]]:
    """``(phase, kernel name, microseconds)`` per kernel the profile holds (CPU: per op, its
    self time). Forward kernels get the innermost phase range around the op that launched
    them; backward kernels ``backward: <phase>`` of the forward op with the node's sequence number."""
    events = prof.events()
    forward_phase: dict[tuple[int, int], tuple[int, str]] = {}
    for e in events:
        if e.device_type.name != "CPU" or e.sequence_nr < 0 or _backward_node(e) is not None:
            continue
        phase = _own_phase(e)
        if phase == BACKWARD_RANGE:  # the engine's own ops around the nodes (no forward op's number)
            continue
        key = (e.sequence_nr, e.thread)
        start = e.time_range.start
        if phase is not None and (key not in forward_phase or start >= forward_phase[key][0]):
            forward_phase[key] = (start, phase)
    def phase_of(e) -> str:
        node = _backward_node(e)
        if node is None:
            return _own_phase(e) or "other"
        seq, thread, node_name = node
        fwd = forward_phase.get((seq, thread))
        return "backward: " + (fwd[1] if fwd else node_name)

    if not on_cuda:
        return [(phase_of(e), e.name, float(e.self_cpu_time_total)) for e in events
                if e.device_type.name == "CPU" and not e.name.startswith(PHASE)]
    # every device event (kernel, memcpy, memset) once, charged to the CPU op that launched it
    # (the profiler's linked correlation id); one launched outside any op is "other"
    device = [d for d in events if d.device_type.name == "CUDA"]
    if not any(getattr(d, "linked_correlation_id", 0) for d in device):
        # a torch whose events carry no link: the kernels torch itself attached to each op
        return [(phase_of(e), k.name, float(k.duration)) for e in events if e.device_type.name == "CPU"
                for k in e.kernels]
    launchers = {e.id: e for e in events if e.device_type.name == "CPU"}
    rows = []
    for d in device:
        op = launchers.get(d.linked_correlation_id)
        rows.append((phase_of(op) if op is not None else "other", d.name,
                     float(d.time_range.end - d.time_range.start)))
    return rows


def profiled(fn, device: str) -> tuple[list[tuple[str, str, float]], float]:
    """Kernel rows (:func:`device_times`) and wall milliseconds of one call of ``fn`` under the
    profiler (CUDA events on the GPU)."""
    on_cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        if on_cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        with record_function(PHASE + "other"):  # a range for launches outside any op (Triton's)
            fn()
        if on_cuda:
            b.record()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    rows = device_times(prof, on_cuda)
    if on_cuda:
        wall = a.elapsed_time(b)
        # a cross-check of the linking: the kernel time torch's own tables attach to ops
        linked = sum(k.duration for e in prof.events() for k in e.kernels) / 1e3
        other = sum(us for phase, _, us in rows if phase == "other") / 1e3
        print(f"  profiled: {sum(us for _, _, us in rows) / 1e3:.1f} ms of device time, {other:.1f} ms of it "
              f"outside any phase; torch attaches {linked:.1f} ms to ops", flush=True)
    return rows, wall


def summarise(rows: list[tuple[str, str, float]], wall_ms: float, top: int) -> dict:
    """Per phase and per kernel: milliseconds, launches, share of the kernel total."""
    phases: dict[str, list] = defaultdict(lambda: [0.0, 0])
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0, set()])
    for phase, name, us in rows:
        phases[phase][0] += us / 1e3
        phases[phase][1] += 1
        k = kernels[name[:110]]
        k[0] += us / 1e3
        k[1] += 1
        k[2].add(phase)
    total = sum(v[0] for v in phases.values())
    return {
        "wall_ms": wall_ms, "kernel_ms": total, "launches": len(rows),
        "phases": [{"phase": p, "ms": v[0], "launches": v[1], "share": v[0] / total if total else 0.0}
                   for p, v in sorted(phases.items(), key=lambda kv: -kv[1][0])],
        "kernels": [{"kernel": n, "ms": v[0], "launches": v[1], "share": v[0] / total if total else 0.0,
                     "phases": sorted(v[2])}
                    for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def markdown_tables(title: str, s: dict, unit: str) -> list[str]:
    """One region's phase table and top-kernel table, markdown."""
    lines = [f"### {title}", "",
             f"Wall {s['wall_ms']:.1f} ms; {unit} total {s['kernel_ms']:.1f} ms over {s['launches']} launches "
             f"({s['kernel_ms'] / s['wall_ms']:.0%} of the wall time)." if s["wall_ms"] else "", "",
             f"| phase | {unit} ms | share | launches |", "|---|---:|---:|---:|"]
    lines += [f"| {p['phase']} | {p['ms']:.2f} | {p['share']:.1%} | {p['launches']} |" for p in s["phases"]]
    lines += ["", f"| kernel | {unit} ms | share | launches | phases |", "|---|---:|---:|---:|---|"]
    lines += [f"| `{k['kernel'].replace('|', '/')}` | {k['ms']:.2f} | {k['share']:.1%} | {k['launches']} | "
              f"{', '.join(k['phases'])} |" for k in s["kernels"]]
    return lines + [""]


# ------------------------------------------------------------------ parts --------------------


def engine_step(family_name: str, args) -> dict:
    """Padded rows vs packed, one profiled forward + backward pass each (bf16)."""
    sources = pab.SourceModels(args.size, args.device, args.layers)
    family = {"hf": pab.HFFamily, "megatron": pab.MegatronFamily}[family_name](sources, args.device)
    lens = pab.spread_lengths(args.seqs, args.min_len, args.max_len, seed=0)
    g = torch.Generator().manual_seed(1)
    vocab = pab.SIZES[args.size]["vocab_size"]
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    groups = pab.micro_batches(lens, args.mb_tokens)
    out = {"seqs": len(lens), "real_tokens": sum(lens), "micro_batches": len(groups),
           "padded_tokens": sum(len(gr) * max(lens[i] for i in gr) for gr in groups), "paths": {}}
    for path in pab.PATHS:
        eng = family.engine(torch.bfloat16, path)
        params = family.params(eng)
        model = eng.model

        def one_pass(eng=eng, params=params):
            for p in params:
                p.grad = None
            pab.run_pass(pab.fwd_of(eng), pab.head_of(eng), seqs, groups, params)

        with ModuleRanges(model):
            one_pass()  # warm-up: kernels chosen, allocator filled
            rows, wall = profiled(one_pass, args.device)
        s = summarise(rows, wall, args.top)
        s["attention_path"] = eng.attention_path
        s["backend"] = pab.backend_of(family, eng, torch.bfloat16, args.device)
        out["paths"][path] = s
        print(f"[{family_name}] {path}: wall {wall:.1f} ms, kernels {s['kernel_ms']:.1f} ms", flush=True)
        del eng, model, params, one_pass
        pab.gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def fused_loss(args) -> dict:
    """One call each of the fused loss head, the fused head + torch loss, and the four-GEMM floor."""
    from bench_fused_loss import floor_fns, fused_loss_call, token_inputs, torch_loss_call
    from bench_measure import make_inputs
    from rlcore_fused.head import FusedHead

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    backend = "triton" if on_cuda else "torch"
    T, H, V = args.tokens, args.hidden, args.vocab
    h, w, labels, _, _ = make_inputs(T, H, V, device)
    h.requires_grad_(True)
    w.requires_grad_(True)
    x = token_inputs(h, w, labels, None, device) if on_cuda else _cpu_token_inputs(h, w, labels, device)
    head = FusedHead(backend=backend)
    floor4 = floor_fns(h.detach(), w.detach())["floor4"]
    calls = {"fused loss (loss, dX, dW in the head)": lambda: fused_loss_call(head, h, w, labels, None, x),
             "fused head + torch loss (autograd)": lambda: torch_loss_call(head, h, w, labels, None, x),
             "floor4 (cuBLAS: X·Wᵀ twice, dZ·W, dZᵀ·X)": floor4}
    out = {"T": T, "H": H, "V": V, "backend": backend, "calls": {}}
    for name, fn in calls.items():
        with record_function(PHASE + name):
            fn()  # warm-up (Triton compiles, cuBLAS picks)
        rows, wall = profiled(fn, args.device)
        rows = [(kernel_kind(k) if on_cuda else phase, k, us) for phase, k, us in rows]
        s = summarise(rows, wall, args.top)
        out["calls"][name] = s
        print(f"[fused] {name}: wall {wall:.2f} ms, kernels {s['kernel_ms']:.2f} ms", flush=True)
    return out


def _cpu_token_inputs(h, w, labels, device):
    """bench_fused_loss.token_inputs asks the Triton head for the old log-probs; on CPU (the
    script's check) the torch backend gives them."""
    import bench_fused_loss
    from rlcore_fused.head import FusedHead

    real = bench_fused_loss.FusedHead
    bench_fused_loss.FusedHead = lambda backend: FusedHead(backend="torch")
    try:
        return bench_fused_loss.token_inputs(h, w, labels, None, device)
    finally:
        bench_fused_loss.FusedHead = real


def markdown(res: dict) -> str:
    m = res["meta"]
    unit = "CUDA" if m["device"].startswith("cuda") else "CPU self"
    lines = [f"# Where the time goes ({m['device_name']}, {m['date']})", "",
             f"torch {m['torch']}; `scripts/gpu/profile_phases.py {m['argv']}`. One profiled call per table after "
             "one warm-up; times are summed kernel durations (all streams) from torch.profiler.", ""]
    for fam in ("hf", "megatron"):
        if fam not in res["parts"]:
            continue
        r = res["parts"][fam]
        if "error" in r:
            lines += [f"## {fam}: error", "", r["error"], ""]
            continue
        lines += [f"## {fam} engine: padded rows vs packed, one forward + backward pass", "",
                  f"{m['size']}, {m['layers']} layers, bf16; {r['seqs']} sequences of {m['min_len']}-{m['max_len']} "
                  f"tokens ({r['real_tokens']} real tokens, {r['padded_tokens']} in padded rows), {r['micro_batches']} "
                  "micro-batches.", ""]
        for path, s in r["paths"].items():
            lines += markdown_tables(f"{fam}, {path} ({s['attention_path']}, {s['backend']})", s, unit)
    if "fused" in res["parts"]:
        r = res["parts"]["fused"]
        if "error" in r:
            lines += ["## fused loss: error", "", r["error"], ""]
        else:
            lines += [f"## fused loss head, T={r['T']}, H={r['H']}, V={r['V']} (bf16, {r['backend']} backend)", ""]
            for name, s in r["calls"].items():
                lines += markdown_tables(name, s, unit)
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="hf,fused", help="comma list of hf, megatron, fused")
    ap.add_argument("--size", choices=sorted(pab.SIZES), default="qwen0.5b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--mb-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384, help="fused: T")
    ap.add_argument("--hidden", type=int, default=4096, help="fused: H")
    ap.add_argument("--vocab", type=int, default=151936, help="fused: V")
    ap.add_argument("--top", type=int, default=12, help="kernels per table")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_cuda = args.device.startswith("cuda")
    res = {"meta": {"device": args.device, "argv": " ".join(sys.argv[1:]), "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name() if on_cuda else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "size": args.size,
                    "layers": args.layers or pab.SIZES[args.size]["num_hidden_layers"],
                    "min_len": args.min_len, "max_len": args.max_len},
           "parts": {}}
    rc = 0
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            res["parts"][part] = fused_loss(args) if part == "fused" else engine_step(part, args)
        except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the others still run
            traceback.print_exc()
            res["parts"][part] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            rc = 1
        res["parts"][part]["wall_s"] = time.perf_counter() - t0
        print(f"[{part}] {res['parts'][part]['wall_s']:.1f} s", flush=True)
        (out / "profile.json").write_text(json.dumps(res, indent=2))
        (out / "profile.md").write_text(markdown(res))
    print(markdown(res))
    return rc


if __name__ == "__main__":
    sys.exit(main())
