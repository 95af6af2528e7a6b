"""Routing replay that can never silently do nothing.

One :class:`Replayer` per run drives the chain hooks:

* ``forward_request`` — before each micro-batch forward: under R2 the old-log-prob pass asks the
  engine to record routes; in every phase that replays (R3: old-log-prob and train; R2: train)
  the micro-batch's routes are looked up *before* the forward, so a missing sample or missing
  R2 record fails here, naming the sample.
* ``router_hook`` — inside every MoE router: the router's rows of the micro-batch's routes
  (packed THD order, one row per token; rows of -1 route natively: the last token of each
  sequence, which the rollout engine never routed, padding, and what ``on_missing: native`` or
  ``mtp: native`` leaves to the router). A router asked twice in one forward, or whose routed
  index has no column in the route tensor, is an error naming its layer. Under activation
  recomputation (``call.recompute``) the router gets the answer of its forward again.
* ``postprocess`` — after the forward: every column of the route tensor that holds routes must
  have been consumed by exactly one router over the same token rows (an orphaned router, or a
  route tensor wider than the model, fails here); under R2 the recorded routes go into the step
  batch, compactly (:func:`encode`).
* ``step_end`` — metrics (``replay/*``) and the recomputation check.

Engines check each answer themselves (:func:`rlcore.engines.routing.apply_router_decision`:
range, shape, no expert twice for one token) and check that every router of the model ran
exactly once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from rlcore.batch import ROUTES_NATIVE, compact_routes, expand_routes, route_id_dtype, routes_of
from rlcore.errors import BatchShapeError
from rlcore.types import ForwardRequest, PostprocessResult, RouterCall, RouterDecision

#: the step-batch fields R2 writes (compact ids + a native mask) and R3 reads (core's ``_pack``)
R2_IDS = "replay_r2_ids"
R2_NATIVE = "replay_r2_native"
ROUTES = "routes"
PRESENT = "routes_present"


def compact_dtype(num_experts: int) -> torch.dtype:
    """uint8 ids up to 256 experts, int16 up to 32768, else int32 (the native mask is separate,
    so no id value is spent on "route natively"): :func:`rlcore.batch.route_id_dtype`."""
    return route_id_dtype(num_experts)


def encode(routes: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, L, K]`` integer routes (-1 = native) → (ids ``[T, L, K]`` compact dtype, native
    ``[T, L]`` bool), as core stores R3 routes (:func:`rlcore.batch.compact_routes`). Bytes per
    token: ``L·K·itemsize + L``."""
    return compact_routes(routes, num_experts)


def decode(ids: torch.Tensor, native: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`encode`: int64 routes with -1 rows where ``native``."""
    return expand_routes(ids, native)


@dataclass
class _Forward:
    """One micro-batch forward that replays."""

    phase: str
    index: int
    source: torch.Tensor  #: [T, L, K] int64, -1 = route natively
    asked: dict[int, tuple[int, int, int]] = field(default_factory=dict)  #: routed index -> (layer, offset, n)
    answers: dict[int, torch.Tensor] = field(default_factory=dict)
    recomputed: dict[int, int] = field(default_factory=dict)


@dataclass
class _StepStats:
    routed: int = 0  #: router rows asked (tokens × routers) in replaying forwards
    replayed: int = 0  #: of those, rows given experts
    agree: dict[int, list[int]] = field(default_factory=dict)  #: layer -> [agreeing, compared]
    missing_samples: int = 0
    forwards: int = 0
    recomputed_forwards: int = 0
    #: ``replay.mismatch_off``: "on"/"off" -> [sum |Δ|, tokens, max |Δ|] of trainer vs rollout log-probs
    mismatch: dict[str, list[float]] = field(default_factory=dict)


class Replayer:
    """See module docstring. ``config`` is the run config (its ``replay`` section)."""

    def __init__(self, config: Any):
        self.config = config
        s = config.replay
        self.mode = str(s.mode)
        self.on_missing = str(s.on_missing)
        self.mtp = str(s.mtp)
        self.agreement = bool(s.agreement)
        self.mismatch_off = bool(s.get("mismatch_off", False))
        # R2 records what the old-log-prob pass runs: when the MTP loss will run the MTP layers in
        # the update, the recording pass must run them too, or their routers have nothing to replay
        self.record_mtp = self.mode == "R2" and self.mtp == "replay" and "mtp" in [
            str(p) for p in (config.get("plugins") or [])]
        self.forwards: dict[int, _Forward] = {}
        self.done: list[_Forward] = []  #: finished train forwards, whose backward may recompute
        self.stats = _StepStats()
        self.num_experts: int | None = None

    # ------------------------------------------------------------------ helpers ----------

    def _replays(self, phase: str) -> bool:
        return (self.mode == "R3" and phase in ("old_logprob", "train")) or (self.mode == "R2" and phase == "train")

    def _source(self, ctx: Any) -> torch.Tensor:
        mb = ctx.batch
        where = f"step {ctx.step} {ctx.phase} micro-batch {ctx.index}"
        if self.mode == "R2":
            ids, native = mb.fields.get(R2_IDS), mb.fields.get(R2_NATIVE)
            if ids is None or native is None:
                raise BatchShapeError(
                    f"replay.mode R2: {where} has no routes recorded by the old-log-prob pass (it did not run, or "
                    f"the engine recorded nothing): R2 would silently route natively")
            return decode(ids, native)
        routes = routes_of(mb.fields)  # core stores them compactly (uint8/int16 ids + native mask)
        if routes is None:
            if self.on_missing == "native":
                self.stats.missing_samples += mb.num_seqs
                return torch.full((mb.num_tokens, 0, 0), -1, dtype=torch.int64)
            raise BatchShapeError(
                f"replay.mode R3: {where} carries no routes: the rollout engine returned routed experts for none "
                f"of its samples {mb.seq_offset}..{mb.seq_offset + mb.num_seqs - 1} (replay.on_missing: native "
                f"routes them natively, counted in replay/missing_samples)")
        present = mb.seq_fields.get(PRESENT)
        if present is not None and not bool(present.all()):
            lacking = [mb.seq_offset + int(i) for i in (~present.bool()).nonzero().flatten()]
            if self.on_missing != "native":
                raise BatchShapeError(
                    f"replay.mode R3: the rollout engine returned no routed experts for sample(s) {lacking} of step "
                    f"{ctx.step} ({where}); set replay.on_missing: native to route those natively (counted in "
                    f"replay/missing_samples)")
            if ctx.phase == "old_logprob":  # counted once per step
                self.stats.missing_samples += len(lacking)
        return routes

    # ------------------------------------------------------------------ hooks ------------

    def forward_request(self, ctx: Any) -> ForwardRequest | None:
        self._check_recompute()
        if not self._replays(ctx.phase):
            if self.mode == "R2" and ctx.phase == "old_logprob":
                return ForwardRequest(record_routes=True, mtp_hidden=self.record_mtp)
            return None
        self.forwards[id(ctx)] = _Forward(ctx.phase, ctx.index, self._source(ctx))
        if self.mismatch_off and ctx.phase == "old_logprob":
            return ForwardRequest(native_logprobs=True)
        return None

    def router_hook(self, call: RouterCall) -> RouterDecision | None:
        ctx = call.micro_batch
        self.num_experts = call.num_experts  # R2 stores what it records in the dtype this allows
        if not self._replays(ctx.phase):
            return None
        fwd = self.forwards.get(id(ctx))
        if fwd is None:
            if call.recompute:
                fwd = next((f for f in self.done if f.phase == ctx.phase and f.index == ctx.index), None)
            if fwd is None:
                raise BatchShapeError(
                    f"router of layer {call.layer} asked for replay in step {ctx.step} {ctx.phase} micro-batch "
                    f"{ctx.index}, but no forward_request announced that forward (an engine forward outside "
                    f"the trainer's micro-batch loop?)")
        i = call.routed_index
        if call.recompute:
            return self._recompute(fwd, call)
        if i in fwd.asked:
            raise BatchShapeError(
                f"router of layer {call.layer} (routed index {i}) was asked twice in one forward (step {ctx.step} "
                f"{ctx.phase} micro-batch {ctx.index}): two router objects share one layer")
        src = fwd.source
        if src.shape[1] == 0:  # no routes at all, on_missing: native
            fwd.asked[i] = (call.layer, call.token_offset, call.num_tokens)
            self.stats.routed += call.num_tokens
            return None
        if i >= src.shape[1]:
            raise BatchShapeError(
                f"router of layer {call.layer} is routed layer {i + 1} of the model, but the route tensor has "
                f"{src.shape[1]} routed layers: the routes come from a model with fewer MoE layers")
        if src.shape[2] != call.topk:
            raise BatchShapeError(
                f"router of layer {call.layer} routes to top-{call.topk}, the route tensor has {src.shape[2]} "
                f"experts per token")
        rows = src[call.token_offset: call.token_offset + call.num_tokens, i]
        if rows.shape[0] != call.num_tokens:
            raise BatchShapeError(
                f"router of layer {call.layer} sees tokens [{call.token_offset}, "
                f"{call.token_offset + call.num_tokens}) of a micro-batch with {src.shape[0]} route rows")
        if call.is_mtp and self.mtp == "native":
            rows = torch.full_like(rows, -1)
        elif call.is_mtp and self.mode == "R2" and rows.numel() and not bool((rows >= 0).any()):
            raise BatchShapeError(
                f"replay.mode R2: MTP router of layer {call.layer} has no recorded routes (the old-log-prob pass did "
                f"not run the MTP layers), so it would silently route natively; with replay.mtp: replay the MTP "
                f"layers must run in the recording pass (rlcore-mtp active), or set replay.mtp: native")
        fwd.asked[i] = (call.layer, call.token_offset, call.num_tokens)
        valid = (rows >= 0).all(dim=-1)
        self.stats.routed += call.num_tokens
        self.stats.replayed += int(valid.sum())
        if self.agreement and call.scores is not None and bool(valid.any()):
            native = call.scores.float().topk(call.topk, dim=-1).indices.sort(dim=-1).values.to(rows.device)
            same = (native == rows.sort(dim=-1).values).all(dim=-1) & valid
            acc = self.stats.agree.setdefault(call.layer, [0, 0])
            acc[0] += int(same.sum())
            acc[1] += int(valid.sum())
        fwd.answers[i] = rows
        return RouterDecision(indices=rows)

    def _recompute(self, fwd: _Forward, call: RouterCall) -> RouterDecision | None:
        i = call.routed_index
        if i not in fwd.asked:
            raise BatchShapeError(
                f"router of layer {call.layer} was recomputed in backward but did not run in the forward of "
                f"{fwd.phase} micro-batch {fwd.index}")
        fwd.recomputed[i] = fwd.recomputed.get(i, 0) + 1
        if fwd.recomputed[i] > 1:
            raise BatchShapeError(f"router of layer {call.layer} was recomputed twice for {fwd.phase} micro-batch "
                                  f"{fwd.index}")
        rows = fwd.answers.get(i)
        return None if rows is None else RouterDecision(indices=rows)

    def postprocess(self, ctx: Any, output: Any) -> PostprocessResult | None:
        if self.mode == "R2" and ctx.phase == "old_logprob":
            routes = output.engine.routes
            if routes is None:
                raise BatchShapeError(
                    f"replay.mode R2: the engine returned no routes from old-log-prob micro-batch {ctx.index} of step "
                    f"{ctx.step} although record_routes was requested")
            if routes.shape[0] != ctx.batch.num_tokens:
                raise BatchShapeError(f"replay.mode R2: recorded routes have {routes.shape[0]} rows, the micro-batch "
                                      f"{ctx.batch.num_tokens} tokens")
            if self.num_experts is None:
                raise BatchShapeError("replay.mode R2: the engine recorded routes but no router asked the "
                                      "router_hook chain, so the number of experts is unknown")
            ids, native = encode(routes.to(torch.int64), self.num_experts)
            return PostprocessResult(batch_updates={R2_IDS: ids, R2_NATIVE: native})
        fwd = self.forwards.pop(id(ctx), None)
        if fwd is None:
            return None
        self._finish(fwd, ctx)
        if self.mismatch_off and ctx.phase == "old_logprob":
            self._mismatch(ctx, output)
        if ctx.phase == "train":
            self.done.append(fwd)
        return None

    def _finish(self, fwd: _Forward, ctx: Any) -> None:
        where = f"step {ctx.step} {ctx.phase} micro-batch {ctx.index}"
        src = fwd.source
        self.stats.forwards += 1
        if not fwd.asked:
            raise BatchShapeError(
                f"no MoE router asked the router_hook chain during {where}: replay did nothing (the engine's "
                f"router seam is not installed, or a fused router bypassed it)")
        spans = {(off, n) for _, off, n in fwd.asked.values()}
        if len(spans) != 1:
            raise BatchShapeError(f"routers of {where} saw different token rows: "
                                  f"{ {layer: (off, n) for layer, off, n in fwd.asked.values()} }")
        if src.shape[1] == 0:
            return
        off, n = spans.pop()
        has = (src[off: off + n] >= 0).any(dim=-1).any(dim=0)  # [L]: columns holding routes
        left = [j for j in range(src.shape[1]) if bool(has[j]) and j not in fwd.asked]
        if left:
            raise BatchShapeError(
                f"routes of routed layer(s) {left} (of {src.shape[1]}) were never consumed in {where}: the model ran "
                f"routers for routed layers {sorted(fwd.asked)} only (layers "
                f"{sorted(layer for layer, _, _ in fwd.asked.values())}); a router that never runs, or routes "
                f"from a model with more MoE layers")

    def _mismatch(self, ctx: Any, output: Any) -> None:
        """|trainer - rollout| log-probs over the micro-batch's loss tokens, with replay (this
        forward) and without (the native forward core ran because forward_request asked)."""
        if output.native_logprobs is None:
            raise BatchShapeError(
                f"replay.mismatch_off: step {ctx.step} old-log-prob micro-batch {ctx.index} came back without the "
                f"native log-probs forward_request asked for (an engine loop that ignores native_logprobs)")
        mb = ctx.batch
        rollout = mb.fields.get("old_logprobs")
        if rollout is None:
            raise BatchShapeError(f"replay.mismatch_off: step {ctx.step} micro-batch {ctx.index} carries no rollout "
                                  f"log-probs (field 'old_logprobs') to compare with")
        mask = mb.loss_mask.bool()
        target = rollout.float()[mask]
        for key, lp in (("on", output.head.logprobs), ("off", output.native_logprobs)):
            d = (lp.detach().float().to(target.device)[mask] - target).abs()
            acc = self.stats.mismatch.setdefault(key, [0.0, 0, 0.0])
            acc[0] += float(d.sum())
            acc[1] += int(d.numel())
            acc[2] = max(acc[2], float(d.max()) if d.numel() else 0.0)

    def _check_recompute(self) -> None:
        for fwd in self.done:
            if fwd.recomputed:
                if set(fwd.recomputed) != set(fwd.asked):
                    missing = sorted(fwd.asked[i][0] for i in set(fwd.asked) - set(fwd.recomputed))
                    raise BatchShapeError(
                        f"activation recomputation of {fwd.phase} micro-batch {fwd.index} re-ran some routers but "
                        f"not those of layers {missing}")
                self.stats.recomputed_forwards += 1
        self.done = []

    def step_end(self, ctx: Any) -> dict[str, float]:
        self._check_recompute()
        if self.forwards:
            left = sorted((f.phase, f.index) for f in self.forwards.values())
            self.forwards = {}
            raise BatchShapeError(f"replay: forwards {left} of step {ctx.step} never reached postprocess")
        st, self.stats = self.stats, _StepStats()
        batch = ctx.batch
        keys = (R2_IDS, R2_NATIVE) if self.mode == "R2" else (ROUTES, ROUTES_NATIVE)
        held = [batch.fields[k] for k in keys if k in batch.fields]
        nbytes = sum(t.numel() * t.element_size() for t in held)
        out = {
            "replay/coverage": st.replayed / st.routed if st.routed else 0.0,
            "replay/missing_samples": float(st.missing_samples),
            "replay/forwards": float(st.forwards),
            "replay/recomputed_forwards": float(st.recomputed_forwards),
            "replay/bytes_step": float(nbytes),
            "replay/bytes_per_token": nbytes / max(batch.num_tokens, 1),
            # bytes per expert id as stored: 1 (uint8, <= 256 experts), 2 (int16), 4
            "replay/id_bytes": float(held[0].element_size()) if held else 0.0,
        }
        for key, (total, n, worst) in sorted(st.mismatch.items()):
            out[f"replay/logprob_mismatch_{key}_mean"] = total / n if n else 0.0
            out[f"replay/logprob_mismatch_{key}_max"] = worst
        if self.agreement:
            total = [0, 0]
            for layer, (a, n) in sorted(st.agree.items()):
                out[f"replay/agreement/layer_{layer}"] = a / n if n else 0.0
                total[0] += a
                total[1] += n
            out["replay/agreement"] = total[0] / total[1] if total[1] else 0.0
        return out

