"""The built-in ``local`` rollout backend: in-process sampling from a copy of the policy.

It loads the HF directory the engine wrote into its own transformers model and samples with a
KV cache (one prefill, then one token per step for every sequence): ``n`` samples per prompt,
temperature / top-k / top-p, ``max_new_tokens``, stop tokens. Log-probs are those of the
processed distribution (after temperature and top-k/top-p), as vLLM's ``processed_logprobs``.
MoE models also return the experts every router chose (R3), through the same router hooks as
the ``hf`` engine.

It is a weight-sync receiver of both kinds: :class:`~rlcore.types.BucketReceiver` (stage
buckets, swap on commit; ``inproc``: a bucket its sender never writes again is kept as the staging,
not copied out; in place it takes the sender's tensors without buckets, ``receive_tensors``) and :class:`~rlcore.types.DiskReceiver` (``disk``). Where
the checksum kernel runs (a GPU with Triton; ``fused_checksums``), a push lands with copies that
checksum what they write (:meth:`~rlcore.checksums.ChecksumSlots.copy`: the staged commit, or
each in-place bucket), so ``weight_checksums()`` after it reads those sums instead of the weights
again; elsewhere it checksums the weights when asked. It applies delta pushes (``sync.delta``,
``begin_delta``; :mod:`rlcore.delta`): a delta over a version it does not hold is refused before
anything lands, each delta is checked, then applied to a copy of the live weight (staged) or to it
(in place); the tensors the push names unchanged keep their values.

KV cache: a transformers ``DynamicCache`` built by each ``generate`` call and dropped when it
returns, so between calls — and therefore around a push — none is resident.
``release_memory({"kv_cache"})`` measures what is resident (the bytes of a cache still held:
0 here, by construction) and blocks ``generate`` until ``resume_memory``; ``memory_metrics()``
reports that figure and the peak cache size of the last ``generate``.

Pushes while ``generate`` runs (``loop.in_flight: abort``, rlcore/rollout_producer.py): every
forward of a ``generate`` call holds the weights lock, and a commit (or a disk load) takes it
between two of them. At its next token the call sees the new version, drops its KV cache and
prefills prompt + tokens so far on the new weights (a partial rollout resumed where it stopped):
tokens before keep the log-probs of the version that sampled them, each row records the switch in
``Sample.weight_versions`` and reports the version of its last token as ``weight_version``. A
call that records routes (R3) or drafts speculatively holds the lock for its whole length: the
push waits for it. ``in_place`` updates write live weights bucket by bucket, so with them
``resumes_in_flight()`` is False and the loop waits for requests in flight before pushing.

``draft_depths > 0`` (``rollout.draft_depths``) samples speculatively with the model's MTP
layers as the draft (:mod:`rlcore.rollout_speculative`; the output distribution is unchanged),
reports acceptance per depth (``rollout_metrics()``) and the draft's weight version
(``draft_weight_version``: the MTP layers are loaded by the same push as the target, so it is
the version of the last complete push that carried them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from rlcore.checksums import ChecksumPlan, ChecksumSlots, checksum_kernel_runs_on, warm_checksum_kernels
from rlcore.delta import DeltaIntake, apply_delta, check_delta
from rlcore.engines.hf_names import checkpoint_views
from rlcore.engines.hf_routers import RouterSeam
from rlcore.engines.kv_cache import cache_arg
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.lora import ADAPTER_DIR, ADAPTER_FILE, Adapters, pushes_adapter
from rlcore.platforms import run_device
from rlcore.rollout_seeds import CallSeeds, base_seed, copy_seed
from rlcore.rollout_settings import LOCAL_UPDATE_MODES
from rlcore.rollout_speculative import DraftStats, generate_one
from rlcore.sync import Bucket, WeightManifest
from rlcore.types import Cap, Prompt, Sample, SamplingSettings

LOCAL_CAPABILITIES = frozenset(
    {
        Cap.LOGPROBS,
        Cap.PAUSE,
        Cap.RELEASE_KV_CACHE,
        Cap.ROUTED_EXPERTS,
        Cap.RECEIVE_BUCKETS,
        Cap.RECEIVE_DISK,
        Cap.WEIGHT_CHECKSUMS,
        Cap.RECEIVE_DELTAS,
        Cap.RECEIVE_ADAPTERS,
    }
)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 log-probs of the processed distribution (temperature, then top-k, then top-p)."""
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = (cum - probs) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.log_softmax(logits, dim=-1)


def row_uniforms(call_seed: int, rows: Sequence[Prompt], n: int, steps: int, device: Any) -> torch.Tensor:
    """``[rows, steps]`` uniforms, row *i* (copy ``i % n`` of its prompt) from a CPU generator seeded
    with the call's seed, the prompt's index and the copy: the same wherever the row is sampled,
    whichever other rows share the call."""
    out = torch.empty((len(rows), steps), dtype=torch.float64)
    for i, p in enumerate(rows):
        out[i] = torch.rand(steps, generator=torch.Generator().manual_seed(row_seed(call_seed, p, i, n)),
                            dtype=torch.float64)
    return out.to(device)


def row_seed(call_seed: int, prompt: Prompt, row: int, n: int) -> int:
    """The seed of row ``row`` (copy ``row % n`` of ``prompt``) in a call seeded ``call_seed``."""
    return copy_seed(call_seed, prompt.index, row % n)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: the first whose cumulative probability exceeds ``u`` (scaled by the row's
    total, so rounding never runs past the end; zero-probability tokens are never picked)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


class LocalRollout:
    """See module docstring."""

    def __init__(self, device: str = "cpu", dtype: str = "float32", seed: int = 0, draft_depths: int = 0,
                 seed_per_prompt: bool = False, update: str = "staged", fused_checksums: bool | None = None,
                 lora: Any = None):
        if update not in LOCAL_UPDATE_MODES:
            raise RolloutError(f"rollout.local_update must be one of {LOCAL_UPDATE_MODES}, got {update!r}")
        self.device = torch.device(device)
        #: how a push lands (``rollout.local_update``): ``staged`` holds the whole new version apart
        #: and swaps it in at commit (one more copy of the model on this device, the old version
        #: survives a failed push); ``in_place`` copies each bucket into the live weights as it
        #: arrives (no copy of the model; a failed push leaves the weights unknown and generate()
        #: refuses until a complete push commits)
        self.update = update
        #: every row samples from its own seed (see :func:`row_uniforms`), not one generator per call
        self.seed_per_prompt = seed_per_prompt
        self.dtype = getattr(torch, dtype)
        #: LoRA adapter pushes (rlcore.lora): the settings the trainer's adapters have; the base stays as loaded
        self.lora = lora
        self.adapters: Adapters | None = None
        self._seeds = CallSeeds(seed)
        self.model: Any = None
        self.seam: RouterSeam | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._manifest: WeightManifest | None = None
        self._version = -1
        self._paused = False
        self._kv_released = False
        self._staging: dict[str, torch.Tensor] | None = None
        self._staging_version: int | None = None
        self._delta: DeltaIntake | None = None  # the push in progress is a delta (begin_delta)
        self._unknown_weights: str | None = None
        self._checksum_plan: tuple[tuple[str, ...], ChecksumPlan] | None = None
        #: land pushes with copy-and-checksum (None: where the kernel runs, i.e. free)
        self.fused_checksums = fused_checksums
        self._landing = ChecksumSlots()
        #: name -> slot in ``_landing`` of every weight the last committed push wrote (None: unknown)
        self._landed: dict[str, int] | None = None
        self._landing_now: dict[str, int] = {}
        self.eos_token_id: int | None = None
        self.draft_depths = int(draft_depths)
        self._draft_version: int | None = None
        self._last_metrics: dict[str, float] = {}
        self._kv_peak_bytes = 0
        self._kv_freed_bytes: int | None = None
        #: held by every forward of generate() and by every change of the weights (see the module docstring)
        self._weights_lock = threading.Lock()
        #: decode steps taken by generate() calls so far (progress that a caller can watch)
        self.decode_steps = 0

    # ----------------------------------------------------------------- lifecycle ---------

    def capabilities(self) -> frozenset[str]:
        return LOCAL_CAPABILITIES | ({Cap.SPECULATIVE} if self.draft_depths else frozenset())

    def start(self, model_dir: str, version: int = 0) -> None:
        from rlcore.engines.mimo import load_causal_lm

        # a MiMo directory loads with its MTP layers, so pushes carry (and verify) model.mtp_layers.*
        self.model = load_causal_lm(str(model_dir), self.dtype).to(self.device)
        if self.lora is not None:  # the trainer's adapters over the base: pushes carry them only
            if self.draft_depths:
                raise RolloutError("rollout.draft_depths with LoRA adapter pushes: the draft would keep the base "
                                   "MTP layers; set lora.push=merged or rollout.draft_depths=0")
            self.adapters = Adapters(self.model, self.lora)
            if (Path(model_dir) / ADAPTER_DIR / ADAPTER_FILE).exists():  # a resumed run's adapters
                self.adapters.load(Path(model_dir) / ADAPTER_DIR)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.seam = RouterSeam(self.model)
        self._views = self.adapters.views() if self.adapters is not None else checkpoint_views(self.model)
        self._manifest = None
        self._checksum_plan = None
        self._landed = None
        if self._fuses():
            warm_checksum_kernels(self.device)  # at setup, not in the first push
        self._version = version
        self.eos_token_id = self.model.config.eos_token_id
        if self.draft_depths:
            from rlcore.engines.mimo import has_mtp_layers

            have = has_mtp_layers(self.model)
            if have < self.draft_depths:
                raise RolloutError(
                    f"rollout.draft_depths={self.draft_depths} drafts with MTP layers, but the model at {model_dir} has "
                    f"{have}; use a model with MTP layers (engine.model.tiny.mtp_layers) or draft_depths <= {have}")
            self._draft_version = version

    def shutdown(self) -> None:
        if self.seam is not None:
            self.seam.remove()
        self.model = None
        self._views = {}
        self._manifest = None
        self._checksum_plan = None
        self._landed = None

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def draft_weight_version(self) -> int | None:
        """Weight version of the speculative draft (the MTP layers), None when not drafting."""
        return self._draft_version if self.draft_depths else None

    def rollout_metrics(self) -> dict[str, float]:
        """Metrics of the last ``generate``: acceptance per draft depth when drafting."""
        return dict(self._last_metrics)

    def memory_metrics(self) -> dict[str, float]:
        """KV-cache bytes: freed by the last release (measured: what was resident), and the peak
        cache of the last ``generate``."""
        out = {"rollout/kv_cache_peak_bytes": float(self._kv_peak_bytes)}
        if self._kv_freed_bytes is not None:
            out["rollout/kv_cache_freed_bytes"] = float(self._kv_freed_bytes)
        return out

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def release_memory(self, tags: frozenset[str]) -> None:
        unknown = set(tags) - {"kv_cache"}
        if unknown:
            raise RolloutError(f"local rollout can release only 'kv_cache', not {sorted(unknown)}")
        self._kv_freed_bytes = 0  # the cache of a generate() call is dropped when it returns: none is resident
        self._kv_released = True

    def resume_memory(self, tags: frozenset[str]) -> None:
        if "kv_cache" in tags:
            self._kv_released = False

    def reset_prefix_cache(self) -> None:
        """The local sampler keeps no prefix cache between calls; nothing can be stale."""

    def resumes_in_flight(self) -> bool:
        """Whether a push may land while ``generate`` runs (see the module docstring)."""
        return self.update != "in_place"

    # ----------------------------------------------------------------- sampling ----------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        if self.model is None:
            raise RolloutError("local rollout: start() was not called")
        if self._paused:
            raise RolloutError("local rollout is paused; resume() it before generate()")
        if self._kv_released:
            raise RolloutError("local rollout's KV cache is released; resume_memory({'kv_cache'}) first")
        if self._staging is not None:
            raise RolloutError("local rollout is in the middle of a weight update")
        if self._unknown_weights is not None:
            raise RolloutError(f"local rollout holds unknown weights ({self._unknown_weights}); a complete weight "
                               f"push is needed before it can generate again")
        dev = self.device
        seqs = [p for p in prompts for _ in range(params.n)]
        N = len(seqs)
        if N == 0:
            return []
        if self.draft_depths:
            with self._weights_lock:  # drafting from the MTP layers: the whole call on one version
                return self._generate_speculative(seqs, params)
        plen = [len(p.ids) for p in seqs]
        P = max(plen)
        pad = int(self.model.config.pad_token_id or 0)
        ids = torch.full((N, P), pad, dtype=torch.long, device=dev)
        mask = torch.zeros((N, P), dtype=torch.long, device=dev)
        for i, p in enumerate(seqs):
            ids[i, P - len(p.ids):] = torch.tensor(p.ids, dtype=torch.long, device=dev)
            mask[i, P - len(p.ids):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        call_seed = self._seeds.next(params.seed)
        gen = torch.Generator(device=dev).manual_seed(call_seed)
        uniforms = row_uniforms(call_seed, seqs, params.n, params.max_new_tokens, dev) if self.seed_per_prompt else None
        stop = set(params.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=dev) if stop else None

        record = bool(params.return_routed_experts) and self.seam is not None and bool(self.seam.routers)
        route_steps: list[torch.Tensor] = []
        cache = cache_arg(self.model.forward)  # 'cache' in transformers 5 (the old name warns on every call)

        def run(input_ids, attention_mask, position_ids, past):
            def forward():
                return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=True, **{cache: past})

            if not record:
                return forward()
            with self.seam.forward_pass(num_tokens=input_ids.numel(), record=True):
                out = forward()
                route_steps.append(self.seam.collect().view(input_ids.shape[0], input_ids.shape[1], -1,
                                                            self.seam.layout.topk))
            return out

        # a call that records routes keeps one version throughout (its routes index the prefill)
        whole_call = self._weights_lock if record else nullcontext()
        step_lock = nullcontext() if record else self._weights_lock
        with whole_call:
            with step_lock:
                out = run(ids, mask, pos, None)
                version = self._version
            past = getattr(out, cache)
            tokens, logps, lengths, stopped, switches, past = self._decode(
                run, out, past, ids, mask, pos, params, uniforms, gen, stop_t, pad, version, step_lock, cache)
        self._kv_peak_bytes = _cache_bytes(past)
        self._last_metrics = {}

        samples = []
        layout = self.seam.layout if self.seam is not None else None
        for i, p in enumerate(seqs):
            n = int(lengths[i])
            routes = None
            if record and layout is not None:
                parts = [route_steps[0][i, P - plen[i]:]]
                parts += [r[i] for r in route_steps[1 : n]]  # decode steps fed tokens 0 .. n-2
                moe = torch.cat(parts, dim=0)  # [plen + n - 1, R, K]
                routes = torch.full((moe.shape[0], layout.num_hidden_layers, layout.topk), -1, dtype=torch.int16)
                routes[:, list(layout.layers)] = moe.cpu()
            spans = [(v, first) for v, first in switches if first < n or first == 0]
            samples.append(
                Sample(
                    prompt_index=p.index,
                    prompt_ids=list(p.ids),
                    response_ids=tokens[i, :n].cpu(),
                    logprobs=logps[i, :n].cpu(),
                    weight_version=spans[-1][0],
                    finish_reason="stop" if bool(stopped[i]) else "length",
                    routed_experts=routes,
                    weight_versions=tuple(spans) if len(spans) > 1 else None,
                )
            )
        return samples

    def _decode(self, run: Any, out: Any, past: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                params: SamplingSettings, uniforms: torch.Tensor | None, gen: torch.Generator,
                stop_t: torch.Tensor | None, pad: int, version: int, step_lock: Any, cache: str) -> tuple:
        """The token loop after the prefill: tokens, log-probs, lengths, stop flags, the
        ``(version, first_token)`` spans (a push landing mid-call adds one: the rows still running
        are prefilled again, prompt + tokens so far, on the new weights) and the last KV cache."""
        dev, N = ids.device, ids.shape[0]
        logits = out.logits[:, -1]
        switches = [(version, 0)]
        tokens = torch.full((N, params.max_new_tokens), pad, dtype=torch.long, device=dev)
        logps = torch.zeros((N, params.max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        lengths = torch.zeros(N, dtype=torch.long, device=dev)
        stopped = torch.zeros(N, dtype=torch.bool, device=dev)
        last_pos = pos[:, -1]
        for t in range(params.max_new_tokens):
            lp = process_logits(logits, params.temperature, params.top_k, params.top_p)
            if params.temperature <= 0:
                tok = lp.argmax(dim=-1)
            elif uniforms is not None:
                tok = inverse_cdf(lp.exp(), uniforms[:, t])
            else:
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            tokens[:, t] = tok
            logps[:, t] = torch.where(done, torch.zeros_like(lp[:, 0]), lp.gather(1, tok[:, None]).squeeze(1))
            lengths += (~done).long()
            if stop_t is not None:
                hit = (~done) & torch.isin(tok, stop_t)
                stopped |= hit
                done |= hit
            if bool(done.all()) or t == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((N, 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            self.decode_steps += 1
            with step_lock:
                if self._version != version:  # a push landed: resume on the new weights from here
                    version = self._version
                    switches.append((version, t + 1))
                    every = torch.cat([ids, tokens[:, : t + 1]], dim=1)
                    out = run(every, mask, (mask.cumsum(1) - 1).clamp(min=0), None)
                else:
                    out = run(tok[:, None], mask, last_pos[:, None], past)
            past = getattr(out, cache)
            logits = out.logits[:, -1]
        return tokens, logps, lengths, stopped, switches, past

    def _generate_speculative(self, seqs: list[Prompt], params: SamplingSettings) -> list[Sample]:
        if params.return_routed_experts:
            raise RolloutError("local rollout: rollout.draft_depths (speculative) cannot return routed experts")
        call_seed = self._seeds.next(params.seed)
        gen = torch.Generator(device=self.device).manual_seed(call_seed)
        stop = set(params.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        stats = DraftStats()
        samples, peak = [], 0
        for i, p in enumerate(seqs):
            if self.seed_per_prompt:  # a row's samples do not depend on which rows share the call
                gen = torch.Generator(device=self.device).manual_seed(row_seed(call_seed, p, i, params.n))
            toks, lps, stopped, kv = generate_one(self.model, list(p.ids), params, self.draft_depths, gen, stop,
                                                  stats, process_logits)
            peak = max(peak, kv)
            samples.append(Sample(prompt_index=p.index, prompt_ids=list(p.ids), response_ids=torch.tensor(toks),
                                  logprobs=torch.tensor(lps, dtype=torch.float32), weight_version=self._version,
                                  finish_reason="stop" if stopped else "length"))
        self._kv_peak_bytes = peak
        self._last_metrics = stats.metrics()
        return samples

    # ----------------------------------------------------------------- receiving ---------

    def weight_manifest(self) -> WeightManifest:
        """The tensors this backend holds (checkpoint names and shapes; a tied output layer once,
        under the embedding's name, as the export gives it)."""
        if self._manifest is None:
            self._manifest = WeightManifest({n: tuple(v.shape) for n, v in self._views.items()}, where="local rollout")
        return self._manifest

    def _check_tensor(self, name: str, t: torch.Tensor) -> None:
        """Refuse, before loading, a tensor this backend does not hold or holds with another shape."""
        why = self.weight_manifest().refusal(name, t.shape)
        if why is None and self._views[name].dtype != t.dtype:
            why = f"weight {name!r}: received {t.dtype}, the local rollout holds {self._views[name].dtype}"
        if why is not None:
            raise WeightSyncError(why, receiver_version=self._version)

    def _check_complete(self, names: Iterable[str], version: int) -> None:
        """A partial push is refused before anything is swapped in: the old version stays."""
        missing = self.weight_manifest().missing(names)
        if missing:
            raise WeightSyncError(
                f"partial push of version {version}: {len(missing)} of {len(self._views)} weights did not arrive "
                f"(e.g. {missing[:5]}); the local rollout stays on version {self._version}",
                receiver_version=self._version)

    def begin_update(self, version: int) -> None:
        if self._staging is not None:
            raise WeightSyncError("a weight update is already in progress", receiver_version=self._version)
        self._staging = {}
        self._staging_version = version
        self._delta = None
        self._landed = None
        self._landing.reset()
        self._landing_now = {}

    def begin_delta(self, version: int, base_version: int, unchanged: Iterable[str] = ()) -> None:
        """A delta push (``sync.delta``, :mod:`rlcore.delta`) of ``version`` over ``base_version``,
        leaving ``unchanged`` as they are: refused before anything lands unless this rollout holds
        ``base_version`` (a lost delta: it missed a push, and only a full push can bring it back)."""
        if base_version != self._version or self._unknown_weights is not None:
            held = (f"version {self._version}" if self._unknown_weights is None
                    else f"unknown weights ({self._unknown_weights})")
            raise WeightSyncError(
                f"lost delta: the push of version {version} is a delta from version {base_version}, but the local "
                f"rollout holds {held}; it missed a push and needs a full one",
                receiver_version=self._version if self._unknown_weights is None else None)
        intake = DeltaIntake(version, base_version, unchanged, self._views, receiver_version=self._version)
        self.begin_update(version)
        self._delta = intake

    def _split_bucket(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], list]:
        """The tensors of ``named`` sent whole, and (a delta push) the encoded pieces."""
        if self._delta is None:
            return named, []  # an encoded name in a full push is refused by _check_tensor, as any unknown name
        return self._delta.split(named)

    def _take_deltas(self, parts: list[tuple[str, str, str, torch.Tensor]], keep: bool) -> None:
        """Hold each encoded piece until its pair came, then check and apply the delta (staged: to a
        copy of the live weight; in place: to it). ``keep``: a piece may be kept as it is (its
        sender never writes it again)."""
        for name, kind, part, piece in parts:
            if not keep or piece.device != self.device:
                piece = piece.to(self.device, copy=True)
            pair = self._delta.take(name, kind, part, piece)
            if pair is None:
                continue
            live = self._views[name]
            check_delta(live, kind, *pair, name, receiver_version=self._version)
            if self.update == "in_place":
                self._unknown_weights = f"the push of version {self._staging_version} did not complete"
                apply_delta(live, kind, *pair)
                self._staging[name] = live
            else:
                self._staging[name] = staged = live.clone()
                apply_delta(staged, kind, *pair)

    def _fuses(self) -> bool:
        if self.fused_checksums is not None:
            return self.fused_checksums
        return checksum_kernel_runs_on(self.device)

    def receive_bucket(self, bucket: Bucket) -> None:
        if self._staging is None:
            raise WeightSyncError("receive_bucket() outside begin_update()/commit_update()", self._version)
        tensors, parts = self._split_bucket(list(bucket.tensors()))
        for name, view in tensors:  # the whole bucket is checked before any of it lands
            self._check_tensor(name, view)
        if self.update == "in_place":
            self._land_in_place(tensors)
        else:
            for name, view in tensors:
                # a bucket its sender never writes again is the staging itself (no copy here; the
                # commit's copy is the only one after the bucket fill); otherwise copy it out
                keep = bucket.receiver_may_keep and view.device == self.device
                self._staging[name] = view if keep else view.to(self.device, copy=True)
        self._take_deltas(parts, keep=bucket.receiver_may_keep)

    def lands_directly(self) -> bool:
        """Whether a push may hand its tensors to :meth:`receive_tensors` instead of buckets: in
        place, they are copied straight into the live weights (one copy per push, no bucket)."""
        return self.update == "in_place"

    def receive_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """In place only: ``named`` (the sender's own tensors, a bucket's worth) copied into the live
        weights, checked first as a bucket is (in a delta push, its encoded pieces applied)."""
        if self._staging is None:
            raise WeightSyncError("receive_tensors() outside begin_update()/commit_update()", self._version)
        if self.update != "in_place":
            raise WeightSyncError("receive_tensors() lands in place only (rollout.local_update: in_place); a staged "
                                  "update takes buckets", self._version)
        named, parts = self._split_bucket(named)
        for name, t in named:
            self._check_tensor(name, t)
        self._land_in_place(named)
        self._take_deltas(parts, keep=True)

    def _land_in_place(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if tensors:  # from here on the live weights mix versions until the push commits
            self._unknown_weights = f"the push of version {self._staging_version} did not complete"
        with torch.no_grad():
            if self._fuses():  # one launch for the lot; the sums stay on the device
                slots = self._landing.copy([(self._views[name], t) for name, t in tensors])
                self._landing_now.update(zip((n for n, _ in tensors), slots, strict=True))
            else:
                for name, t in tensors:
                    self._views[name].copy_(t)
            for name, _ in tensors:
                self._staging[name] = self._views[name]  # landed: the live weight holds it

    def commit_update(self, version: int) -> None:
        if self._staging is None or self._staging_version != version:
            raise WeightSyncError(f"commit_update({version}) without a matching begin_update", self._version)
        names = set(self._staging) | (self._delta.unchanged if self._delta is not None else set())
        try:
            if self._delta is not None:
                self._delta.check_done()
            self._check_complete(names, version)
        except WeightSyncError as exc:
            if self._unknown_weights is not None:  # in place: what did land cannot be taken back
                self._staging, self._staging_version = None, None
                raise WeightSyncError(f"{exc}; the weights that did land were written in place, so the local "
                                      f"rollout now holds unknown weights", receiver_version=None) from exc
            raise
        with self._weights_lock, torch.no_grad():  # between two forwards of a generate() in flight
            if self.update != "in_place" and self._fuses():
                names = list(self._staging)
                slots = self._landing.copy([(self._views[n], self._staging[n]) for n in names])
                self._landing_now = dict(zip(names, slots, strict=True))
            elif self.update != "in_place":
                for name, t in self._staging.items():
                    self._views[name].copy_(t)
            self._version = version
        self._landed = self._landing_now if self._fuses() else None
        self._unknown_weights = None
        self._mark_draft(names, version)
        self._staging = None
        self._staging_version = None
        self._delta = None

    def abort_update(self) -> None:
        self._landed = None
        self._staging = None
        self._staging_version = None
        self._delta = None

    @property
    def holds_unknown_weights(self) -> bool:
        """True after an in-place push failed part way (generate() refuses until one commits)."""
        return self._unknown_weights is not None

    def load_from_disk(self, model_dir: str, version: int) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"no *.safetensors files in {model_dir}", receiver_version=self._version)
        staged: dict[str, torch.Tensor] = {}
        for f in files:
            for name, t in load_file(str(f)).items():
                self._check_tensor(name, t)
                staged[name] = t
        self._check_complete(staged, version)
        self._landed = None
        with self._weights_lock, torch.no_grad():  # between two forwards of a generate() in flight
            for name, t in staged.items():
                self._views[name].copy_(t.to(self.device))
            self._version = version
        self._unknown_weights = None
        self._mark_draft(staged, version)

    def _mark_draft(self, names: Iterable[str], version: int) -> None:
        """The draft is at ``version`` only if this push carried every MTP tensor."""
        from rlcore.engines.mimo_layout import is_mtp_name

        if self.draft_depths:
            need = {n for n in self._views if is_mtp_name(n)}
            if need and need <= set(names):
                self._draft_version = version

    def weight_checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        names = [n for n in (self._views if names is None else names) if n in self._views]
        landed = self._landed
        if landed is not None and all(n in landed for n in names):
            # summed by the copies that wrote them: no second read of the weights
            return dict(zip(names, self._landing.values([landed[n] for n in names]), strict=True))
        key = tuple(names)
        if self._checksum_plan is None or self._checksum_plan[0] != key:
            # the views stay at their addresses between pushes: the plan is built once (on a GPU one
            # kernel and one wait for every tensor, not a few kernels and a wait each)
            self._checksum_plan = (key, ChecksumPlan([self._views[n] for n in names]))
        return dict(zip(names, self._checksum_plan[1].compute(), strict=True))


def build_local_rollout(ctx: Any) -> LocalRollout:
    cfg = ctx.config
    device = run_device(ctx)
    return LocalRollout(device=device, dtype=cfg.engine.model.dtype, seed=base_seed(cfg),
                        draft_depths=int(cfg.rollout.draft_depths),
                        seed_per_prompt=bool(cfg.rollout.seed_per_prompt), update=str(cfg.rollout.local_update),
                        lora=cfg.lora if pushes_adapter(cfg, LOCAL_CAPABILITIES) else None)


def _cache_bytes(past: Any) -> int:
    layers = getattr(past, "layers", None) or []
    return sum(t.numel() * t.element_size() for layer in layers for t in (getattr(layer, "keys", None),
                                                                          getattr(layer, "values", None))
               if t is not None)
