"""Fixtures for the megatron engine tests (run in the megatron-core venvs by
scripts/suites/megatron-*.sh; the main venv deselects them with ``-m "not engine"``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def megatron_dirs(tmp_path_factory, tiny_model_dirs):
    """HF directories beyond the conformance ones: tied embeddings, KV heads divisible by 2
    (tensor parallelism), four layers (pipeline stages), Qwen3-MoE with KV heads divisible by 2, Qwen3-MoE with an MTP layer (DeepSeek-V3
    layout), Qwen2 with an MTP layer (MiMo layout), Qwen2-MoE (shared expert with a gate)."""
    from rlcore.testing.models import WORDS, make_model_dir, tiny_config

    root = tmp_path_factory.mktemp("rlcore-megatron-models")
    dirs = dict(tiny_model_dirs)
    dirs["dense_tied"] = make_model_dir(root / "dense_tied", "qwen2", seed=6, tie_word_embeddings=True)
    dirs["dense_kv2"] = make_model_dir(root / "dense_kv2", "qwen2", seed=7, num_kv_heads=2)
    # four decoder layers: two pipeline stages of two virtual stages each
    dirs["dense_4l"] = make_model_dir(root / "dense_4l", "qwen2", seed=11, num_kv_heads=2, num_layers=4)
    dirs["qwen2_moe"] = make_model_dir(root / "qwen2_moe", "qwen2_moe", seed=8)
    dirs["moe_kv2"] = make_model_dir(root / "moe_kv2", "qwen3_moe", seed=10, num_kv_heads=2)
    dirs["moe_mtp"] = _mtp_model_dir(root / "moe_mtp", tiny_config("qwen3_moe", seed=9, mtp_layers=1), WORDS)
    # MiMo: Qwen2 + model.mtp_layers.* (the layout vLLM serves as an MTP draft)
    dirs["dense_mtp"] = _mtp_model_dir(root / "dense_mtp", tiny_config("qwen2", seed=10, mtp_layers=1), WORDS)
    return dirs


def _mtp_model_dir(path: Path, tiny, words) -> Path:
    """An HF directory with MTP layers: transformers builds none, so they are created the way the
    engine creates them for a tiny model (HFSource.from_model) and saved with the rest."""
    from rlcore.engines.tiny import make_tokenizer
    from rlcore_megatron.hf_dir import tiny_source
    from safetensors.torch import save_file

    tok = make_tokenizer(words)
    src = tiny_source(tiny, tok)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: src.get(n).contiguous() for n in sorted(src.names)}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    src.config.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def engine_for(megatron_dirs):
    """``engine_for(name)``: a MegatronEngine (TP=EP=1) for one of the directories, built once."""
    from rlcore_megatron.engine import HFSource, MegatronEngine

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = MegatronEngine(HFSource.from_dir(megatron_dirs[name]))
        return cache[name]

    return get


#: the megatron-core release whose suite runs every parallel combination (the newest we test)
COMBINATIONS_FROM = (0, 16)


@pytest.fixture(scope="session")
def combinations_only_on_newest():
    """``skip(what)``: skip a parallel combination below :data:`COMBINATIONS_FROM`. The oldest suite
    (0.12.1) runs one case of each kind (TP, EP, DP, PP with virtual stages), which reaches every
    version-dependent megatron-core call; combining them (DP×TP, TP×PP, DP×PP, the same under Ray,
    resume across a layout) adds ranks and rlcore code, not megatron-core calls, and costs minutes
    of CI per suite."""
    from importlib.metadata import version

    release = tuple(int(x) for x in version("megatron-core").split(".")[:2])

    def skip(what: str) -> None:
        if release < COMBINATIONS_FROM:
            pytest.skip(f"{what}: run on megatron-core >= {'.'.join(map(str, COMBINATIONS_FROM))} only "
                        f"(this is {'.'.join(map(str, release))}; each kind alone runs here)")

    return skip


@pytest.fixture(scope="session")
def figures():
    """``figures(name, value)``: a measured figure, appended to $RLCORE_MEGATRON_FIGURES (the
    suite script prints the file) and printed."""
    path = os.environ.get("RLCORE_MEGATRON_FIGURES")

    def record(name: str, value) -> None:
        import megatron.core as mc

        line = f"megatron-core {mc.__version__}  {name}: {value}"
        print(line)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return record


@pytest.fixture(scope="session")
def run_worker():
    """``run_worker(worker, model_dir, out, tp, ep, world, *extra)``: a worker script of this
    folder over ``world`` ranks (``torch.distributed.run``, gloo on CPU; a world of one as a plain
    process), one thread each, ``extra`` appended to its arguments; returns what the workers
    ``torch.save``d to ``out``."""
    import socket
    import subprocess
    import sys

    import torch

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def run(worker: Path, model_dir: Path, out: Path, tp: int, ep: int, world: int, *extra: object) -> dict:
        if world == 1:
            cmd = [sys.executable, str(worker), str(model_dir), str(out), "1", "1", *map(str, extra)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={free_port()}", str(worker), str(model_dir), str(out), str(tp), str(ep),
                   *map(str, extra)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return torch.load(out)

    return run
