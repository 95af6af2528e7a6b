"""rlcore_enginekit.routed_experts: every packing the engines use decodes to the same int16 routes, and
every malformed answer is a RolloutError saying what arrived and what was expected."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from rlcore.errors import RolloutError
from rlcore_enginekit.routed_experts import MoEShape, decode_routed_experts, moe_shape

ROWS, LAYERS, TOPK = 6, 2, 3


def _routes(dtype=np.int32, high=8):
    return np.random.default_rng(0).integers(0, high, size=(ROWS, LAYERS, TOPK)).astype(dtype)


def _npy_b64(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _int32_b64(arr) -> str:
    return base64.b64encode(arr.astype("<i4").tobytes()).decode()


def test_all_packings_decode_to_the_same_int16_routes():
    arr = _routes()
    want = torch.from_numpy(arr.astype(np.int16))
    shape = dict(rows=ROWS, layers=LAYERS, topk=TOPK, num_experts=8)
    for got in (
        decode_routed_experts(arr.astype(np.uint8), **shape),  # vLLM offline, <= 256 experts
        decode_routed_experts(torch.from_numpy(arr), **shape),
        decode_routed_experts(arr.tolist(), **shape),
        decode_routed_experts(_npy_b64(arr.astype(np.uint16)), packing="npy", **shape),  # vLLM server
        decode_routed_experts(_int32_b64(arr), packing="int32", **shape),  # SGLang
    ):
        assert got.dtype == torch.int16 and torch.equal(got, want)
    assert decode_routed_experts("", rows=0, layers=4, topk=2, packing="int32").shape == (0, 4, 2)


def test_minus_one_marks_tokens_without_a_route():
    arr = _routes()
    arr[0] = -1
    assert int(decode_routed_experts(arr, rows=ROWS, layers=LAYERS, topk=TOPK, num_experts=8)[0].max()) == -1


def test_wide_expert_ids_survive_when_no_expert_count_is_known():
    wide = (np.arange(ROWS * LAYERS * TOPK).reshape(ROWS, LAYERS, TOPK) + 300).astype(np.uint16)
    assert int(decode_routed_experts(_npy_b64(wide), rows=ROWS).max()) == 300 + ROWS * LAYERS * TOPK - 1


@pytest.mark.parametrize("value, kw, message", [
    (None, {}, "none were returned although they were asked for"),
    ("@@not base64@@", {"packing": "int32"}, "not valid base64"),
    (base64.b64encode(b"not an npy file").decode(), {}, "the base64 does not hold an .npy array .no .npy header"),
    (base64.b64encode(b"\x00" * 10).decode(), {"packing": "int32"}, "10 bytes are not a whole number of"),
    (_routes().astype(np.float32), {}, "dtype float32 .expected an integer dtype"),
    (_routes()[0], {"layers": LAYERS, "topk": TOPK}, r"shape \(2, 3\) .expected \[6, 2, 3\]"),
    (_routes()[:-1], {}, "5 rows .expected 6: every token of prompt \\+ response but the last"),
    (_routes(), {"layers": 4}, "2 layers .the model has 4"),
    (_routes(), {"topk": 2}, "top-k 3 .the model routes each token to 2 experts"),
    (_routes(high=8), {"num_experts": 4}, r"expert id [4-7] .expected ids in \[0, 4\)"),
    (np.full((ROWS, LAYERS, TOPK), -2, dtype=np.int32), {}, "expert id -2"),
    (np.full((ROWS, LAYERS, TOPK), 40000, dtype=np.int32), {}, r"expert id 40000 .expected ids in \[0, 32768\)"),
    ([[1, 2], [3]], {}, "not an array"),
])
def test_bad_answers_are_clear_rollout_errors(value, kw, message):
    args = {"rows": ROWS, "layers": LAYERS, "topk": TOPK, **kw} if kw.get("packing") == "int32" else {"rows": ROWS, **kw}
    with pytest.raises(RolloutError, match=f"routed experts from SGLang's answer for prompt 3: {message}"):
        decode_routed_experts(value, source="SGLang's answer for prompt 3", **args)


def test_int32_packing_needs_the_model_shape():
    with pytest.raises(ValueError, match="need positive layers and topk"):
        decode_routed_experts(_int32_b64(_routes()), rows=ROWS, packing="int32")


def test_moe_shape_reads_configs_of_both_families_and_dense_models():
    assert moe_shape({"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 8}) == MoEShape(4, 2, 8)
    assert moe_shape({"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_local_experts": 16}) == MoEShape(4, 2, 16)
    vl = {"text_config": {"num_hidden_layers": 3, "num_experts_per_tok": 1, "n_routed_experts": 64}}
    assert moe_shape(vl) == MoEShape(3, 1, 64)
    assert moe_shape({"num_hidden_layers": 4}) is None
    assert moe_shape({"num_hidden_layers": 4, "num_experts_per_tok": 2}) == MoEShape(4, 2, None)
