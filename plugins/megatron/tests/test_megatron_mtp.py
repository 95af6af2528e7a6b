"""MTP on the megatron engine, per megatron-core version (0.12.1 and 0.16.1 on CPU here; 0.19 on
the GPU machine through plugins/megatron/bench/gpu_mtp.py, which runs these same checks):

* megatron-core's own MTP loss is never added: rlcore's MTP loss is the only gradient the MTP
  layers get (spies on every place megatron computes or attaches its MTP loss, a walk of the
  autograd graph, and the gradient compared with the one of rlcore's loss alone); a control run
  of megatron's native path on the same version shows the test would see a second loss;
* ``detach_trunk`` / ``detach_head``: which parameters receive MTP gradients in each setting.
"""

from __future__ import annotations

import pytest
import torch
from rlcore.batch import PackedBatch

from rlcore_megatron.mtp_checks import (
    MegatronMTPSpies,
    autograd_node_names,
    mtp_gradient_owners,
    mtp_loss_exactly_once,
    native_mtp_loss_control,
)

pytestmark = pytest.mark.engine("megatron")

SEQS = [[3, 4, 5, 13, 6, 2, 9], [7, 7, 13, 4], [10, 9, 8, 7, 6, 13, 2]]


@pytest.fixture
def fresh(megatron_dirs):
    """A MegatronEngine of its own (gradients are written into it)."""
    from rlcore_megatron.engine import HFSource, MegatronEngine

    return lambda name: MegatronEngine(HFSource.from_dir(megatron_dirs[name]))


def test_graph_walk_and_spies_see_megatrons_mtp_loss_when_it_is_there():
    """The instruments the next tests rely on are live: an ``MTPLossAutoScaler`` applied by hand
    is seen by the spy and found in the autograd graph."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    x = torch.ones(3, requires_grad=True)
    with MegatronMTPSpies() as spies:
        y = MTPLossAutoScaler.apply(x * 2, (x ** 2).sum())
    assert spies.calls["MTPLossAutoScaler.forward"] == 1
    assert "MTPLossAutoScalerBackward" in autograd_node_names(y.sum())


def test_megatron_mtp_loss_is_added_exactly_once(fresh, figures):
    """rlcore's MTP loss is the only MTP loss in the graph, on this megatron-core version."""
    engine = fresh("moe_mtp")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    report = mtp_loss_exactly_once(engine, batch)
    assert report["megatron_calls"] == {}, report["megatron_calls"]
    assert not report["autoscaler_in_graph"]
    assert report["mtp_params_with_grad"] > 0 and report["max_abs_mtp_grad"] > 0
    # the MTP layers' gradient from the whole step == the gradient of rlcore's MTP loss alone
    assert report["max_abs_grad_diff_vs_rlcore_alone"] == 0.0
    figures("MTP loss terms in the graph (rlcore path)", "1 (rlcore's); megatron's loss code called 0 times")


def test_megatrons_native_mtp_path_would_add_a_second_loss(fresh, figures):
    """Control: megatron-core's native MTP loss path on this version (0.12/0.13: the block's
    forward with labels; 0.14+: ``GPTModel._postprocess``; 0.19: with ``labels=None``, which
    derives labels from ``input_ids``) attaches its loss to the main hidden states, and the MTP
    layers' gradient then differs from rlcore's loss alone — what the test above would catch."""
    engine = fresh("moe_mtp")
    control = native_mtp_loss_control(engine, [3, 4, 5, 13, 6, 2, 9, 8])
    assert control["autoscaler_in_graph"]
    assert control["megatron_calls"].get("MTPLossAutoScaler.forward", 0) >= 1
    assert control["max_abs_grad_diff_vs_rlcore_alone"] > 1e-6
    figures(f"native MTP path ({control['path']}) adds megatron's loss",
            f"max |grad diff| on MTP params {control['max_abs_grad_diff_vs_rlcore_alone']:.2e}")


@pytest.mark.parametrize("detach_trunk,detach_head", [(False, False), (True, False), (False, True), (True, True)])
def test_which_parameters_receive_mtp_gradients(fresh, figures, detach_trunk, detach_head):
    engine = fresh("moe_mtp")
    batch = PackedBatch.pack(SEQS, [1, 1, 2])
    owners, mtp_grads = mtp_gradient_owners(engine, batch, detach_trunk=detach_trunk, detach_head=detach_head)
    assert owners["mtp"], "the MTP layers get the MTP loss's gradient in every setting"
    assert bool(owners["trunk"]) is not detach_trunk, owners["trunk"][:3]
    assert bool(owners["embedding"]) is not detach_trunk
    assert bool(owners["head"]) is not detach_head
    # detaching prunes the graph only: the MTP layers' own gradient is the same in every setting
    engine.zero_grad()
    _, reference = mtp_gradient_owners(engine, batch, detach_trunk=False, detach_head=False)
    for name, g in mtp_grads.items():
        torch.testing.assert_close(g, reference[name], atol=0, rtol=0)
    figures(f"MTP gradients reach (detach_trunk={detach_trunk}, detach_head={detach_head})",
            ", ".join(f"{k}: {len(v)}" for k, v in owners.items()))


def test_native_mtp_loss_is_unreachable(fresh):
    """The GPTModel has no MTP of its own (its forward cannot add megatron's loss on any
    version), and the MTP block's forward — megatron's loss on 0.12/0.13 — refuses to run."""
    from rlcore.errors import RLCoreError
    from rlcore_megatron import compat

    engine = fresh("moe_mtp")
    assert not getattr(engine.model.config, "mtp_num_layers", None)
    assert not isinstance(getattr(engine.model, "mtp", None), torch.nn.Module)
    with pytest.raises(RLCoreError, match="megatron-core's own MTP loss"):
        engine.mtp(hidden_states=None)
    engine.model.config.mtp_num_layers = 1
    try:
        with pytest.raises(RLCoreError, match="would add megatron-core's own MTP loss"):
            compat.refuse_native_mtp_loss(engine.model, None)
    finally:
        engine.model.config.mtp_num_layers = None
