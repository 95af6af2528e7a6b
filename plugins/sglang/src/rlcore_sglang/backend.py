"""The ``sglang`` rollout backend: generation, pause/continue, memory release by tag, weight
versions, routed experts — over SGLang's HTTP API or its in-process Engine.

The server (launched by this backend, or already running at ``sglang.url``) does the sampling;
this class turns rlcore's prompts and sampling settings into ``/generate`` requests and SGLang's
answers into :class:`~rlcore.types.Sample`\\ s:

* token ids from ``output_ids``; behaviour log-probs from ``meta_info.output_token_logprobs``
  (SGLang's log-probs after temperature, which is the processed distribution when neither top-p
  nor top-k truncates it) or, under top-p/top-k, from ``output_token_sampling_logprobs``, which
  SGLang returns when asked with ``return_sampling_mask`` (the support lists come along, which
  costs bandwidth: rlcore's defaults do not truncate);
* the weight version from ``meta_info.weight_version`` (rlcore stamps its integer versions on the
  server: ``--weight-version`` at launch, ``weight_version`` on the last bucket of each push),
  with ``weight_versions`` spans when the version changed inside one sample;
* routed experts (R3) decoded from SGLang's base64 int32 ``[prompt + response - 1, layers,
  topk]`` by rlcore-enginekit's :func:`rlcore_enginekit.routed_experts.decode_routed_experts`;
* with speculative decoding, acceptance per draft position from each answer's
  ``spec_correct_drafts_histogram`` (:func:`rlcore_sglang.protocol.acceptance_metrics`), and the
  draft's weight version when the draft is the policy's own MTP layers (core checks it after
  every push: a push that missed the draft fails the run).

A server this backend launches listens on ``sglang.host`` (loopback by default: its weight-update
routes have no authentication); rlcore-enginekit's :mod:`rlcore_enginekit.serving` launches it and polls its health.

Capabilities are read from the running server (``/server_info``): releasing memory needs
``--enable-memory-saver``, releasing weights also ``--weight-cache-mode off``, routed experts
``--enable-return-routed-experts``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rlcore.errors import ConfigError, RolloutError
from rlcore.platforms import cuda_free_bytes
from rlcore.types import Cap, Prompt, Sample, SamplingSettings
from rlcore_enginekit.routed_experts import MoEShape, decode_routed_experts, moe_shape
from rlcore_enginekit.serving import (
    EngineServerError,
    ServerProcess,
    answer_message,
    launch_server,
    local_url,
)

from rlcore_sglang import protocol
from rlcore_sglang.protocol import OLDEST_SUPPORTED, ServerFeatures, version_text
from rlcore_sglang.settings import SGLangSettings, check_settings, drafts_from_policy
from rlcore_sglang.transport import EngineTransport, HTTPTransport, Transport, server_cli_args, server_command

MEMORY_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})


def model_moe_shape(model_dir: str | Path) -> MoEShape | None:
    """The route shape from the model's config.json (None for a dense model)."""
    return moe_shape(json.loads((Path(model_dir) / "config.json").read_text()))


class SGLangBackend:
    """See the module docstring. Built by :func:`build_backend` from the ``sglang:`` section."""

    def __init__(self, settings: SGLangSettings | Any, *, output_dir: str | None = None,
                 request_routed_experts: bool = False):
        check_settings(settings)
        self.settings = settings
        self.output_dir = Path(output_dir or ".")
        self.request_routed_experts = request_routed_experts
        self.transport: Transport | None = None
        self.server: ServerProcess | None = None
        self.features: ServerFeatures | None = None
        self.model_dir: str | None = None
        self._moe: MoEShape | None = None
        self._version = -1
        #: the weight version of a speculative draft made of the policy's MTP layers (None otherwise)
        self._draft_version: int | None = None
        self._paused = False
        self._released: set[str] = set()
        #: releasing 'weights' discards a speculative draft's weights and resuming does not bring
        #: them back (sgl-project/sglang PR #31674): generation waits for a push that reaches it
        self._draft_discarded = False
        self._memory_metrics: dict[str, float] = {}
        #: what sglang.release_for_training released after the last generate (not core's release_memory)
        self._training_released: set[str] = set()
        self._rollout_metrics: dict[str, float] = {}
        #: the last rollout's speculative acceptance (empty without drafting)
        self._spec_metrics: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle ---------

    def capabilities(self) -> frozenset[str]:
        f = self.features
        if f is None:
            return frozenset()
        caps = {Cap.LOGPROBS, Cap.PAUSE, Cap.PREFIX_CACHE_RESET, Cap.ANY_MTP_LAYOUT}  # its loaders read MTP layers
        if f.memory_saver:
            caps.add(Cap.RELEASE_KV_CACHE)
            if f.weight_cache_mode == "off":
                caps.add(Cap.RELEASE_WEIGHTS)
        if f.routed_experts:
            caps.add(Cap.ROUTED_EXPERTS)
        if f.speculative_algorithm:
            caps.add(Cap.SPECULATIVE)
        return frozenset(caps)

    def _speculative(self) -> dict[str, Any]:
        s = self.settings
        # no draft path: SGLang's draft worker then reads the target's directory (ModelConfig's
        # fallback to --model-path), as a draft made of the policy's MTP layers needs
        return {
            "speculative_algorithm": s.speculative_algorithm,
            "speculative_draft_model_path": s.speculative_draft_model_path,
            "speculative_num_steps": s.speculative_num_steps,
            "speculative_eagle_topk": s.speculative_eagle_topk,
            "speculative_num_draft_tokens": s.speculative_num_draft_tokens,
        }

    def launch_args(self, model_dir: str, version: int) -> list[str]:
        s = self.settings
        return server_cli_args(
            model_dir, host=s.host, port=int(s.port), weight_version=version, extra=list(s.launch_args),
            memory_saver=bool(s.enable_memory_saver), routed_experts=self.request_routed_experts,
            speculative=self._speculative(),
        )

    def start(self, model_dir: str, version: int = 0) -> None:
        s = self.settings
        self.model_dir = str(model_dir)
        self._moe = model_moe_shape(model_dir)
        try:
            if s.mode == "engine":
                self.transport = EngineTransport.launch(self.launch_args(model_dir, version))
            elif s.url:
                self.transport = HTTPTransport(s.url, timeout=float(s.request_timeout_s))
            else:
                http = HTTPTransport(local_url(s.host, int(s.port)), timeout=float(s.request_timeout_s))
                self.server = launch_server(
                    server_command(s.python, self.launch_args(model_dir, version)), http.client,
                    log_path=self.output_dir / "sglang_server.log", name="SGLang server",
                    start_timeout=float(s.startup_timeout_s), timeout_setting="sglang.startup_timeout_s",
                    port_setting="sglang.port", poll_s=2.0)
                self.transport = http
            self.features = ServerFeatures.from_server_info(self.transport.server_info())
        except EngineServerError as exc:
            self.shutdown()
            raise RolloutError(f"cannot start the sglang rollout backend: {exc}") from exc
        if self.features.version < OLDEST_SUPPORTED:
            v = version_text(self.features.version)
            self.shutdown()
            raise RolloutError(f"SGLang {v} is older than the oldest supported {version_text(OLDEST_SUPPORTED)}")
        if self.request_routed_experts and self.features.speculative_algorithm:
            raise RolloutError(
                "routed experts (R3) with speculative decoding: SGLang's routed-experts capturer does not "
                "account for speculative verify tokens (its own FIXME; roadmap item sgl-project/sglang#16379), "
                "so the routes could be wrong; turn one of them off"
            )
        if s.url:
            self._adopt_external_server(version)
        self._version = version
        if self.features.speculative_algorithm and drafts_from_policy(s):
            self._draft_version = version
        if s.release_for_training:
            try:
                self._tags(frozenset(s.release_for_training))
            except RolloutError as exc:
                self.shutdown()
                raise RolloutError(f"sglang.release_for_training {list(s.release_for_training)}: {exc}") from None

    def _adopt_external_server(self, version: int) -> None:
        """A server we did not launch: load the trainer's initial policy into it (unless the user
        says it already serves it) and stamp rlcore's version on it."""
        if self.settings.load_policy_on_start:
            self._control("/update_weights_from_disk",
                          protocol.update_from_disk_body(self.model_dir, weight_version=str(version)),
                          f"loading the initial policy {self.model_dir}")
        else:
            self._control("/update_weight_version", {"new_version": str(version), "abort_all_requests": False},
                          "stamping the weight version")

    def shutdown(self) -> None:
        if self.transport is not None:
            try:
                self.transport.close()
            finally:
                self.transport = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def draft_weight_version(self) -> int | None:
        """The weight version of the speculative draft when it is the policy's own MTP layers
        (None without speculation or with a separate draft checkpoint, which no push updates).
        Core compares it with the pushed version after every push."""
        return self._draft_version

    def set_weight_version(self, version: int, *, draft_updated: bool = False) -> None:
        """Called by the sglang weight syncs once a push has landed (SGLang was told the same
        version on the push's last request); ``draft_updated``: the push reached the speculative
        draft runner too (tensor and disk paths with selector all/draft)."""
        self._version = int(version)
        if draft_updated:
            self._draft_discarded = False
            if self._draft_version is not None:
                self._draft_version = int(version)

    # ------------------------------------------------------------------- control ---------

    def _require(self) -> Transport:
        if self.transport is None or self.features is None:
            raise RolloutError("the sglang rollout backend is not started (start() was not called or failed)")
        return self.transport

    def _control(self, route: str, body: dict[str, Any], what: str) -> Any:
        transport = self._require()
        try:
            answer = transport.call(route, body)
        except EngineServerError as exc:
            raise RolloutError(f"{what} failed: {exc}") from exc
        if not protocol.is_success(answer):
            raise RolloutError(f"{what} failed: {transport.describe()} answered {answer_message(answer)}")
        return answer

    def pause(self) -> None:
        self._control("/pause_generation", {"mode": self.settings.pause_mode}, "pausing generation")
        self._paused = True

    def resume(self) -> None:
        self._control("/continue_generation", {}, "continuing generation")
        self._paused = False

    def _tags(self, tags: frozenset[str]) -> list[str]:
        unknown = set(tags) - MEMORY_TAGS
        if unknown:
            raise RolloutError(f"SGLang releases memory by the tags {sorted(MEMORY_TAGS)}, not {sorted(unknown)}")
        caps = self.capabilities()
        if "weights" in tags and Cap.RELEASE_WEIGHTS not in caps:
            raise RolloutError("this SGLang server cannot release its weights (needs --enable-memory-saver and "
                               "--weight-cache-mode off)")
        if Cap.RELEASE_KV_CACHE not in caps:
            raise RolloutError("this SGLang server cannot release memory: it was started without --enable-memory-saver")
        return sorted(tags)

    def release_memory(self, tags: frozenset[str]) -> None:
        tags = frozenset(tags)
        if self._training_released:
            # released since the rollout (sglang.release_for_training): what core asks to release
            # stays released; the push needs the weights back
            keep = self._training_released & tags
            self._training_released -= keep
            self._released |= keep
            if keep:  # freed after the rollout: rollout/training_release_bytes measured it
                self._memory_metrics.pop("rollout/kv_cache_freed_bytes", None)
            self.restore_for_push()
            tags = tags - keep
            if not tags:
                return
        before = cuda_free_bytes()
        self._control("/release_memory_occupation", {"tags": self._tags(tags)}, f"releasing {sorted(tags)}")
        self._released |= set(tags)
        after = cuda_free_bytes()
        if before is not None and after is not None:  # colocated: the server's GPU is this process's
            self._memory_metrics["rollout/kv_cache_freed_bytes"] = float(after - before)
        if "weights" in tags and self.features is not None and self.features.speculative_algorithm:
            self._draft_discarded = True

    def resume_memory(self, tags: frozenset[str]) -> None:
        self._control("/resume_memory_occupation", {"tags": self._tags(tags)}, f"resuming {sorted(tags)}")
        self._released -= set(tags)

    def restore_for_push(self) -> None:
        """Before a push after ``sglang.release_for_training``: the weights (their values are about
        to be overwritten by the push) and CUDA graphs come back; a released KV cache stays
        released until the next rollout or core's ``resume_memory``. The syncs call it, so a run
        with ``rollout.release_kv_cache: never`` pushes into resumed weights too."""
        back = self._training_released - {"kv_cache"}
        if not back:
            return
        t0 = time.perf_counter()
        self._control("/resume_memory_occupation", {"tags": sorted(back)}, f"resuming {sorted(back)} for the push")
        self._training_released -= back
        self._memory_metrics["rollout/resume_for_push_seconds"] = time.perf_counter() - t0

    def _wait_idle(self, limit_s: float = 30.0) -> None:
        """SGLang asserts idleness when releasing memory, and its scheduler can still hold the
        finished batch for a moment after the answer; its cache flush refuses (rather than
        asserts) while busy, so a successful flush means idle."""
        deadline = time.monotonic() + limit_s
        while True:
            try:
                self.reset_prefix_cache()
                return
            except RolloutError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _release_for_training(self) -> None:
        """After a rollout: release ``sglang.release_for_training``'s tags so the colocated
        trainer has that memory while it trains; measured (``rollout/training_release_bytes``,
        ``rollout/training_release_seconds``)."""
        tags = sorted(set(self.settings.release_for_training) - self._released)
        if not tags:
            return
        t0 = time.perf_counter()
        self._wait_idle()
        before = cuda_free_bytes()
        self._control("/release_memory_occupation", {"tags": tags}, f"releasing {tags} for training")
        after = cuda_free_bytes()
        self._training_released = set(tags)
        self._rollout_metrics["rollout/training_release_seconds"] = time.perf_counter() - t0
        if before is not None and after is not None:
            self._rollout_metrics["rollout/training_release_bytes"] = float(after - before)

    def _resume_after_training(self) -> None:
        """A rollout with no push since the last one: bring back what was released for training;
        released weights come back with their contents only with --enable-weights-cpu-backup."""
        back = sorted(self._training_released)
        if "weights" in back and not (self.features and self.features.weights_cpu_backup):
            raise RolloutError(
                "SGLang's weights were released for training (sglang.release_for_training) and no push has "
                "restored them since: without --enable-weights-cpu-backup SGLang does not keep their contents; "
                "push the policy before generating, or add --enable-weights-cpu-backup to sglang.launch_args")
        t0 = time.perf_counter()
        self._control("/resume_memory_occupation", {"tags": back}, f"resuming {back} after training")
        self._training_released.clear()
        self._rollout_metrics["rollout/training_resume_seconds"] = time.perf_counter() - t0

    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's speculative acceptance (per draft position, see
        :func:`rlcore_sglang.protocol.acceptance_metrics`) and the memory released for training
        after it (sglang.release_for_training)."""
        return {**self._rollout_metrics, **self._spec_metrics}

    def memory_metrics(self) -> dict[str, float]:
        """The device memory the last release freed, when the server shares this process's GPU
        (core logs it after releasing the KV cache before a push)."""
        return dict(self._memory_metrics)

    @property
    def released_tags(self) -> frozenset[str]:
        return frozenset(self._released | self._training_released)

    def reset_prefix_cache(self) -> None:
        transport = self._require()
        try:
            if isinstance(transport, HTTPTransport):
                transport.call("/flush_cache", None)
            else:
                out = transport.engine.flush_cache()
                if not getattr(out, "success", True):
                    raise EngineServerError(f"flush_cache refused: {getattr(out, 'message', out)}")
        except EngineServerError as exc:
            raise RolloutError(f"flushing SGLang's prefix cache failed: {exc}") from exc

    # ------------------------------------------------------------------ sampling ---------

    def generate_request(self, prompts: Sequence[Prompt], params: SamplingSettings) -> tuple[dict[str, Any], list[Prompt]]:
        """The ``/generate`` body for ``params.n`` samples of every prompt, and the prompt of each
        sample in answer order."""
        seqs = [p for p in prompts for _ in range(params.n)]
        stop = tuple(params.stop_token_ids)
        sampling = [
            protocol.sampling_params(
                max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, stop_token_ids=stop, seed=None if params.seed is None else params.seed + i,
            )
            for i in range(len(seqs))
        ]
        body = protocol.generate_body(
            [p.ids for p in seqs], sampling, return_routed_experts=bool(params.return_routed_experts),
            processed_logprobs=protocol.truncates_distribution(params.top_p, params.top_k),
        )
        return body, seqs

    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        transport = self._require()
        if self._paused:
            raise RolloutError("the sglang rollout backend is paused; resume() it before generate()")
        if self._training_released:
            self._resume_after_training()
        if "kv_cache" in self._released:
            raise RolloutError("SGLang's KV cache is released; resume_memory({'kv_cache'}) before generate()")
        if self._draft_discarded:
            raise RolloutError("SGLang discarded the speculative draft's weights when it released 'weights', and "
                               "resuming does not restore them (sgl-project/sglang PR #31674): push the policy with "
                               "sglang-tensor or sglang-disk and selector 'all' before generating, or acceptance "
                               "collapses silently")
        if params.return_routed_experts and Cap.ROUTED_EXPERTS not in self.capabilities():
            raise RolloutError("routed experts were asked for, but the SGLang server runs without "
                               "--enable-return-routed-experts")
        if protocol.truncates_distribution(params.top_p, params.top_k) and not self.features.sampling_logprobs:
            raise RolloutError(
                f"top_p={params.top_p} / top_k={params.top_k} need the behaviour log-probs of the truncated "
                f"distribution, which SGLang {version_text(self.features.version)} does not return (its "
                f"return_sampling_mask gives the mask only; sampling_logprobs_mode is read from "
                f"{version_text(protocol.SAMPLING_LOGPROBS_VERSION)} on): sample with top_p 1 and top_k 0, or "
                "use a newer SGLang")
        if not prompts:
            return []
        body, seqs = self.generate_request(prompts, params)
        try:
            answer = transport.call("/generate", body)
        except EngineServerError as exc:
            raise RolloutError(f"SGLang generate failed: {exc}") from exc
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(seqs):
            raise RolloutError(f"SGLang answered {len(items)} samples for {len(seqs)} requests")
        processed = protocol.truncates_distribution(params.top_p, params.top_k)
        parsed = [self._parse(p, item, processed) for p, item in zip(seqs, items, strict=True)]
        samples = [self._sample(p, out, bool(params.return_routed_experts))
                   for p, out in zip(seqs, parsed, strict=True)]
        self._measure_acceptance([out.spec for out in parsed if out.spec is not None])
        if self.settings.release_for_training:
            self._release_for_training()
        return samples

    def _version_of(self, text: str | None) -> int:
        if text is None:
            return self._version
        try:
            return int(text)
        except ValueError:
            raise RolloutError(
                f"SGLang reports weight version {text!r}, which rlcore did not set (rlcore stamps integer "
                "versions); is another client updating this server?"
            ) from None

    def _measure_acceptance(self, counts: list[protocol.SpecCounts]) -> None:
        positions = max(0, self.features.speculative_num_draft_tokens - 1) if self.features else 0
        self._spec_metrics = protocol.acceptance_metrics(counts, positions)
        if self._draft_version is not None:
            self._spec_metrics["rollout/spec/draft_lag"] = float(self._version - self._draft_version)

    def _parse(self, prompt: Prompt, item: dict[str, Any], processed: bool) -> protocol.GeneratedSample:
        try:
            return protocol.parse_generate_item(item, processed_logprobs=processed)
        except ValueError as exc:
            raise RolloutError(f"cannot read SGLang's answer for prompt {prompt.index}: {exc}") from exc

    def _sample(self, prompt: Prompt, out: protocol.GeneratedSample, routed: bool) -> Sample:
        routes = None
        if routed:
            if self._moe is None:
                raise RolloutError(f"routed experts asked for, but {self.model_dir}/config.json is not an MoE config")
            routes = decode_routed_experts(
                out.routed_experts_b64, rows=len(prompt.ids) + len(out.output_ids) - 1, layers=self._moe.layers,
                topk=self._moe.topk, num_experts=self._moe.num_experts, packing="int32",
                source=f"SGLang's answer for prompt {prompt.index}")
        spans = None
        if out.weight_versions and len(out.weight_versions) > 1:
            spans = tuple((self._version_of(v), start) for v, start in out.weight_versions)
        return Sample(
            prompt_index=prompt.index,
            prompt_ids=list(prompt.ids),
            response_ids=torch.tensor(out.output_ids, dtype=torch.long),
            logprobs=torch.tensor(out.logprobs, dtype=torch.float32),
            weight_version=self._version_of(out.weight_version),
            finish_reason=out.finish_reason,
            routed_experts=routes,
            weight_versions=spans,
        )


def build_backend(ctx: Any) -> SGLangBackend:
    settings = ctx.settings
    if settings is None:
        raise ConfigError("the sglang rollout backend needs the sglang plugin active (plugins: [sglang])",
                          key="plugins")
    return SGLangBackend(settings, output_dir=ctx.output_dir,
                         request_routed_experts=bool(ctx.config.rollout.return_routed_experts))
