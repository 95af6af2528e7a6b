"""Where the exact read-back (rlcore_vllm.readback.loaded_region) finds an expert's tensor in a
fused-MoE layer laid out as vLLM 0.26's and 0.32's ``RoutedExperts``: ``w13_weight`` ``[E, 2I, H]``
(gate rows first, then up), ``w2_weight`` ``[E, H, I]``, the tensor-parallel size on the layer's
``moe_config`` (the layer has no ``tp_size`` of its own), global expert ids mapped to local ones by
the layer. The arguments are the ones ``RoutedExperts.weight_loader`` is called with."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from rlcore_vllm.readback import loaded_region

EXPERTS, INTER, HIDDEN = 4, 6, 3


class _RoutedExperts(torch.nn.Module):
    def __init__(self, tp_size: int = 1, first_local_expert: int = 0):
        super().__init__()
        self.moe_config = SimpleNamespace(tp_size=tp_size)
        self.first = first_local_expert
        self.w13_weight = torch.nn.Parameter(torch.arange(EXPERTS * 2 * INTER // tp_size * HIDDEN, dtype=torch.float32)
                                             .view(EXPERTS, 2 * INTER // tp_size, HIDDEN))
        self.w2_weight = torch.nn.Parameter(torch.arange(EXPERTS * HIDDEN * INTER, dtype=torch.float32).view(EXPERTS, HIDDEN, INTER))

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        local = expert_id - self.first
        return local if 0 <= local < EXPERTS else -1


def _args(param, shard, expert, loaded):
    return {"param": param, "loaded_weight": loaded, "weight_name": f"experts.{param}", "shard_id": shard,
            "expert_id": expert, "return_success": True}


def test_each_expert_tensor_is_its_own_slice():
    layer = _RoutedExperts()
    w13, w2 = layer.w13_weight, layer.w2_weight
    for shard, expert, param, want in [("w1", 2, w13, w13.data[2, :INTER]), ("w3", 2, w13, w13.data[2, INTER:]),
                                       ("w2", 3, w2, w2.data[3])]:
        loaded = torch.empty_like(want)
        region, why = loaded_region(layer, param, _args(param, shard, expert, loaded), loaded)
        assert why == "" and region.data_ptr() == want.data_ptr() and region.shape == want.shape


def test_expert_parallel_ids_are_mapped_and_foreign_experts_not_claimed():
    layer = _RoutedExperts(first_local_expert=4)  # this worker holds experts 4..7
    loaded = torch.empty(HIDDEN, INTER)
    region, _ = loaded_region(layer, layer.w2_weight, _args(layer.w2_weight, "w2", 5, loaded), loaded)
    assert region.data_ptr() == layer.w2_weight.data[1].data_ptr()
    region, why = loaded_region(layer, layer.w2_weight, _args(layer.w2_weight, "w2", 1, loaded), loaded)
    assert region is None and "expert 1 is not held" in why


def test_a_tensor_parallel_shard_is_reported_as_such():
    layer = _RoutedExperts(tp_size=2)
    loaded = torch.empty(INTER, HIDDEN)
    region, why = loaded_region(layer, layer.w13_weight, _args(layer.w13_weight, "w1", 0, loaded), loaded)
    assert region is None and "tensor parallel size 2" in why
