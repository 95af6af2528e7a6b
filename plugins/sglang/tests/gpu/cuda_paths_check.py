"""GPU check of the two paths CPU CI cannot run: CUDA-IPC flattened-bucket payloads and the NCCL
broadcast, received by SGLang's own code in separate processes. Run by hand on a machine with
CUDA GPUs (two for the NCCL part and the cross-GPU UUID case); not part of any pytest suite.

SGLang's engine is not needed, nor SGLang's package import chain (which pulls in its CUDA kernel
stack): the receiving code is SGLang 0.5.23's own source, executed from the files of its wheel —

* ``sglang/srt/weight_sync/tensor_bucket.py`` (loaded as it is: it imports only torch),
* ``SafeUnpickler``, ``_safe_load_torch_storage`` and ``init_custom_process_group`` from
  ``sglang/srt/utils/common.py``, and ``monkey_patch_torch_reductions`` with its helpers from
  ``sglang/srt/utils/patch_torch.py``, each extracted by name from the file's syntax tree and run
  unchanged;

so what the receivers do is what an SGLang rank does with ``update_weights_from_tensor``
(``monkey_patch_torch_reductions`` → SafeUnpickler → ``FlattenedTensorBucket.reconstruct_tensors``)
and ``update_weights_from_distributed`` (``init_custom_process_group`` →
``FlattenedTensorBucket.empty`` → broadcast → ``reconstruct_tensors``).

Checks:

1. every TP rank's CUDA-IPC payload, opened by a separate process per rank, each with another
   ``CUDA_VISIBLE_DEVICES`` order, reconstructs exactly the tensors sent, on the sender's physical
   GPU (found by the UUID rlcore writes into the handle);
2. a control payload pickled the plain torch way (device *index*), opened in a process whose
   device order is rotated, does not land on the sender's GPU — what the UUID prevents;
3. with two GPUs, ``sglang-nccl``'s sender group and bucket layout against SGLang's receiver
   over NCCL: every tensor arrives exactly.

Usage::

    PYTHONPATH=core/src:plugins/sglang/src python plugins/sglang/tests/gpu/cuda_paths_check.py \\
        --sglang-src DIR --out result.json      # DIR holds sglang/srt/... from the 0.5.23 wheel
"""

from __future__ import annotations
import __future__

import argparse
import ast
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Union

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reducers on ForkingPickler

HERE = Path(__file__).resolve()


# ------------------------------------------------------------- SGLang's code, by name -----


def load_sglang_receiver(src: Path) -> dict[str, Any]:
    """SGLang's receiving functions and classes, from its source files, unchanged."""
    import importlib.util

    import torch.multiprocessing.reductions as reductions

    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket",
                                                  src / "sglang/srt/weight_sync/tensor_bucket.py")
    bucket_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bucket_mod)

    ns: dict[str, Any] = {
        "__name__": "sglang_extracted", "pickle": pickle, "io": io, "torch": torch, "Union": Union,
        "Callable": Callable, "reductions": reductions, "_is_npu": False,
        "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]),
    }
    wanted = {
        "sglang/srt/utils/common.py": ["_safe_load_torch_storage", "SafeUnpickler", "init_custom_process_group"],
        "sglang/srt/utils/patch_torch.py": ["monkey_patch_torch_reductions", "_REDUCE_TENSOR_ARG_DEVICE_INDEX",
                                            "_reduce_tensor_modified", "_rebuild_cuda_tensor_modified",
                                            "_device_to_uuid", "_device_from_maybe_uuid", "_modify_tuple"],
    }
    flags = __future__.annotations.compiler_flag
    for rel, names in wanted.items():
        tree = ast.parse((src / rel).read_text())
        found = {}
        for node in tree.body:
            name = getattr(node, "name", None)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            if name in names:
                found[name] = node
        missing = set(names) - set(found)
        if missing:
            raise SystemExit(f"{rel} has no {sorted(missing)}: not the SGLang 0.5.23 source")
        for name in names:
            code = compile(ast.Module(body=[found[name]], type_ignores=[]), str(src / rel), "exec", flags=flags)
            exec(code, ns)
    ns["FlattenedTensorBucket"] = bucket_mod.FlattenedTensorBucket
    return ns


# ----------------------------------------------------------------------- receivers -------


def receive_ipc(src: Path, payload_dir: Path, rank: int) -> dict[str, Any]:
    sg = load_sglang_receiver(src)
    sg["monkey_patch_torch_reductions"]()  # what every SGLang rank runs before deserializing
    from rlcore.sync import tensor_checksum

    out: dict[str, Any] = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "tensors": {}}
    for path in sorted(payload_dir.glob(f"bucket*.rank{rank}.pkl")):
        data = sg["SafeUnpickler"](io.BytesIO(path.read_bytes())).load()
        bucket = sg["FlattenedTensorBucket"](flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        flat = data["flattened_tensor"]
        out["device_uuid"] = str(torch.cuda.get_device_properties(flat.device).uuid)
        for name, t in bucket.reconstruct_tensors():
            out["tensors"][name] = [str(t.dtype), list(t.shape), tensor_checksum(t)]
        torch.cuda.synchronize()
        del data, bucket, flat
    return out


def receive_plain_index(payload: Path) -> dict[str, Any]:
    """Control: a payload whose handle carries the device index, as plain torch writes it."""
    try:
        t = pickle.loads(payload.read_bytes())
        return {"device_uuid": str(torch.cuda.get_device_properties(t.device).uuid), "error": None}
    except Exception as exc:  # noqa: BLE001 - the outcome is what is reported
        return {"device_uuid": None, "error": f"{type(exc).__name__}: {exc}"}


def receive_nccl(src: Path, meta_path: Path, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    sg = load_sglang_receiver(src)
    from rlcore.sync import tensor_checksum

    torch.cuda.set_device(0)
    meta = json.loads(meta_path.read_text())
    pg = sg["init_custom_process_group"](backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                         rank=1, group_name=meta["group"])
    out: dict[str, Any] = {"tensors": {}}
    for names, dtypes, shapes in meta["buckets"]:
        bucket = sg["FlattenedTensorBucket"].empty(names, dtypes, shapes, "cuda")
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        for name, t in bucket.reconstruct_tensors():
            out["tensors"][name] = [str(t.dtype), list(t.shape), tensor_checksum(t)]
    torch.cuda.synchronize()
    return out


# -------------------------------------------------------------------------- sender -------


def weights(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for i in range(6):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.qkv_proj.weight", torch.randn(384, 256, generator=g).to(torch.bfloat16)),
                (p + "input_layernorm.weight", torch.randn(256, generator=g)),
                (p + "mlp.experts.w13_weight", torch.randn(8, 512, 256, generator=g).to(torch.float8_e4m3fn)),
                (p + "mlp.gate.e_score_correction_bias", torch.randn(8, generator=g).to(torch.float64)),
                (p + "tokens", torch.randint(0, 1000, (17,), generator=g)),
                (p + "mask", torch.rand(5, generator=g) > 0.5),
                (p + "empty", torch.empty(0, 4, dtype=torch.bfloat16))]
    return [(n, t.to(device)) for n, t in out]


def run_child(args: list[str], visible: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = subprocess.run([sys.executable, str(HERE), *args], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"child_failed": proc.returncode, "stderr": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=["ipc", "plain", "nccl"], default=None)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.child == "ipc":
        print(json.dumps(receive_ipc(a.sglang_src, a.dir, a.rank)))
        return
    if a.child == "plain":
        print(json.dumps(receive_plain_index(a.dir / "plain.pkl")))
        return
    if a.child == "nccl":
        print(json.dumps(receive_nccl(a.sglang_src, a.dir / "nccl.json", a.port)))
        return

    from rlcore.sync import iter_buckets, tensor_checksum
    from rlcore_sglang import wire
    from rlcore_sglang.sync import broadcast_from_trainer, free_port, open_sender_group

    ngpu = torch.cuda.device_count()
    gpus = list(range(ngpu))
    sender_uuid = str(torch.cuda.get_device_properties(0).uuid)
    stream = weights("cuda:0")
    sent = {n: [str(t.dtype), list(t.shape), tensor_checksum(t)] for n, t in stream}
    result: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i) for i in gpus], "torch": torch.__version__,
                              "sender_uuid": sender_uuid, "tensors": len(stream)}
    work = Path(tempfile.mkdtemp(prefix="rlcore-sglang-gpu-"))
    tp = max(2, ngpu)

    # 1. CUDA-IPC payloads, one per TP rank, each opened by its own process with its own device order
    buckets = list(iter_buckets(iter(stream), 256 << 10))  # fresh CUDA buffers, kept alive until read
    for b in buckets:
        for rank, payload in enumerate(wire.serialize_per_rank(wire.flattened_bucket_payload(b), tp)):
            (work / f"bucket{b.index:03d}.rank{rank}.pkl").write_bytes(payload)
    ipc = {}
    for rank in range(tp):
        order = gpus[rank % ngpu:] + gpus[:rank % ngpu]  # rank r sees the sender's GPU at index (-r) mod n
        got = run_child(["--child", "ipc", "--sglang-src", str(a.sglang_src), "--dir", str(work),
                         "--rank", str(rank)], ",".join(map(str, order)))
        ipc[rank] = {"visible": got.get("visible"), "on_sender_gpu": got.get("device_uuid") == sender_uuid,
                     "exact": got.get("tensors") == sent, "error": got.get("stderr")}
    result["cuda_ipc"] = ipc
    result["buckets"] = len(buckets)
    torch.cuda.ipc_collect()

    # 2. control: the device index without the UUID, opened with a rotated device order
    if ngpu >= 2:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(buckets[0].buffer)
        (work / "plain.pkl").write_bytes(buf.getvalue())
        got = run_child(["--child", "plain", "--sglang-src", str(a.sglang_src), "--dir", str(work)],
                        ",".join(map(str, gpus[1:] + gpus[:1])))
        result["plain_index_control"] = {"on_sender_gpu": got.get("device_uuid") == sender_uuid,
                                         "error": got.get("error") or got.get("stderr")}
    del buckets

    # 3. NCCL: rlcore's sender group and layout against SGLang's receiver
    if ngpu >= 2:
        port = free_port()
        nccl_buckets = list(iter_buckets(iter(stream), 256 << 10, device="cuda:0"))
        group = "rlcore-gpu-check"
        (work / "nccl.json").write_text(json.dumps({"group": group, "buckets": [
            list(wire.nccl_bucket_metadata(b)) for b in nccl_buckets]}))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
        child = subprocess.Popen([sys.executable, str(HERE), "--child", "nccl", "--sglang-src", str(a.sglang_src),
                                  "--dir", str(work), "--port", str(port)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        t0 = time.perf_counter()
        pg = open_sender_group("127.0.0.1", port, 2, group, "nccl", timeout_s=120)
        for b in nccl_buckets:
            broadcast_from_trainer(pg, b.buffer)
        torch.cuda.synchronize()
        stdout, stderr = child.communicate(timeout=300)
        got = json.loads(stdout.strip().splitlines()[-1]) if child.returncode == 0 else {"stderr": stderr[-3000:]}
        result["nccl"] = {"exact": got.get("tensors") == sent, "buckets": len(nccl_buckets),
                          "seconds": time.perf_counter() - t0, "error": got.get("stderr")}

    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
