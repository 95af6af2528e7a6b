"""Fixtures for the megatron engine tests (run in the megatron-core venvs by
scripts/suites/megatron-*.sh; the main venv deselects them with ``-m "not engine"``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def megatron_dirs(tmp_path_factory, tiny_model_dirs):
    """HF directories beyond the conformance ones: tied embeddings, KV heads divisible by 2
    (tensor parallelism), Qwen3-MoE with KV heads divisible by 2, Qwen3-MoE with an MTP layer (DeepSeek-V3
    layout), Qwen2 with an MTP layer (MiMo layout), Qwen2-MoE (shared expert with a gate)."""
    from rlcore.testing.models import WORDS, make_model_dir, tiny_config

    root = tmp_path_factory.mktemp("rlcore-megatron-models")
    dirs = dict(tiny_model_dirs)
    dirs["dense_tied"] = make_model_dir(root / "dense_tied", "qwen2", seed=6, tie_word_embeddings=True)
    dirs["dense_kv2"] = make_model_dir(root / "dense_kv2", "qwen2", seed=7, num_kv_heads=2)
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
