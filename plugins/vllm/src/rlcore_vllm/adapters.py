"""LoRA adapter pushes into vLLM (``lora.rank`` > 0 with ``lora.push`` adapter or auto; docs/lora.md).

The engine starts on the base model of ``policy_hf/`` with vLLM's LoRA enabled
(:func:`lora_engine_kwargs`) and the initial adapter from ``policy_hf/adapter/``; every request
carries the ``LoRARequest`` of the current version. A push carries the trainer's adapter tensors
(PEFT's saved names): they are checked against the adapter the engine started with (names and
shapes, a partial push is refused), cast to the engine's LoRA dtype, written as a PEFT adapter
directory of their own in memory-backed storage (:class:`AdapterStore`), and loaded by vLLM's
public ``LLMEngine.add_lora``: vLLM 0.32 takes adapters from a path only (``LoRARequest.lora_path``;
its tensor constructor ``LoRAModel.from_lora_tensors`` is internal). Then the worker reports what it
holds (:func:`held_adapter`), compared tensor by tensor with the trainer's (:func:`expected_checksums`,
:func:`check_held`) before the version is served and the older adapter is removed from vLLM.

What ``exact`` compares: vLLM keeps the adapter it loaded (its registered ``LoRAModel``) in its LoRA
dtype with the scaling (``alpha / r``) folded into ``lora_B`` in place
(``LoRALayerWeights.optimize``), and copies it into the slot of the stacked buffers that the forward
reads (``lora_a_stacked[i][slot]``, ``lora_b_stacked[i][slot]``); both are read back and checksummed
(:func:`rlcore.sync.tensor_checksum`) against the trainer's tensors cast to that dtype, ``lora_B``
multiplied by the same scaling with the same in-place operation (so the bytes are equal, not close).

Nothing here imports vLLM at module level: the worker-side function takes vLLM's objects as arguments.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlcore.errors import RolloutError
from rlcore.lora import ADAPTER_FILE

#: the ranks vLLM 0.26-0.33's ``LoRAConfig.max_lora_rank`` accepts (read from the installed vLLM when it is there)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: PEFT's saved names: ``base_model.model.<module>.lora_A.weight``
PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank`` (its literal type)."""
    try:
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks

        allowed = sorted(int(r) for r in get_args(MaxLoRARanks))
    except ImportError:
        allowed = list(VLLM_MAX_LORA_RANKS)
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise RolloutError(f"lora.rank={rank}: vLLM serves LoRA adapters up to rank {allowed[-1]}")
    return fits[0]


def lora_engine_kwargs(rank: int, dtype: str) -> dict[str, Any]:
    """vLLM's LoRA arguments for one adapter of ``rank`` at a time.

    ``max_loras`` 1: every request of a rollout uses the current version, so one slot of the stacked
    buffers is enough (vLLM allocates every slot up front); ``max_cpu_loras`` 1: vLLM's cache keeps
    no adapter but the one loaded last. ``lora_dtype`` is the serving dtype: vLLM's LoRA kernels
    compute in the activations' dtype, so the trainer's adapters (fp32 under a bf16 base: PEFT's
    ``autocast_adapter_dtype``) are rounded to it once, on the trainer's side (vLLM names only
    float16/bfloat16; ``auto`` is the model's dtype, float32 here)."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(int(rank)), "max_loras": 1, "max_cpu_loras": 1,
            "lora_dtype": dtype if dtype in ("float16", "bfloat16") else "auto"}


def adapter_scaling(config: Mapping[str, Any]) -> float:
    """The scaling vLLM folds into ``lora_B`` for a PEFT ``adapter_config.json`` (its PEFTHelper's rule)."""
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise RolloutError("the adapter's adapter_config.json has rank_pattern/alpha_pattern: rlcore-vllm verifies "
                           "adapters with one rank and alpha for every module")
    r, alpha = int(config["r"]), config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def expected_checksums(tensors: Mapping[str, Any], scaling: float) -> dict[str, int]:
    """What vLLM must hold of each adapter tensor (already in vLLM's LoRA dtype): its checksum, and
    for ``lora_B`` that of ``B *= scaling``, the operation vLLM applies (no-op at scaling 1)."""
    held = []
    for name, t in tensors.items():
        if ".lora_B." in name and scaling != 1:
            t = t.clone()
            t *= scaling
        held.append(t)
    return dict(zip(tensors, _checksums(held), strict=True))


class AdapterStore:
    """The pushed adapters' directories: one per version (``v<N>/``, a PEFT adapter directory) under a
    private root in memory-backed storage (``/dev/shm`` where it exists, else the temp dir), each
    written under a temporary name and renamed into place (vLLM never reads a half-written one); every
    directory but the served one is removed once a push is served (:meth:`keep_only`)."""

    def __init__(self, config: Mapping[str, Any]):
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="rlcore-lora-", dir=base))
        self._config = json.dumps(dict(config), indent=2)

    def write(self, version: int, tensors: Mapping[str, Any]) -> Path:
        from safetensors.torch import save_file

        final = self.root / f"v{version}"
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))
        try:
            (tmp / CONFIG_FILE).write_text(self._config)
            save_file(dict(tensors), str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
            if final.exists():  # a version pushed again after a failed push
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def keep_only(self, keep: Path) -> None:
        """Remove every directory of the store but ``keep`` (all of them when it lives elsewhere)."""
        for d in self.root.iterdir():
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)

    def remove(self, directory: Path) -> None:
        if directory.parent == self.root:
            shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def held_adapter(manager: Any, lora_id: int) -> dict[str, Any]:
    """In vLLM's worker: what it holds of adapter ``lora_id`` (``manager``: the model runner's
    ``lora_manager._adapter_manager``, a ``LoRAModelManager``).

    Per adapter tensor, under its PEFT saved name: ``[shape, dtype, checksum as registered, checksum of
    its region of the adapter's slot in the stacked buffers (None where not read)]``. Packed modules
    (``qkv_proj``, ``gate_up_proj``) are split back into their parts with the manager's
    ``packed_modules`` (the parts in vLLM's order, the order of the layer's slices). A slot is read
    with tensor parallelism 1 only (with more, each rank holds a shard): ``unreadable`` says why not."""
    model = manager.get_adapter(lora_id)
    if model is None:
        raise RuntimeError(f"rlcore: vLLM's worker holds no LoRA adapter of id {lora_id} (it holds "
                           f"{sorted(manager.list_adapters())})")
    slot = manager.lora_index_to_id.index(lora_id) if lora_id in manager.lora_index_to_id else None
    names, tensors, regions, unreadable = [], [], [], {}
    for module, weights in model.loras.items():
        parts = manager.packed_modules.get(module, [module]) if weights.is_packed else [module]
        a_list, b_list = (weights.lora_a, weights.lora_b) if weights.is_packed else ([weights.lora_a], [weights.lora_b])
        layer = manager.modules.get(module)
        stacked = (getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None))
        for i, (part, a, b) in enumerate(zip(parts, a_list, b_list, strict=True)):
            for kind, t, buffers in (("lora_A", a, stacked[0]), ("lora_B", b, stacked[1])):
                if t is None:
                    continue
                name = f"{PEFT_PREFIX}{part}.{kind}.weight"
                region = None
                if slot is None:
                    unreadable[name] = "the adapter is in no slot of the stacked buffers (not active)"
                elif buffers is None or len(buffers) != len(parts) or getattr(layer, "tp_size", 1) != 1:
                    unreadable[name] = (f"{type(layer).__name__}'s stacked buffers do not map one slice per part "
                                        f"with tensor parallelism 1")
                else:
                    region = buffers[i][slot, 0, : t.shape[0], : t.shape[1]].contiguous()
                names.append(name)
                tensors.append(t)
                regions.append(region)
    held = _checksums(tensors)  # the registered copy lives in host memory, the slots on the device
    read = iter(_checksums([r for r in regions if r is not None]))
    in_slot = [next(read) if r is not None else None for r in regions]
    return {"tensors": {n: [list(t.shape), _dtype_name(t.dtype), h, s]
                        for n, t, h, s in zip(names, tensors, held, in_slot, strict=True)},
            "slot": slot, "unreadable": unreadable, "lora_dtype": _dtype_name(manager.lora_config.lora_dtype)}


def _checksums(tensors: list[Any]) -> list[int]:
    from rlcore.sync import ChecksumSlots

    if not tensors:
        return []
    sums = ChecksumSlots(tensors[0].device, capacity=len(tensors))
    return sums.values(sums.checksum(tensors))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def check_held(shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, int] | None, dtype: str,
               reports: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Compare every worker's :func:`held_adapter` report with what the trainer sent (``shapes``) and
    what vLLM must hold (``expected``; None: not verifying). Raises naming the tensors that are
    missing, extra, of another shape or dtype, or hold other bytes (as registered or in the slot);
    returns the checks that passed and what was read."""
    slot_read = unread = 0
    for w, rep in enumerate(reports):
        held = rep["tensors"]
        missing = sorted(set(shapes) - set(held))
        extra = sorted(set(held) - set(shapes))
        bad_shape = sorted(n for n in shapes if n in held and tuple(held[n][0]) != tuple(shapes[n]))
        bad_dtype = sorted(n for n in shapes if n in held and held[n][1] != dtype)
        if missing or extra or bad_shape or bad_dtype:
            raise RuntimeError(
                f"worker {w}: vLLM's copy of the adapter does not match the push: {len(missing)} tensor(s) missing "
                f"(e.g. {missing[:3]}), {len(extra)} it holds that the push did not carry (e.g. {extra[:3]}), "
                f"{len(bad_shape)} of another shape (e.g. {bad_shape[:3]}), {len(bad_dtype)} not in {dtype} "
                f"(e.g. {bad_dtype[:3]})")
        if expected is None:
            continue
        differ = sorted(n for n in shapes if held[n][2] != expected[n])
        slot_differ = sorted(n for n in shapes if held[n][3] is not None and held[n][3] != expected[n])
        if differ or slot_differ:
            raise RuntimeError(
                f"worker {w}: {len(differ)} adapter tensor(s) vLLM registered (e.g. {differ[:3]}) and "
                f"{len(slot_differ)} in the stacked buffers' slot {rep['slot']} (e.g. {slot_differ[:3]}) hold other "
                f"bytes than the trainer's (cast to {dtype}, lora_B times the scaling)")
        slot_read += sum(held[n][3] is not None for n in shapes)
        unread += len(rep["unreadable"])
    return {"checks": ["coverage"] + (["exact"] if expected is not None else []), "slot_read": slot_read,
            "slot_unreadable": unread}
