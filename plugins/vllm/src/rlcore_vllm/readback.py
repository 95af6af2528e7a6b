"""What the engine's parameters hold after vLLM's loaders ran, read back in the worker (``exact``).

The worker checksums every tensor it receives, but a loader that stores nothing (or stores it
elsewhere) would still pass that check. So each HF tensor is also checksummed from the parameter
it was loaded into, at the moment vLLM processes the layer: after its loaders ran and before
``process_weights_after_loading``, which on CPU moves linear weights into a prepacked GEMM and
leaves the parameter empty. What is compared, per HF tensor:

* a plain parameter (norms, embeddings, ``o_proj``): the parameter itself (a padded one, e.g. the
  vocabulary rows vLLM pads to a multiple of 64, narrowed to the HF shape);
* a fused parameter: the tensor's own slice, where the layer's loader put it: ``q``/``k``/``v``
  of ``qkv_proj`` (the layer's shard offsets), ``gate``/``up`` of ``gate_up_proj`` (its
  ``output_sizes``), an expert's ``w1``/``w3`` halves of ``w13_weight`` and its ``w2_weight``
  (held by the fused-MoE layer, or from vLLM 0.26 on by its ``routed_experts`` child: the layer
  whose loaders ran is the one read, whichever it is).

A tensor the worker cannot locate this way (tensor-parallel shards, a loader that reshaped or cast
it) is reported as not readable with the reason; the push then does not claim ``exact``. A tensor
that arrived but whose layer vLLM never processed (its loader stored nothing, so the layer kept its
older weights) is reported as missing and fails the push, as does a slice holding other bytes.

Two hooks, installed for the duration of one push: every ``quant_method`` instance's
``process_weights_after_loading`` (captures before processing) and layerwise reload's
``_copy_and_restore_kernel_tensors`` (captures layers without a quant method, e.g. RMSNorm).
Imported in vLLM's worker processes only.
"""

from __future__ import annotations

from typing import Any

import torch
from rlcore.sync import ChecksumSlots

_MARK = "_rlcore_readback"


class Located:
    """Where the loader put one received tensor: the layer, its parameter's name, the shard
    arguments that pick the slice, and the received tensor's shape and dtype."""

    __slots__ = ("layer", "param_name", "shard_args", "shape", "dtype")

    def __init__(self, layer: torch.nn.Module, param_name: str, args: dict[str, Any], loaded: torch.Tensor):
        self.layer, self.param_name = layer, param_name
        self.shard_args = {k: args[k] for k in ("loaded_shard_id", "shard_id", "expert_id") if k in args}
        self.shape, self.dtype = tuple(loaded.shape), loaded.dtype

    def region(self) -> tuple[torch.Tensor | None, str]:
        """The slice of the layer's parameter as it is now (after processing), or ``(None, why)``."""
        param = getattr(self.layer, self.param_name, None)
        return loaded_region(self.layer, param, self.shard_args, torch.empty(self.shape, dtype=self.dtype,
                                                                             device="meta"))


class ReadBack:
    """One push's read-back in one worker. ``track`` the received views before each bucket is
    loaded; :meth:`report` at finish."""

    def __init__(self, models: list[torch.nn.Module]):
        self.models = [m for m in models if m is not None]
        self.sums: dict[str, int] = {}
        # queued checksums of the regions read (one device read for the push, in report())
        self._slots = ChecksumSlots()
        self._slot_of: dict[str, int] = {}
        #: where each read tensor was found (rlcore_vllm.direct learns direct copies from it)
        self.located: dict[str, Located] = {}
        self.unreadable: dict[str, str] = {}
        # received tensors by address: (start, end, name, shape, stride, dtype); no references kept
        self._ranges: list[tuple[int, int, str, tuple, tuple, torch.dtype]] = []
        self._captured: set[int] = set()
        self._patched: list[Any] = []
        self._layerwise: Any = None
        self._copy_restore: Any = None

    # -------------------------------------------------------------------- hooks ------

    def install(self) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        seen: set[int] = set()
        for model in self.models:
            for layer in model.modules():
                method = getattr(layer, "quant_method", None)
                process = getattr(method, "process_weights_after_loading", None)
                if method is None or process is None or id(method) in seen:
                    continue
                seen.add(id(method))
                method.process_weights_after_loading = self._wrap_process(process)
                self._patched.append(method)
        self._layerwise = layerwise
        self._copy_restore = layerwise._copy_and_restore_kernel_tensors
        original = self._copy_restore

        def copy_and_restore(layer, info):
            self.capture(layer)
            return original(layer, info)

        setattr(copy_and_restore, _MARK, True)
        layerwise._copy_and_restore_kernel_tensors = copy_and_restore

    def _wrap_process(self, process):
        def process_weights_after_loading(layer, *args, **kwargs):
            self.capture(layer)
            return process(layer, *args, **kwargs)

        setattr(process_weights_after_loading, _MARK, True)
        return process_weights_after_loading

    def remove(self) -> None:
        for method in self._patched:
            if getattr(method.__dict__.get("process_weights_after_loading"), _MARK, False):
                del method.process_weights_after_loading  # the class's method again
        self._patched = []
        if self._layerwise is not None and getattr(self._layerwise._copy_and_restore_kernel_tensors, _MARK, False):
            self._layerwise._copy_and_restore_kernel_tensors = self._copy_restore
        self._layerwise = None

    # -------------------------------------------------------------------- tracking ---

    def track(self, views: list[tuple[str, torch.Tensor]]) -> None:
        """Remember where each received tensor lives, to recognise it among a layer's loader
        arguments (a bucket's views, or the copies made when the segment is reused)."""
        for name, t in views:
            lo = t.data_ptr()
            self._ranges.append((lo, lo + t.numel() * t.element_size(), name, tuple(t.shape), t.stride(), t.dtype))

    def forget(self, lo: int, hi: int) -> None:
        """A segment is about to be refilled: its old tensors are gone (pending ones were moved)."""
        self._ranges = [r for r in self._ranges if not lo <= r[0] < hi]

    def moved(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """A buffered loader argument was copied out of the segment (``_detach_pending_views``)."""
        found = self._received(old)
        if found is not None and found[1]:
            self.track([(found[0], new)])

    def _received(self, t: torch.Tensor) -> tuple[str, bool] | None:
        """``(name, as_sent)`` of the received tensor ``t`` is (a view of), else None."""
        ptr = t.data_ptr()
        for lo, hi, name, shape, stride, dtype in reversed(self._ranges):
            if lo <= ptr < hi or (lo == hi == ptr):
                return name, ptr == lo and tuple(t.shape) == shape and t.stride() == stride and t.dtype == dtype
        return None

    # -------------------------------------------------------------------- capture ----

    def capture(self, layer: torch.nn.Module) -> None:
        """Checksum, per received HF tensor, the slice of ``layer``'s parameter its loader wrote."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        if id(layer) in self._captured:
            return
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.loaded_weights:
            return
        self._captured.add(id(layer))
        for param_name, bound in info.loaded_weights:
            args = bound.arguments
            loaded = args.get("loaded_weight")
            if not isinstance(loaded, torch.Tensor):
                continue
            found = self._received(loaded)
            if found is None:
                continue  # not one of this push's tensors (a loader's own constant)
            name, as_sent = found
            if not as_sent:
                self.unreadable[name] = "the model's load_weights reshaped, cast or sliced it before its loader"
                continue
            param = args.get("param", getattr(layer, param_name, None))
            region, why = loaded_region(layer, param, args, loaded)
            if region is None:
                self.unreadable[name] = why
                continue
            # queued, not waited for: a region freed after processing goes back to the caching allocator,
            # whose reuse is ordered after the queued kernel on the same stream
            self._slot_of[name] = self._slots.checksum([region])[0]
            self.located[name] = Located(layer, param_name, args, loaded)
            self.unreadable.pop(name, None)

    def report(self, received: set[str]) -> dict[str, Any]:
        """What the finish report carries: ``read_back`` checksums, ``unreadable`` names with
        the reason, and ``not_stored``: received tensors no processed layer held."""
        if self._slot_of:
            values = self._slots.values()
            self.sums.update({name: values[slot] for name, slot in self._slot_of.items()})
            self._slot_of = {}
        not_stored = sorted(received - self.sums.keys() - self.unreadable.keys())
        return {"read_back": dict(self.sums), "unreadable": dict(sorted(self.unreadable.items())[:20]),
                "num_unreadable": len(self.unreadable), "not_stored": not_stored[:20], "num_not_stored": len(not_stored)}


def loaded_region(layer: torch.nn.Module, param: Any, args: dict[str, Any],
                  loaded: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """The slice of ``param`` that ``layer``'s loader filled from ``loaded`` (tensor parallelism 1),
    or ``(None, why)``."""
    if not isinstance(param, torch.Tensor) or param.is_meta:
        return None, "its parameter is not materialised"
    data = param.data
    shard = args.get("loaded_shard_id", args.get("shard_id"))
    expert = args.get("expert_id")
    dim = int(getattr(param, "output_dim", 0) or 0)
    # a fused-MoE layer of vLLM >= 0.26 (RoutedExperts) has no tp_size of its own: its moe_config does
    tp = int(getattr(layer, "tp_size", None) or getattr(getattr(layer, "moe_config", None), "tp_size", 1) or 1)
    if tp != 1:
        return None, f"tensor parallel size {tp}: the worker holds a shard"
    if expert is not None:  # FusedMoE: [experts, ...] per parameter
        local = int(expert)
        to_local = getattr(layer, "_map_global_expert_id_to_local_expert_id", None)
        if callable(to_local):
            local = int(to_local(int(expert)))
        if local < 0 or local >= data.shape[0]:
            return None, f"expert {expert} is not held by this worker"
        data = data[local]
        if shard in ("w1", "w3"):
            half = data.shape[0] // 2
            data = data.narrow(0, 0 if shard == "w1" else half, half)
    elif isinstance(shard, str) and callable(getattr(layer, "_get_shard_offset_mapping", None)):
        offset, size = layer._get_shard_offset_mapping(shard), layer._get_shard_size_mapping(shard)
        if offset is None or size is None:
            return None, f"unknown shard {shard!r} of {type(layer).__name__}"
        data = data.narrow(dim, int(offset), int(size))
    elif isinstance(shard, int) and getattr(layer, "output_sizes", None):
        sizes = list(layer.output_sizes)
        data = data.narrow(dim, sum(sizes[:shard]), sizes[shard])
    elif shard is not None:
        return None, f"shard {shard!r} of {type(layer).__name__} is not located by rlcore"
    if data.dtype != loaded.dtype:
        return None, f"stored as {data.dtype}, received as {loaded.dtype}"
    if data.dim() != loaded.dim() or any(h < w for h, w in zip(data.shape, loaded.shape, strict=True)):
        return None, f"its slice {tuple(data.shape)} does not hold the received shape {tuple(loaded.shape)}"
    # padding (vocabulary rows, padded intermediate sizes): the received tensor is the leading block
    return data[tuple(slice(0, s) for s in loaded.shape)], ""
