"""A stand-in SGLang server for the protocol tests: **SGLang's own HTTP layer** (the FastAPI app
of ``sglang.srt.entrypoints.http_server``, its routes, request parsing into SGLang's request
structs and its answers) in front of a **recording stand-in for SGLang's TokenizerManager**.

It is a fake server in the sense that no model runs: the stand-in keeps a dict of tensors as "the
engine's weights" and samples by a fixed rule. What it does with weights is SGLang's own code:

* ``update_weights_from_tensor``: every TP rank's payload goes through SGLang's
  ``normalize_serialized_named_tensor_payloads``, ``monkey_patch_torch_reductions``,
  ``MultiprocessingSerializer.deserialize`` (its SafeUnpickler) and
  ``WeightUpdater._update_weights_from_flattened_bucket`` (``FlattenedTensorMetadata`` +
  ``FlattenedTensorBucket.reconstruct_tensors``), in this separate process, so CPU buckets cross a
  real process boundary as shared memory;
* ``init_weights_update_group`` / ``update_weights_from_distributed``: SGLang's
  ``WeightUpdater.init_weights_update_group`` (its ``init_custom_process_group``, gloo instead of
  NCCL) and ``receive_weights_from_distributed`` (``FlattenedTensorBucket.empty`` + broadcast);
* answers to ``/generate`` are assembled with SGLang's own helpers (``FINISH_*.to_json``,
  ``detokenize_logprob_tokens``, ``_b64_encode_per_request``, ``add_weight_versions_to_meta_info``,
  and, when a test configures speculative decoding, ``TokenizerManager._calculate_spec_decoding_metrics``
  over per-request counters the stand-in makes up from a configured pattern of accepted drafts per
  verify step, with ``get_spec()`` answered from that configuration) after SGLang's
  ``normalize_batch_and_arguments`` and ``SamplingParams.verify`` accepted the request.

Where the stand-in imitates SGLang's behaviour rather than running it, it says so: the session
rule of >= 0.5.21 (updates outside begin/end fail), the weights checker (snapshot /
reset_tensors / compare / checksum over the stand-in's weights, answered in SGLang's
``ChecksumInfo`` shape with SGLang's ``_hash_tensor``), and ``/server_info`` (SGLang's route needs a
resolved ``ServerArgs``, so the stand-in answers it with the version and flags a test configures).
Control routes under ``/_standin/`` let a test configure the stand-in and read what it recorded.

Run: ``python sglang_standin_server.py PORT``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from sglang_env import import_sglang_on_cpu  # noqa: E402

import_sglang_on_cpu()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import Request  # noqa: E402
from rlcore.sync import tensor_checksum  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt.entrypoints import http_server as hs  # noqa: E402
from sglang.srt.managers import tokenizer_manager as tm_module  # noqa: E402
from sglang.srt.managers.detokenizer_manager import DetokenizerManager  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.utils import MultiprocessingSerializer  # noqa: E402
from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads  # noqa: E402
from sglang.srt.utils.msgspec_utils import msgspec_to_builtins  # noqa: E402
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: E402
from sglang.srt.utils.weight_checker import ChecksumInfo, ParallelismInfo, _hash_tensor, overall_checksum  # noqa: E402
from sglang.srt.utils.weight_versions import WeightVersionSpan, add_weight_versions_to_meta_info  # noqa: E402

VOCAB = 64


class Recorder(torch.nn.Module):
    """What SGLang's loaders call ``model.load_weights`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named_tensors):
        self.loaded.extend((n, t.clone()) for n, t in named_tensors)


def _updater(model: Recorder) -> WeightUpdater:
    noop = lambda *a, **k: None  # noqa: E731 - the updater's hooks into a real model runner
    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=noop, recapture_cuda_graph=noop,
                         get_model_runner=noop)


class StandInTokenizerManager:
    def __init__(self) -> None:
        self.configure({})

    def configure(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """A fresh stand-in (``reset``, the default) or changes to the running one (``reset: false``)."""
        if cfg.get("reset", True):
            self.version, self.tp_size, self.memory_saver, self.routed = "0.5.23", 1, True, None
            self.fail_update = None  # index of the update request to refuse
            self.drop_updates = False  # acknowledge updates without applying them
            self.weights: dict[str, torch.Tensor] = {}
            self.snapshot: dict[str, torch.Tensor] | None = None
            self.weight_version, self.session, self.paused = "default", False, False
            #: speculative decoding: {"algorithm", "num_draft_tokens", "correct": accepted drafts per verify step}
            self.spec = None
            self.log: list[dict[str, Any]] = []
            self.updates = 0
            self.dist_updater = _updater(Recorder())
        for key in ("version", "tp_size", "memory_saver", "routed", "fail_update", "drop_updates", "weight_version",
                    "spec"):
            if key in cfg:
                setattr(self, key, cfg[key])
        for name, shape in cfg.get("extra_weights", {}).items():  # engine-only tensors no checkpoint carries
            self.weights[name] = torch.ones(shape)
        return {"configured": True}

    @property
    def has_session(self) -> bool:
        return tuple(int(x) for x in self.version.split(".")[:3]) >= (0, 5, 21)

    def _event(self, route: str, obj: Any, **extra: Any) -> None:
        fields = msgspec_to_builtins(obj) if obj is not None else {}
        fields.pop("serialized_named_tensors", None)
        self.log.append({"route": route, "fields": fields, **extra})

    def _session_rule(self) -> tuple[bool, str] | None:
        # imitates SGLang >= 0.5.21: tensor/distributed updates need an open session
        if self.has_session and not self.session:
            return False, "update must run between begin_weight_update() and end_weight_update()"
        return None

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], obj: Any) -> tuple[bool, str]:
        index = self.updates
        self.updates += 1
        if self.fail_update is not None and index == self.fail_update:
            return False, f"stand-in refuses update request {index}"
        if not self.drop_updates:
            for name, t in tensors:
                self.weights[name] = t.clone()
        if getattr(obj, "weight_version", None) is not None:
            self.weight_version = obj.weight_version
        return True, "Success"

    # ---- weight updates (SGLang's receiving code) ----
    async def begin_weight_update(self, obj, request=None):
        self._event("/begin_weight_update", obj)
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        return True, "ok"

    async def end_weight_update(self, obj, request=None):
        self._event("/end_weight_update", obj)
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        return True, "ok"

    async def update_weights_from_tensor(self, obj, request=None):
        payloads = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        refused = self._session_rule()
        if refused:
            self._event("/update_weights_from_tensor", obj, refused=True)
            return refused
        per_rank = []
        for rank in range(self.tp_size):  # rank i deserializes only entry i
            monkey_patch_torch_reductions()
            data = MultiprocessingSerializer.deserialize(payloads[rank])
            model = Recorder()
            ok, message = _updater(model)._update_weights_from_flattened_bucket(flattened_tensor_bucket_dict=data)
            if not ok:
                return ok, message
            per_rank.append(model.loaded)
        for rank_tensors in per_rank[1:]:
            assert [(n, tensor_checksum(t)) for n, t in rank_tensors] == \
                [(n, tensor_checksum(t)) for n, t in per_rank[0]], "TP ranks received different tensors"
        self._event("/update_weights_from_tensor", obj, payloads=len(payloads),
                    received={n: [str(t.dtype), list(t.shape), tensor_checksum(t)] for n, t in per_rank[0]})
        return self._apply(per_rank[0], obj)

    async def init_weights_update_group(self, obj, request=None):
        self._event("/init_weights_update_group", obj)
        if not dist.is_initialized():  # SGLang's workers always have their default group
            store = tempfile.mktemp(prefix="standin-default-pg-")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        return self.dist_updater.init_weights_update_group(obj.master_address, obj.master_port, obj.rank_offset,
                                                           obj.world_size, obj.group_name, backend=obj.backend)

    async def update_weights_from_distributed(self, obj, request=None):
        refused = self._session_rule()
        if refused:
            self._event("/update_weights_from_distributed", obj, refused=True)
            return refused
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(None, lambda: self.dist_updater.receive_weights_from_distributed(
            names=obj.names, dtypes=obj.dtypes, shapes=obj.shapes, group_name=obj.group_name,
            load_format=obj.load_format))
        self._event("/update_weights_from_distributed", obj,
                    received={n: [str(t.dtype), list(t.shape), tensor_checksum(t)] for n, t in tensors})
        return self._apply(tensors, obj)

    async def destroy_weights_update_group(self, obj, request=None):
        self._event("/destroy_weights_update_group", obj)
        return self.dist_updater.destroy_weights_update_group(obj.group_name)

    async def update_weights_from_disk(self, obj, request=None):
        files = sorted(Path(obj.model_path).glob("*.safetensors"))
        self._event("/update_weights_from_disk", obj, files=[f.name for f in files],
                    others=sorted(f.name for f in Path(obj.model_path).iterdir() if f.suffix != ".safetensors"))
        tensors = [item for f in files for item in load_file(str(f)).items()]
        ok, message = self._apply(tensors, obj)
        return ok, message, 0

    async def update_weight_version(self, obj):
        self._event("/update_weight_version", obj)
        self.weight_version = obj.new_version

    # ---- generation control ----
    async def pause_generation(self, obj):
        self._event("/pause_generation", obj)
        self.paused = True

    async def continue_generation(self, obj):
        self._event("/continue_generation", obj)
        self.paused = False

    async def release_memory_occupation(self, obj, request=None):
        self._event("/release_memory_occupation", obj)
        if not self.memory_saver:
            raise RuntimeError("memory saver is not enabled")

    async def resume_memory_occupation(self, obj, request=None):
        self._event("/resume_memory_occupation", obj)

    async def flush_cache(self, timeout_s=0.0):
        self._event("/flush_cache", None)
        return SimpleNamespace(success=True, message="")

    # ---- the weights checker (imitated over the stand-in's weights) ----
    def _names(self, skip):
        return [n for n in sorted(self.weights) if not any(p in n for p in (skip or ()))]

    async def check_weights(self, obj, request=None):
        skip = getattr(obj, "skip_tensor_list", None)
        self._event("/weights_checker", obj)
        if obj.action == "snapshot":
            self.snapshot = {n: t.clone() for n, t in self.weights.items()}
            return True, "Success.", None, None
        if obj.action == "reset_tensors":
            for n in self._names(skip):
                self.weights[n] = torch.rand(self.weights[n].shape).to(self.weights[n].dtype)
            return True, "Success.", None, None
        if obj.action == "compare":
            bad = [n for n in self._names(skip) if not torch.equal(self.snapshot[n], self.weights[n])]
            self.snapshot = None
            if bad:
                return False, "check tensor equality failed:\n" + "\n".join(f"name={n}" for n in bad), None, None
            return True, "Success.", None, None
        sums = {n: _hash_tensor(self.weights[n]) for n in self._names(skip)}
        info = ChecksumInfo(checksums=sums, per_gpu_checksum=overall_checksum(sums), parallelism_info=ParallelismInfo(
            role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1))
        return True, "Success.", [info.model_dump()], overall_checksum({"0": info.per_gpu_checksum})

    # ---- generation (SGLang's request normalization, answer assembled with SGLang's helpers) ----
    async def generate_request(self, obj, request=None):
        self._event("/generate", None, fields_of_request={
            k: getattr(obj, k) for k in ("return_logprob", "return_routed_experts", "routed_experts_start_len",
                                         "return_sampling_mask", "sampling_logprobs_mode", "stream")})
        if self.paused:
            raise ValueError("generation is paused")
        obj.normalize_batch_and_arguments()
        outs = []
        for i in range(obj.batch_size):
            item = obj[i]
            sp = SamplingParams(**item.sampling_params)
            sp.verify(VOCAB)
            outs.append(self._sample(item.input_ids, sp, item))
        yield outs

    def _sample(self, prompt: list[int], sp: SamplingParams, item: Any) -> dict[str, Any]:
        # a fixed rule, not a model: token k = (sum(prompt) + 7k) mod VOCAB, log-prob -(k+1)/10
        ids, finish = [], FINISH_LENGTH(length=sp.max_new_tokens)
        for k in range(sp.max_new_tokens):
            tok = (sum(prompt) + 7 * k) % VOCAB
            ids.append(tok)
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                finish = FINISH_MATCHED_TOKEN(matched=tok)
                break
        vals = [-(k + 1) / 10 for k in range(len(ids))]
        meta: dict[str, Any] = {"id": "x", "finish_reason": finish.to_json(), "prompt_tokens": len(prompt),
                                "weight_version": self.weight_version, "completion_tokens": len(ids)}
        meta["output_token_logprobs"] = TokenizerManager.detokenize_logprob_tokens(None, vals, ids, False)
        if item.return_sampling_mask:
            meta["output_token_sampling_logprobs"] = [v - 0.05 for v in vals]
        if item.return_routed_experts and self.routed:
            layers, topk = self.routed
            rows = len(prompt) + len(ids) - 1 - item.routed_experts_start_len
            routes = (torch.arange(rows * layers * topk, dtype=torch.int32) % 8).reshape(rows, layers, topk)
            meta["routed_experts"] = DetokenizerManager._b64_encode_per_request([routes])[0]
        if self.spec:
            self._spec_meta(meta, len(ids))
        if self.weight_version == "span-test":  # one sample whose version changed mid-way
            spans = [WeightVersionSpan(version="4", start=0, end=1), WeightVersionSpan(version="5", start=1, end=len(ids))]
            add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(ids))
        return {"text": None, "output_ids": ids, "meta_info": meta}


    def _spec_meta(self, meta: dict[str, Any], num_tokens: int) -> None:
        """Made-up counters (the first token from prefill, then verify steps accepting the
        configured numbers of drafts in turn, plus one bonus token each), turned into meta_info
        by SGLang's own ``_calculate_spec_decoding_metrics``."""
        pattern, steps, hist, left = list(self.spec["correct"]), 0, [], num_tokens - 1
        while left > 0:
            correct = min(pattern[steps % len(pattern)], left - 1)
            hist += [0] * (correct + 1 - len(hist))
            hist[correct] += 1
            steps += 1
            left -= correct + 1
        counters = SimpleNamespace(spec_verify_ct=[steps], spec_num_correct_drafts=[sum(k * n for k, n in enumerate(hist))],
                                   completion_tokens=[num_tokens], spec_correct_drafts_histogram=[hist])
        spec = SimpleNamespace(speculative_algorithm=self.spec["algorithm"],
                               speculative_num_draft_tokens=self.spec["num_draft_tokens"])
        tm_module.get_spec = lambda: spec
        TokenizerManager._calculate_spec_decoding_metrics(None, meta, counters, 0)


def build_app(tm: StandInTokenizerManager):
    app = hs.app
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    # SGLang's /server_info needs a resolved ServerArgs; the stand-in answers it (see the module docstring)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in ("/server_info",)]

    async def server_info():
        return {"version": tm.version, "tp_size": tm.tp_size, "enable_memory_saver": tm.memory_saver,
                "enable_return_routed_experts": tm.routed is not None,
                "speculative_algorithm": tm.spec["algorithm"] if tm.spec else None,
                "speculative_num_draft_tokens": tm.spec["num_draft_tokens"] if tm.spec else None,
                "weight_cache_mode": "off"}

    async def configure(request: Request):
        return tm.configure(await request.json())

    async def log():
        return {"log": tm.log, "weight_version": tm.weight_version, "session": tm.session,
                "weights": {n: [str(t.dtype), list(t.shape), tensor_checksum(t)] for n, t in tm.weights.items()}}

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/_standin/configure", configure, methods=["POST"])
    app.add_api_route("/_standin/log", log, methods=["GET"])
    return app


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    uvicorn.run(build_app(StandInTokenizerManager()), host="127.0.0.1", port=int(sys.argv[1]), lifespan="off",
                log_level="warning")
