"""The Triton kernels themselves, run on CPU by Triton's interpreter (small shapes).

Run by scripts/suites/fused-triton.sh (a venv with a CPU Triton, TRITON_INTERPRET=1). Skipped in
the main venv, which has no Triton. Checks the same conformance suite as the torch backend, both
operand paths (TMA descriptors and masked pointer loads), several vocab splits per program and
several backward chunks, and agreement with the torch backend on bf16 inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests run under TRITON_INTERPRET=1 (scripts/suites/fused-triton.sh)",
                allow_module_level=True)
pytest.importorskip("triton")

import rlcore_fused.plugin as plugin  # noqa: E402
from rlcore.testing.conformance import ForwardFnConformance, float64_head  # noqa: E402
from rlcore.types import HeadInput, VocabShard  # noqa: E402
from rlcore_fused.head import FusedHead  # noqa: E402
from rlcore_fused.tuning import TileConfig, TritonConfig  # noqa: E402

SPEC = next(iter(plugin.forward_fn()))
SMALL = TileConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)


def _config(use_tma, **kw):
    # 16-row tiles, one tile per forward program and ~16-row backward chunks: every loop and merge
    # in the kernels runs several times even at conformance-test sizes
    return TritonConfig(forward=SMALL, backward=SMALL, split_tiles=kw.pop("split_tiles", 1),
                        chunk_mib=kw.pop("chunk_mib", 16 * 40 * 4 / 2**20), use_tma=use_tma, **kw)


class TestTritonPointerLoadsInInterpreter(ForwardFnConformance):
    capabilities = SPEC.capabilities
    factory_path = "rlcore_fused.head:triton_head"

    @pytest.fixture
    def forward_fn(self):
        return FusedHead(backend="triton", triton_config=_config(False))


class TestTritonTensorDescriptorsInInterpreter(ForwardFnConformance):
    capabilities = SPEC.capabilities
    factory_path = "rlcore_fused.head:triton_tma_head"

    @pytest.fixture
    def forward_fn(self):
        return FusedHead(backend="triton", triton_config=_config(True))


def _inputs(seed, T=41, H=40, V=70, rows=80, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(rows, H, generator=g) * 0.4).to(dtype)
    weight[V:] = 3.0
    labels = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    temp = torch.rand(T, generator=g) + 0.5
    return hidden, weight, labels, mask, temp, V


def _run(head, hidden, weight, labels, mask, temp, V, g1, g2):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = head(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(V, rows=weight.shape[0]),
                         loss_mask=mask, temperature=temp))
    ((out.logprobs * g1).sum() + (out.entropy * g2).sum()).backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_bf16_matches_the_torch_backend(use_tma):
    # H=40 is not a multiple of the 16-wide K step: the last K block is masked / zero-filled
    hidden, weight, labels, mask, temp, V = _inputs(1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    g1, g2 = torch.randn(hidden.shape[0], generator=g), torch.randn(hidden.shape[0], generator=g)
    tri, tri_dh, tri_dw = _run(FusedHead(backend="triton", triton_config=_config(use_tma)),
                               hidden, weight, labels, mask, temp, V, g1, g2)
    ref, ref_dh, ref_dw = _run(FusedHead(backend="torch"), hidden, weight, labels, mask, temp, V, g1, g2)
    torch.testing.assert_close(tri.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(tri.entropy, ref.entropy, atol=1e-5, rtol=0)
    # the Triton backward rounds ∂L/∂logits to bf16 before the gradient GEMMs (as cuBLAS needs it)
    torch.testing.assert_close(tri_dh.float(), ref_dh.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tri_dw.float(), ref_dw.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(tri_dw[V:] == 0)


@pytest.mark.parametrize("split_tiles,chunk_mib", [(1, 1e-4), (3, 1e-3), (64, 64.0)],
                         ids=["tile-splits-many-chunks", "uneven-splits", "one-split-one-chunk"])
def test_split_and_chunk_sizes_do_not_change_results(split_tiles, chunk_mib):
    hidden, weight, labels, mask, temp, V = _inputs(3)
    g = torch.Generator().manual_seed(4)
    g1, g2 = torch.randn(hidden.shape[0], generator=g), torch.randn(hidden.shape[0], generator=g)
    head = FusedHead(backend="triton", triton_config=_config(False, split_tiles=split_tiles, chunk_mib=chunk_mib))
    out, dh, dw = _run(head, hidden, weight, labels, mask, temp, V, g1, g2)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = float64_head(h64, w64, labels, V, temp, mask)
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    torch.testing.assert_close(out.logprobs.double(), lp.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(out.entropy.double(), ent.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(dh.double(), h64.grad, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(dw.double(), w64.grad, atol=2e-4, rtol=1e-4)


def test_tma_with_unaligned_rows_is_an_error():
    hidden, weight, labels, mask, temp, V = _inputs(5, H=20, dtype=torch.bfloat16)  # 40-byte rows
    head = FusedHead(backend="triton", triton_config=_config(True))
    with pytest.raises(RuntimeError, match="16-byte aligned rows"):
        head(HeadInput(hidden=hidden, weight=weight, labels=labels, vocab=VocabShard.full(V, rows=weight.shape[0]),
                       loss_mask=mask))


def test_mixed_dtypes_are_an_error():
    hidden, weight, labels, mask, temp, V = _inputs(6)
    with pytest.raises(RuntimeError, match="same dtype"):
        FusedHead(backend="triton")(HeadInput(hidden=hidden.bfloat16(), weight=weight, labels=labels,
                                              vocab=VocabShard.full(V, rows=weight.shape[0]), loss_mask=mask))


# ------------------------------------------------------------------ fused loss (Cap.FUSED_LOSS) ------

def _fused_loss_cases():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fused_loss_cases", Path(__file__).with_name("test_fused_loss.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _fused_loss_cases()
OBJECTIVES, assert_paths_agree, make_case = _cases.OBJECTIVES, _cases.assert_paths_agree, _cases.make_case


@pytest.mark.parametrize("name", ["ppo-dual-clip", "ppo+entropy+kl-k3", "cispo+entropy+kl-k1"])
def test_fused_loss_kernels_match_reference_path(name):
    # 600-row vocab with 256-entry row-kernel steps: several steps and a ragged tail per row;
    # 11-token chunks (loss_chunk_mib) over 37 tokens: several chunks and the dW accumulation
    case = make_case(seed=11, vocab=600, rows=608, H=32)
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=11 * 608 * 4 / 2**20))
    assert_paths_agree(head, case, OBJECTIVES[name])


@pytest.mark.parametrize("pipeline", ["gemm", "gemm+dx"])
def test_fused_loss_other_pipelines_match_reference_path(pipeline):
    """The other chunk schedules (logits GEMM per half; dX GEMM per half too) compute the same."""
    case = make_case(seed=14, vocab=600, rows=608, H=32)
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=11 * 608 * 4 / 2**20,
                                                                  loss_pipeline=pipeline))
    assert_paths_agree(head, case, OBJECTIVES["ppo+entropy+kl-k3"])


@pytest.mark.parametrize("dw_fp32", [False, True])
def test_fused_loss_kernels_bf16_in_place(dw_fp32):
    """bf16: ∂L/∂logits is written over the fp32 logits in place (the aliased path); dW summed
    over the chunks in bf16 or in the optional fp32 buffer."""
    case = make_case(seed=12, vocab=600, rows=608, H=32, dtype=torch.bfloat16)
    head = FusedHead(backend="triton", triton_config=TritonConfig(loss_chunk_mib=11 * 608 * 4 / 2**20,
                                                                  loss_dw_fp32=dw_fp32))
    assert_paths_agree(head, case, OBJECTIVES["ppo+entropy+kl-k3"], rtol=1e-4, atol=1e-5, grad_rtol=2e-2)


def test_fused_loss_record_path_matches_in_kernel_finalisation(monkeypatch):
    """The tensor-parallel record path (record, exchange, merge) against the row kernel's own
    finalisation, over several chunks split in halves (identity exchange: see the GPU twin in
    test_fused_loss.py)."""
    case = make_case(seed=13, vocab=600, rows=608, H=32)
    _cases._record_path_agrees(case, OBJECTIVES["ppo+entropy+kl-k3"], "cpu", monkeypatch,
                               loss_chunk_mib=11 * 608 * 4 / 2**20)


def test_fused_loss_vocab_parallel_in_interpreter():
    """The Triton fused loss in two gloo processes (the record path with a real exchange)."""
    from rlcore_fused.tp_check import run_fused_loss_tp_check

    run_fused_loss_tp_check("triton", loss_chunk_mib=11 * 28 * 4 / 2**20)


def test_fused_loss_everything_masked():
    _cases.everything_masked_gives_zero(FusedHead(backend="triton"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_unless_one_kernel(dtype):
    """The fused loss's sync-free backward scaling: untouched (bitwise) for a gradient of 1,
    scaled in fp32 with one rounding otherwise, over a grid-stride loop with a ragged tail."""
    from rlcore_fused.triton_backend import TritonKernels

    kern = TritonKernels()
    t = torch.randn(3 * 4096 + 77, generator=torch.Generator().manual_seed(0)).to(dtype)
    same = kern.scale_in_place(t.clone(), torch.tensor(1.0))
    assert torch.equal(same, t)
    scaled = kern.scale_in_place(t.clone(), torch.tensor(-2.5))
    want = (t.float() * -2.5).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(scaled, want)
    else:  # the interpreter's fp32 → bf16 conversion truncates: within one bf16 ulp
        torch.testing.assert_close(scaled.float(), want.float(), rtol=2**-7, atol=0)
        assert not torch.equal(scaled, t)
