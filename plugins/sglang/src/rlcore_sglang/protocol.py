"""SGLang's control protocol as plain data: which features a server version has, the request
bodies rlcore sends, and the parts of SGLang's answers it reads.

Everything here is pure Python (no torch, no SGLang), so the same bodies serve the HTTP transport
(JSON; ``bytes`` values become base64 strings there) and the in-process Engine transport (which
builds SGLang's request structs from them). The field names are those of SGLang's request
dataclasses in ``sglang/srt/managers/io_struct.py``; the tests of this package parse every body
with those dataclasses, through SGLang's own FastAPI routes.

Version notes, read from the 0.5.16, 0.5.20, 0.5.21, 0.5.22 and 0.5.23 wheels:

* 0.5.21 added the weight-update session (``/begin_weight_update``, ``/end_weight_update``;
  tensor and distributed updates fail outside it), the ``selector`` field (target / draft /
  all) and ``skip_tensor_list`` on ``/weights_checker``. Older servers take
  ``disable_draft_model`` instead of ``selector``.
* ``/weights_checker`` (snapshot / reset_tensors / compare / checksum), ``/server_info``,
  ``/pause_generation``, routed experts and ``flattened_bucket`` for both the tensor and the
  distributed path exist in every version from 0.5.16 on.
* Routed experts are the same on 0.5.17 and 0.5.23 (read from both wheels): asked for with
  ``return_routed_experts`` / ``routed_experts_start_len`` on ``GenerateReqInput``, captured for
  ``[start_len, prompt + output - 1)`` of ``hf_text_config.num_hidden_layers`` layers and
  ``num_experts_per_tok`` experts (``RoutedExpertsCapturer``), returned in
  ``meta_info["routed_experts"]`` as base64 of the int32 array's bytes (the detokenizer's
  ``_b64_encode_per_request``, or the tokenizer manager's own encoding with
  ``--skip-tokenizer-init``).
* Speculative decoding's per-request counters are the same on 0.5.17 and 0.5.23:
  ``meta_info.spec_verify_ct`` (verify steps), ``spec_num_correct_drafts``,
  ``spec_correct_drafts_histogram`` (entry k: verify steps that accepted k draft tokens) and
  ``completion_tokens``.
* ``sampling_logprobs_mode`` (the behaviour log-probs of a top-p/top-k distribution, in
  ``output_token_sampling_logprobs``) is absent from 0.5.17 and 0.5.20 (their ``return_sampling_mask``
  returns the mask only) and present in 0.5.23; 0.5.21 and 0.5.22 were not read for it, so rlcore
  asks for it from 0.5.23 on only.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore_enginekit.serving import answer_message

SESSION_VERSION = (0, 5, 21)
SAMPLING_LOGPROBS_VERSION = (0, 5, 23)
OLDEST_SUPPORTED = (0, 5, 16)

#: the request struct SGLang parses each route's body into (``sglang.srt.managers.io_struct``)
REQUEST_STRUCTS = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/weights_checker": "CheckWeightsReqInput",
}


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``; ``"0.5.21.post1"`` and ``"0.5.22rc1"`` keep their numbers."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise ValueError(f"cannot read an SGLang version from {text!r}")
    return tuple(int(g) for g in m.groups(default="0"))


def version_text(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


@dataclass(frozen=True)
class ServerFeatures:
    """What the server in front of us can do, from its version and its server info."""

    version: tuple[int, ...]
    tp_size: int = 1
    memory_saver: bool = False
    routed_experts: bool = False
    speculative_algorithm: str | None = None
    #: tokens per verify step (drafts + 1); ``num_draft_tokens - 1`` draft positions
    speculative_num_draft_tokens: int = 0
    weight_cache_mode: str = "off"
    #: ``--enable-weights-cpu-backup``: released weights come back with their contents
    weights_cpu_backup: bool = False
    #: the server's GPUs, as indices of the devices visible to the process that launched it
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    pp_size: int = 1

    @property
    def gpu_indices(self) -> list[int]:
        """The device indices this server's ranks use (``--base-gpu-id``, ``--gpu-id-step``)."""
        return [self.base_gpu_id + k * self.gpu_id_step for k in range(self.tp_size * self.pp_size)]

    @property
    def weight_update_session(self) -> bool:
        return self.version >= SESSION_VERSION

    @property
    def selector(self) -> bool:
        return self.version >= SESSION_VERSION

    @property
    def checker_skip_list(self) -> bool:
        return self.version >= SESSION_VERSION

    @property
    def sampling_logprobs(self) -> bool:
        """Whether ``/generate`` takes ``sampling_logprobs_mode`` (top-p/top-k behaviour log-probs)."""
        return self.version >= SAMPLING_LOGPROBS_VERSION

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any], version: str | None = None) -> ServerFeatures:
        """From ``/server_info`` (or ``Engine.get_server_info()``): the ``version`` key and the
        resolved server args."""
        text = version or info.get("version")
        if not text:
            raise ValueError("the server info has no 'version' key")
        spec = info.get("speculative_algorithm")
        return cls(
            version=parse_version(text),
            tp_size=int(info.get("tp_size") or 1),
            memory_saver=bool(info.get("enable_memory_saver", False)),
            routed_experts=bool(info.get("enable_return_routed_experts", False)),
            speculative_algorithm=str(spec) if spec else None,
            speculative_num_draft_tokens=int(info.get("speculative_num_draft_tokens") or 0) if spec else 0,
            weight_cache_mode=str(info.get("weight_cache_mode") or "off"),
            weights_cpu_backup=bool(info.get("enable_weights_cpu_backup", False)),
            base_gpu_id=int(info.get("base_gpu_id") or 0),
            gpu_id_step=int(info.get("gpu_id_step") or 1),
            pp_size=int(info.get("pp_size") or 1),
        )


# ------------------------------------------------------------------------------ bodies -----


def selector_fields(selector: str, features: ServerFeatures) -> dict[str, Any]:
    """The runner selection of an update request: ``selector`` on >= 0.5.21, else the older
    ``disable_draft_model`` flag (which cannot express 'draft only')."""
    if features.selector:
        return {"selector": selector}
    if selector == "all":
        return {}
    if selector == "target":
        return {"disable_draft_model": True}
    raise ValueError(
        f"SGLang {version_text(features.version)} cannot update only the draft model "
        f"(selector 'draft' needs SGLang >= {version_text(SESSION_VERSION)})"
    )


def sampling_params(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
) -> dict[str, Any]:
    """One request's ``sampling_params`` (SGLang's ``SamplingParams`` fields). ``top_k`` <= 0
    means no top-k (SGLang's -1)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k) if top_k and top_k > 0 else -1,
        # the trainer works on token ids: keep special tokens and stop tokens in the output
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if stop_token_ids:
        params["stop_token_ids"] = sorted({int(t) for t in stop_token_ids})
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def truncates_distribution(top_p: float, top_k: int) -> bool:
    """Whether top-p/top-k change the sampling distribution (then the behaviour log-probs must
    come from SGLang's sampling-mask output, not from its temperature-only log-probs)."""
    return top_p < 1.0 or (top_k is not None and top_k > 0)


def generate_body(
    input_ids: Sequence[Sequence[int]],
    params: Sequence[Mapping[str, Any]],
    *,
    return_routed_experts: bool = False,
    processed_logprobs: bool = False,
) -> dict[str, Any]:
    """A batch ``/generate`` request: one entry per sample (a prompt repeated ``n`` times)."""
    if len(input_ids) != len(params):
        raise ValueError(f"{len(input_ids)} prompts but {len(params)} sampling params")
    body: dict[str, Any] = {
        "input_ids": [list(map(int, ids)) for ids in input_ids],
        "sampling_params": [dict(p) for p in params],
        "return_logprob": True,
        "stream": False,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = 0
    if processed_logprobs:
        # the behaviour log-prob of each sampled token under the truncated distribution
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "selected"
    return body


def update_from_tensor_body(
    payloads: Sequence[bytes],
    *,
    flush_cache: bool,
    weight_version: str | None,
    selector: str,
    features: ServerFeatures,
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` with one flattened-bucket payload per TP rank."""
    if len(payloads) != features.tp_size:
        raise ValueError(f"{len(payloads)} payloads for a server with tp_size {features.tp_size}: one per rank")
    body: dict[str, Any] = {
        "serialized_named_tensors": list(payloads),
        "load_format": "flattened_bucket",
        "flush_cache": bool(flush_cache),
        "abort_all_requests": False,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    body.update(selector_fields(selector, features))
    return body


def update_from_distributed_body(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    group_name: str,
    flush_cache: bool,
    weight_version: str | None,
    selector: str,
    features: ServerFeatures,
) -> dict[str, Any]:
    """``/update_weights_from_distributed`` for one flattened bucket (one uint8 broadcast)."""
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(map(int, s)) for s in shapes],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": False,
        "load_format": "flattened_bucket",
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    body.update(selector_fields(selector, features))
    return body


def update_from_disk_body(model_path: str, *, weight_version: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": False, "flush_cache": True}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def init_group_body(
    *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def begin_session_body(selector: str) -> dict[str, Any]:
    return {"selector": selector}


def weights_checker_body(action: str, *, skip: Sequence[str], selector: str, features: ServerFeatures) -> dict[str, Any]:
    """``/weights_checker``: ``snapshot`` | ``reset_tensors`` | ``compare`` | ``checksum``."""
    if action not in ("snapshot", "reset_tensors", "compare", "checksum"):
        raise ValueError(f"unknown weights_checker action {action!r}")
    body: dict[str, Any] = {"action": action}
    if features.checker_skip_list:
        body["selector"] = selector
        if skip:
            body["skip_tensor_list"] = list(skip)
    elif skip:
        raise ValueError(
            f"SGLang {version_text(features.version)}'s weights checker cannot skip tensors "
            f"(skip_tensor_list needs >= {version_text(SESSION_VERSION)}); clear sglang.verify_skip"
        )
    return body


# ----------------------------------------------------------------------------- answers -----


def is_success(answer: Mapping[str, Any] | None) -> bool:
    """Control routes answer ``{"success": bool, "message": str}``; routes that answer nothing
    (memory release/resume) succeed by answering at all."""
    if answer is None:
        return True
    return bool(answer.get("success", True))


@dataclass
class GeneratedSample:
    """What rlcore reads from one item of a ``/generate`` answer."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str | None
    weight_versions: list[tuple[str, int]] | None
    routed_experts_b64: str | None
    #: speculative decoding's counters for this sample (None when the server did not draft)
    spec: SpecCounts | None = None


@dataclass
class SpecCounts:
    """One sample's speculative-decoding counters from ``meta_info``."""

    verify_steps: int
    correct_drafts: int
    completion_tokens: int
    #: entry k: verify steps that accepted exactly k draft tokens
    histogram: list[int]


def spec_counts(meta: Mapping[str, Any]) -> SpecCounts | None:
    """The speculative counters of one answer's ``meta_info`` (SGLang adds them only when the
    request had at least one verify step)."""
    verify = int(meta.get("spec_verify_ct") or 0)
    if verify <= 0:
        return None
    hist = [int(x) for x in (meta.get("spec_correct_drafts_histogram") or [])]
    if hist and sum(hist) != verify:
        raise ValueError(f"spec_correct_drafts_histogram counts {sum(hist)} verify steps, spec_verify_ct {verify}")
    return SpecCounts(verify_steps=verify, correct_drafts=int(meta.get("spec_num_correct_drafts") or 0),
                      completion_tokens=int(meta.get("completion_tokens") or 0), histogram=hist)


def acceptance_metrics(samples: Sequence[SpecCounts], draft_positions: int) -> dict[str, float]:
    """Acceptance over a rollout's samples, named as rlcore-vllm names them:
    ``rollout/spec/acceptance_pos{i}`` (the share of verify steps whose first ``i`` draft tokens
    were all accepted: histogram entries >= i), ``rollout/acceptance_d{i}`` (the same given that
    position ``i - 1`` was reached), ``rollout/accept_length`` (SGLang's: output tokens per verify
    step, the bonus token included), ``rollout/spec/acceptance_rate`` (correct ÷ proposed drafts),
    ``rollout/spec/drafts`` (verify steps), ``…/draft_tokens``, ``…/accepted_tokens``."""
    steps = sum(s.verify_steps for s in samples)
    if not steps:
        return {}
    positions = max(draft_positions, max((len(s.histogram) - 1 for s in samples), default=0))
    hist = [0] * (positions + 1)
    for s in samples:
        for k, n in enumerate(s.histogram):
            hist[k] += n
    correct = sum(s.correct_drafts for s in samples)
    out = {"rollout/spec/drafts": float(steps), "rollout/spec/draft_tokens": float(steps * positions),
           "rollout/spec/accepted_tokens": float(correct),
           "rollout/spec/acceptance_rate": correct / (steps * positions) if positions else 0.0,
           "rollout/accept_length": sum(s.completion_tokens for s in samples) / steps}
    reached = steps
    for i in range(1, positions + 1):
        accepted = sum(hist[i:])
        out[f"rollout/spec/acceptance_pos{i}"] = accepted / steps
        out[f"rollout/acceptance_d{i}"] = accepted / reached if reached else 0.0
        reached = accepted
    return out


def parse_generate_item(item: Mapping[str, Any], *, processed_logprobs: bool) -> GeneratedSample:
    """One element of the ``/generate`` answer list.

    ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, text|None], ...]``: SGLang's
    log-probs after temperature (before top-p/top-k); ``output_token_sampling_logprobs`` (asked
    for with ``return_sampling_mask``) holds the behaviour log-prob of each sampled token under
    the truncated distribution. The token ids of the log-prob entries are checked against
    ``output_ids``.
    """
    meta = item.get("meta_info") or {}
    output_ids = [int(t) for t in (item.get("output_ids") or [])]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("the answer has no meta_info.output_token_logprobs (was return_logprob sent?)")
    if len(entries) != len(output_ids):
        raise ValueError(f"{len(entries)} log-prob entries for {len(output_ids)} output tokens")
    for k, (entry, tok) in enumerate(zip(entries, output_ids, strict=True)):
        if int(entry[1]) != tok:
            raise ValueError(f"log-prob entry {k} is for token {entry[1]}, but output token {k} is {tok}")
    if processed_logprobs:
        values = meta.get("output_token_sampling_logprobs")
        if values is None:
            raise ValueError(
                "the answer has no meta_info.output_token_sampling_logprobs: this server cannot report "
                "the behaviour log-probs of a top-p/top-k distribution"
            )
        logprobs = [float(v) for v in values]
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(logprobs)} sampling log-probs for {len(output_ids)} output tokens")
    else:
        logprobs = [float(e[0]) for e in entries]
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind not in ("stop", "length"):
        detail = answer_message(reason) if isinstance(reason, Mapping) else reason
        raise ValueError(f"the request finished with {kind!r} ({detail})")
    spans = meta.get("weight_versions")
    return GeneratedSample(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(kind),
        weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
        weight_versions=[(str(s["version"]), int(s["start"])) for s in spans] if spans else None,
        routed_experts_b64=meta.get("routed_experts"),
        spec=spec_counts(meta),
    )


def json_default(value: Any) -> Any:
    """JSON encoding of request bodies: bytes become base64 strings (how SGLang's HTTP schema
    receives ``serialized_named_tensors``)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"cannot JSON-encode {type(value).__name__}")
