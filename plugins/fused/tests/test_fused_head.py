"""rlcore-fused on CPU: the chunked torch backend against rlcore's conformance suite and float64,
the plugin's registration and settings, backend selection and its errors, and a GRPO run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import rlcore_fused.plugin as plugin
import torch
from rlcore.errors import BatchShapeError
from rlcore.testing.conformance import ForwardFnConformance, float64_head
from rlcore.testing.imports import modules_loaded_by
from rlcore.types import BuildContext, HeadInput, VocabShard
from rlcore_fused.head import FusedBackendError, FusedHead, fused_logprobs
from rlcore_fused.softmax_stats import NEG_BIG, empty_record, finalize, merge_records
from rlcore_fused.torch_backend import TorchKernels

SPEC = next(iter(plugin.forward_fn()))
ROOT = Path(__file__).resolve().parents[3]


class TestFusedTorchBackend(ForwardFnConformance):
    capabilities = SPEC.capabilities
    factory_path = "rlcore_fused.head:torch_head"

    @pytest.fixture
    def forward_fn(self):
        # 5-token chunks: every check crosses chunk boundaries (the single-chunk case is the
        # default chunk_tokens=2048 of the other tests below)
        return FusedHead(backend="torch", chunk_tokens=5)


def _inputs(seed, T=29, H=24, V=45, rows=48, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(rows, H, generator=g) * 0.5).to(dtype)
    weight[V:] = 4.0  # padding rows with large logits
    labels = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.25
    return hidden, weight, labels, mask, V


# ------------------------------------------------------------------ statistics ----------


def _record(hidden, weight, labels, start, temp=1.0):
    return TorchKernels(chunk_tokens=7).local_record(hidden, weight, labels - start,
                                                    torch.full((hidden.shape[0],), 1.0 / temp), True)


def test_merged_shard_records_equal_the_whole_vocab_record():
    hidden, weight, labels, _, V = _inputs(1)
    whole = _record(hidden, weight[:V], labels, 0)
    # three uneven shards, the last one only padding (a rank whose rows are all ≥ vocab_size)
    bounds = [(0, 10), (10, V), (V, V)]
    parts = torch.stack([_record(hidden, weight[a:b], labels, a) for a, b in bounds])
    assert torch.equal(parts[2], empty_record(hidden.shape[0], hidden.device))
    merged = merge_records(parts)
    torch.testing.assert_close(merged, whole, rtol=1e-6, atol=1e-5)
    lp, ent, _, _, missing = finalize(merged, True)
    assert not bool(missing)
    ref_lp, ref_ent = float64_head(hidden, weight, labels, V, 1.0, torch.ones_like(labels, dtype=torch.bool))
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)


def test_base2_merge_matches_natural_merge():
    hidden, weight, labels, _, V = _inputs(2)
    parts = torch.stack([_record(hidden, weight[a:b], labels, a) for a, b in [(0, 20), (20, V)]])
    natural = merge_records(parts)
    base2 = parts.clone()
    base2[:, [0, 2, 3]] /= torch.log(torch.tensor(2.0))  # logits in base-2 units
    merged2 = merge_records(base2, base2=True)
    merged2[[0, 2, 3]] *= torch.log(torch.tensor(2.0))
    torch.testing.assert_close(merged2, natural, rtol=1e-6, atol=1e-5)


def test_target_in_no_shard_is_flagged():
    hidden, weight, labels, _, V = _inputs(3)
    rec = _record(hidden, weight[:10], labels, 0)  # most targets are outside [0, 10)
    assert (rec[3] == NEG_BIG).any()
    assert bool(finalize(rec, True)[4])
    assert not bool(finalize(_record(hidden, weight[:V], labels, 0), True)[4])


def test_shards_that_miss_part_of_the_vocab_are_an_error():
    # a single "rank" whose shard claims [0, 10) of a 45-token vocabulary: targets ≥ 10 are nowhere
    hidden, weight, labels, mask, V = _inputs(12)
    inp = HeadInput(hidden=hidden, weight=weight[:10], labels=labels, vocab=VocabShard(0, 10, V), loss_mask=mask)
    with pytest.raises(BatchShapeError, match="no rank's vocabulary shard"):
        FusedHead(backend="torch")(inp)


# ------------------------------------------------------------------ the head ------------


def _head_input(hidden, weight, labels, mask, V, **kw):
    return HeadInput(hidden=hidden, weight=weight, labels=labels, vocab=VocabShard.full(V, rows=weight.shape[0]),
                     loss_mask=mask, **kw)


class _CountingKernels(TorchKernels):
    """Records how many token rows reach the kernels (masked tokens must not)."""

    def __init__(self):
        super().__init__(chunk_tokens=8)
        self.rows_forward: list[int] = []
        self.rows_backward: list[int] = []

    def local_record(self, x, *args):
        self.rows_forward.append(x.shape[0])
        return super().local_record(x, *args)

    def grads(self, x, *args):
        self.rows_backward.append(x.shape[0])
        return super().grads(x, *args)


def test_masked_tokens_never_reach_the_kernels():
    hidden, weight, labels, mask, V = _inputs(4)
    kernels = _CountingKernels()
    h = hidden.clone().requires_grad_()
    out = fused_logprobs(_head_input(h, weight, labels, mask, V), kernels)
    out.logprobs.sum().backward()
    assert kernels.rows_forward == [int(mask.sum())] and kernels.rows_backward == [int(mask.sum())]
    assert torch.all(h.grad[~mask] == 0)


def test_fp32_outputs_for_bf16_inputs_and_per_token_temperature():
    hidden, weight, labels, mask, V = _inputs(5, dtype=torch.bfloat16)
    temp = torch.linspace(0.5, 1.5, hidden.shape[0])
    out = FusedHead(backend="torch")(_head_input(hidden, weight, labels, mask, V, temperature=temp))
    ref_lp, ref_ent = float64_head(hidden, weight, labels, V, temp, mask)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ref_ent, atol=2e-5, rtol=0)


def test_entropy_not_requested_is_none_and_logprob_gradient_unchanged():
    hidden, weight, labels, mask, V = _inputs(6)
    grads = []
    for compute_entropy in (True, False):
        h = hidden.clone().requires_grad_()
        out = FusedHead(backend="torch")(_head_input(h, weight, labels, mask, V, compute_entropy=compute_entropy))
        assert (out.entropy is None) is (not compute_entropy)
        out.logprobs.sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, labels, mask, V = _inputs(7)
    h = hidden.clone().requires_grad_()
    out = FusedHead(backend="torch")(_head_input(h, weight, labels, mask, V))
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert weight.grad is None and h.grad is not None and h.grad.abs().sum() > 0


@pytest.mark.parametrize("field,value,message", [
    ("labels", torch.zeros(5, dtype=torch.long), r"labels must be \[T=29\]"),
    ("loss_mask", torch.ones(5, dtype=torch.bool), r"loss_mask must be \[T=29\]"),
    ("temperature", torch.ones(5), r"per-token temperature must be \[T=29\]"),
    ("weight", torch.randn(48, 7), r"weight must be \[V_local, H=24\]"),
])
def test_shape_errors_say_what_was_expected(field, value, message):
    hidden, weight, labels, mask, V = _inputs(8)
    kw = dict(hidden=hidden, weight=weight, labels=labels, loss_mask=mask)
    kw[field] = value
    with pytest.raises(BatchShapeError, match=message):
        FusedHead(backend="torch")(HeadInput(vocab=VocabShard.full(V, rows=48), **kw))


def test_out_of_vocab_label_at_an_unmasked_position_is_an_error():
    hidden, weight, labels, mask, V = _inputs(9)
    labels = labels.clone()
    labels[int(mask.nonzero()[0])] = V  # a padding id
    with pytest.raises(BatchShapeError, match=rf"must be in \[0, {V}\)"):
        FusedHead(backend="torch")(_head_input(hidden, weight, labels, mask, V))


def test_non_positive_temperature_is_an_error():
    hidden, weight, labels, mask, V = _inputs(10)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        FusedHead(backend="torch")(_head_input(hidden, weight, labels, mask, V, temperature=0.0))


# ------------------------------------------------------------------ backend selection ----


def test_auto_uses_the_torch_backend_for_cpu_tensors():
    head = FusedHead()
    assert head.kernels_for(torch.device("cpu")).name == "torch"


def test_auto_refuses_devices_it_has_no_kernel_for():
    with pytest.raises(FusedBackendError, match="fused.backend=torch"):
        FusedHead().kernels_for(torch.device("meta"))


def test_cuda_without_triton_is_an_error_not_a_silent_torch_fallback(monkeypatch):
    # a GPU machine whose Triton is missing or broken: `auto` must raise and say what to do
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "rlcore_fused.triton_backend", raising=False)
    monkeypatch.delitem(sys.modules, "rlcore_fused.triton_kernels", raising=False)
    with pytest.raises(FusedBackendError, match=r"rlcore-fused\[triton\]"):
        FusedHead().kernels_for(torch.device("cuda"))


def test_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, labels, mask, V = _inputs(11)
    head = FusedHead(backend="triton")
    try:
        import triton  # noqa: F401
    except ImportError:
        expected = FusedBackendError
    else:
        expected = RuntimeError
    with pytest.raises(expected, match="TRITON_INTERPRET|rlcore-fused\\[triton\\]"):
        head(_head_input(hidden, weight, labels, mask, V))


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ValueError, match="auto, triton, torch"):
        FusedHead(backend="cuda")


# ------------------------------------------------------------------ plugin --------------


def test_plugin_module_imports_neither_torch_nor_triton():
    loaded = modules_loaded_by("import rlcore_fused.plugin as p; next(iter(p.forward_fn()))", ["torch", "triton"])
    assert loaded == []


def test_plugin_is_found_through_its_entry_point():
    from rlcore.manager import PluginManager

    pm = PluginManager()
    pm.activate(["fused"])
    spec = pm.select("forward_fn", "fused", key="forward.name")
    assert spec.distribution.startswith("rlcore-fused ")
    assert spec.capabilities == plugin.CAPABILITIES


def test_settings_section_configures_the_head(register_plugin, rlcore_config):
    register_plugin(plugin, "fused")
    cfg = rlcore_config("forward.name=fused", "fused.backend=torch", "fused.chunk_tokens=64",
                        "fused.backward_chunk_mib=128", "fused.loss_chunk_mib=256", "fused.loss_compile_objective=true")
    head = SPEC.factory(BuildContext(config=cfg, settings=cfg.fused))
    assert head.backend == "torch" and head.chunk_tokens == 64 and head.triton_config.chunk_mib == 128
    assert head.triton_config.loss_chunk_mib == 256 and head.triton_config.loss_compile_objective


@pytest.mark.slow
def test_grpo_run_with_the_fused_head_matches_the_reference_run(tmp_path):
    from rlcore.testing.runs import main

    tiny = str(ROOT / "examples" / "tiny.yaml")
    base = ["training.steps=8", "output.checkpoint_every=0", "output.plot=false"]
    assert main(["train", tiny, "--output", str(tmp_path / "ref"), *base]) == 0
    assert main(["train", tiny, "--output", str(tmp_path / "fused"), *base, "plugins=[fused]", "forward.name=fused"]) == 0

    def rows(d):
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]

    ref, fused = rows(tmp_path / "ref"), rows(tmp_path / "fused")
    assert len(fused) == 8
    # same seed, same semantics: the two heads agree to fp32 rounding, so the runs coincide
    for a, b in zip(ref, fused, strict=True):
        assert abs(a["reward_mean"] - b["reward_mean"]) < 1e-6
        assert abs(a["entropy"] - b["entropy"]) < 1e-3
    assert max(x["logprob_mismatch_max"] for x in fused) < 1e-4


# ------------------------------------------------------- config-time validation ------------


@pytest.mark.parametrize("overrides,key,match", [
    (["fused.backend=cuda"], "fused.backend", "choose one of: auto, triton, torch"),
    (["fused.chunk_tokens=0"], "fused.chunk_tokens", "must be >= 1"),  # was clamped to 1 silently
    (["fused.backward_chunk_mib=-4"], "fused.backward_chunk_mib", "must be >= 1"),  # same
    (["forward.name=fused", "engine.device=meta"], "fused.backend", "no kernel for engine.device=meta"),
    (["forward.name=fused", "fused.backend=triton", "engine.device=cpu"], "fused.backend",
     "TRITON_INTERPRET=1|not installed"),
])
def test_rlcore_check_refuses_what_the_fused_head_would(register_plugin, rlcore_config, monkeypatch, overrides, key,
                                                         match):
    """Before: these passed `rlcore check` and failed when the head was built or first called."""
    from rlcore.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    register_plugin(plugin, "fused")
    with pytest.raises(ConfigError, match=match) as e:
        rlcore_config(*overrides)
    assert e.value.key == key


def test_fused_device_checks_apply_only_when_the_head_is_selected(register_plugin, rlcore_config, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    register_plugin(plugin, "fused")
    rlcore_config("fused.backend=triton", "engine.device=cpu")  # forward.name=reference: the section is unused
    rlcore_config("forward.name=fused", "fused.backend=torch", "engine.device=cpu")
    monkeypatch.setattr(plugin, "_triton_installed", lambda: False)
    monkeypatch.setattr(plugin, "_cuda_available", lambda: True)
    with pytest.raises(Exception, match=r"needs Triton, which is not installed"):
        rlcore_config("forward.name=fused", "engine.device=cuda")  # auto on CUDA: Triton
    # no CUDA here: the platform refuses engine.device=cuda at run time (the error to act on first)
    monkeypatch.setattr(plugin, "_cuda_available", lambda: False)
    rlcore_config("forward.name=fused", "engine.device=cuda")


def test_cli_check_refuses_a_fused_section_the_run_would_reject(capsys):
    from rlcore.testing.runs import main

    root = Path(__file__).resolve().parents[3]
    rc = main(["check", str(root / "examples" / "tiny.yaml"), "plugins=[fused]", "forward.name=fused",
               "fused.chunk_tokens=0"])
    assert rc == 2 and "fused.chunk_tokens" in capsys.readouterr().err
