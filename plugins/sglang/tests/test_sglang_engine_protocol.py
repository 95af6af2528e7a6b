"""The protocol rlcore's backend and syncs speak, checked against SGLang's own HTTP layer.

The server here is a **stand-in** (sglang_standin_server.py): SGLang 0.5.23's real FastAPI app
and routes, which parse every request into SGLang's request structs, in front of a recording
stand-in for SGLang's TokenizerManager; no model runs. Weight payloads are received by SGLang's
own code in that separate process (SafeUnpickler, FlattenedTensorBucket, WeightUpdater, its
``init_custom_process_group`` with gloo standing in for NCCL). What the tests check is the
sequence rlcore sends (session → buckets with ``flush_cache=False`` → the last one flushing and
carrying the version → end), that every tensor arrives exactly, and how rlcore reacts to SGLang's
answers. They do not show SGLang's engine serving anything: it cannot run on these machines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.push import check_draft_version, push_weights
from rlcore.sync import Bucket, tensor_checksum
from rlcore.types import Cap, Prompt, SamplingSettings
from rlcore_sglang.backend import SGLangBackend
from rlcore_sglang.settings import SGLangSettings
from rlcore_sglang.sync import SGLangDiskSync, SGLangNCCLSync, SGLangTensorSync, free_port, layer_key
from safetensors.torch import save_file

pytestmark = pytest.mark.engine
HERE = Path(__file__).parent
LAYERS, TOPK = 2, 2


class StandIn:
    def __init__(self, port: int, proc: subprocess.Popen):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc

    def _post(self, route, body):
        req = urllib.request.Request(self.url + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def configure(self, **cfg):
        return self._post("/_standin/configure", cfg)

    def state(self):
        with urllib.request.urlopen(self.url + "/_standin/log", timeout=60) as r:
            return json.loads(r.read())

    def routes(self):
        return [e["route"] for e in self.state()["log"]]


@pytest.fixture(scope="module")
def standin(sglang, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("standin") / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(HERE / "sglang_standin_server.py"), str(port)],
                                stdout=fh, stderr=subprocess.STDOUT)
    server = StandIn(port, proc)
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(server.url + "/server_info", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the stand-in server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    yield server
    proc.terminate()
    proc.wait(30)


def _weights(seed: int, extra_layer: bool = False) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [("model.embed_tokens.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16))]
    for i in range(LAYERS + (1 if extra_layer else 0)):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", torch.randn(8, generator=g)),  # fp32 in a bf16 model
                (p + "self_attn.qkv_proj.weight", torch.randn(24, 8, generator=g).to(torch.bfloat16)),
                (p + "mlp.experts.0.w1.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
                (p + "mlp.gate.e_score_correction_bias", torch.randn(4, generator=g))]
    out.append(("lm_head.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)))
    return out


@pytest.fixture
def policy_dir(tmp_path):
    """An HF-format directory as the trainer writes it (config, tokenizer file, safetensors)."""
    d = tmp_path / "policy_hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS, "num_experts_per_tok": TOPK}))
    (d / "tokenizer_config.json").write_text("{}")
    save_file(dict(_weights(0)), str(d / "model.safetensors"))
    return d


def _settings(standin, **kw) -> SGLangSettings:
    return replace(SGLangSettings(url=standin.url, request_timeout_s=120.0), **kw)


def _started(standin, policy_dir, tmp_path, **kw) -> SGLangBackend:
    backend = SGLangBackend(_settings(standin, **kw), output_dir=str(tmp_path), request_routed_experts=True)
    backend.start(str(policy_dir), version=0)
    return backend


def _sent(weights):
    return {n: [str(t.dtype), list(t.shape), tensor_checksum(t)] for n, t in weights}


def _updates(state, route="/update_weights_from_tensor"):
    return [e for e in state["log"] if e["route"] == route]


# --------------------------------------------------------------------- the backend -------


def test_backend_start_generate_and_generation_control(standin, policy_dir, tmp_path):
    standin.configure(routed=[LAYERS, TOPK])
    backend = _started(standin, policy_dir, tmp_path)
    state = standin.state()
    load = state["log"][0]
    assert load["route"] == "/update_weights_from_disk"  # the initial policy, stamped as version 0
    assert load["fields"]["model_path"] == str(policy_dir) and load["fields"]["weight_version"] == "0"
    assert state["weights"] == _sent(_weights(0))
    assert {Cap.ROUTED_EXPERTS, Cap.RELEASE_KV_CACHE, Cap.PAUSE} <= backend.capabilities()

    prompts = [Prompt(ids=[3, 1, 2], index=0), Prompt(ids=[9, 4], index=1)]
    params = SamplingSettings(n=2, max_new_tokens=5, stop_token_ids=(13,), seed=7, return_routed_experts=True)
    samples = backend.generate(prompts, params)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    # the stand-in's rule: token k = (sum(prompt) + 7k) % 64 → [6, 13] stops at 13; [13, 20, ...] at once
    assert samples[0].response_ids.tolist() == [6, 13] and samples[0].finish_reason == "stop"
    assert samples[2].response_ids.tolist() == [13] and samples[2].finish_reason == "stop"
    assert torch.allclose(samples[0].logprobs, torch.tensor([-0.1, -0.2]))
    assert samples[0].weight_version == 0 and samples[0].routed_experts.dtype == torch.int16  # rlcore's route dtype
    assert samples[0].routed_experts.shape == (3 + 2 - 1, LAYERS, TOPK)  # prompt + response - 1 rows
    assert samples[2].routed_experts.shape == (2 + 1 - 1, LAYERS, TOPK)
    assert samples[0].routed_experts.reshape(-1).tolist() == [i % 8 for i in range(4 * LAYERS * TOPK)]
    request = _updates(standin.state(), "/generate")[-1]["fields_of_request"]
    assert request == {"return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 0,
                       "return_sampling_mask": None, "sampling_logprobs_mode": None, "stream": False}

    # top-p truncates the distribution: the behaviour log-probs come from SGLang's sampling-mask output
    truncated = backend.generate(prompts[:1], SamplingSettings(n=1, max_new_tokens=2, top_p=0.9))
    assert torch.allclose(truncated[0].logprobs, torch.tensor([-0.15, -0.25]))

    before = len(standin.state()["log"])
    backend.pause()
    with pytest.raises(RolloutError, match="paused"):
        backend.generate(prompts, params)
    backend.release_memory(frozenset({"kv_cache"}))
    backend.resume_memory(frozenset({"kv_cache"}))
    backend.reset_prefix_cache()
    backend.resume()
    events = standin.state()["log"][before:]
    assert [e["route"] for e in events] == ["/pause_generation", "/release_memory_occupation",
                                            "/resume_memory_occupation", "/flush_cache", "/continue_generation"]
    assert events[0]["fields"]["mode"] == "abort" and events[1]["fields"]["tags"] == ["kv_cache"]
    backend.shutdown()


def test_backend_reads_weight_version_spans(standin, policy_dir, tmp_path):
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path, load_policy_on_start=False)
    assert standin.routes() == ["/update_weight_version"]
    standin.configure(weight_version="span-test", reset=False)
    sample = backend.generate([Prompt(ids=[1], index=0)], SamplingSettings(n=1, max_new_tokens=3))[0]
    assert sample.weight_version == 5 and sample.weight_versions == ((4, 0), (5, 1))
    standin.configure(weight_version="someone-else", reset=False)
    with pytest.raises(RolloutError, match="'someone-else', which rlcore did not set"):
        backend.generate([Prompt(ids=[1], index=0)], SamplingSettings(n=1, max_new_tokens=1))


def test_old_server_refuses_top_p_instead_of_sending_a_field_it_lacks(standin, policy_dir, tmp_path):
    """SGLang 0.5.17's GenerateReqInput has no ``sampling_logprobs_mode`` (its sampling mask comes
    without log-probs): a truncated distribution is refused before any request, naming the version."""
    standin.configure(version="0.5.17")
    backend = _started(standin, policy_dir, tmp_path, load_policy_on_start=False)
    before = len(standin.state()["log"])
    with pytest.raises(RolloutError, match=r"SGLang 0\.5\.17 does not return.*0\.5\.23"):
        backend.generate([Prompt(ids=[1], index=0)], SamplingSettings(n=1, max_new_tokens=2, top_p=0.9))
    assert len(standin.state()["log"]) == before
    assert len(backend.generate([Prompt(ids=[1], index=0)], SamplingSettings(n=1, max_new_tokens=2))) == 1


def test_speculative_acceptance_per_position_and_the_drafts_weight_version(standin, policy_dir, tmp_path):
    """A server drafting with the policy's MTP layers (EAGLE, 2 draft positions): acceptance per
    position from the meta_info SGLang's own _calculate_spec_decoding_metrics writes, and the
    draft's weight version, which core checks after every push: a push that skips the draft
    (selector target) fails the run."""
    standin.configure(spec={"algorithm": "EAGLE", "num_draft_tokens": 3, "correct": [2, 0, 1]})
    settings = _settings(standin, speculative_algorithm="NEXTN")
    backend = SGLangBackend(settings, output_dir=str(tmp_path))
    backend.start(str(policy_dir), version=0)
    assert Cap.SPECULATIVE in backend.capabilities() and backend.draft_weight_version == 0

    backend.generate([Prompt(ids=[3, 1], index=0), Prompt(ids=[5], index=1)], SamplingSettings(n=2, max_new_tokens=8))
    # 8 tokens: 1 from prefill, then verify steps accepting 2, 0, 1 drafts (+1 bonus each) and a last bonus
    # token: histogram [2, 1, 1] over 4 steps, in each of the 4 samples
    metrics = backend.rollout_metrics()
    assert metrics["rollout/spec/acceptance_pos1"] == pytest.approx(2 / 4)
    assert metrics["rollout/spec/acceptance_pos2"] == pytest.approx(1 / 4)
    assert metrics["rollout/acceptance_d2"] == pytest.approx(1 / 2)
    assert metrics["rollout/accept_length"] == pytest.approx(8 / 4)
    assert metrics["rollout/spec/acceptance_rate"] == pytest.approx(3 / 8)
    assert metrics["rollout/spec/drafts"] == 16 and metrics["rollout/spec/draft_lag"] == 0

    _, pushed = push_weights(backend, SGLangTensorSync(settings, bucket_bytes=1 << 20), iter(_weights(1)), 1,
                             release_kv=True)
    assert pushed["rollout/draft_weight_version"] == 1 and backend.draft_weight_version == 1
    # every sglang sync that could miss the draft is refused before it pushes (settings, nccl at push
    # time); were one to land without reaching the draft, core's check after the push stops the run
    backend.set_weight_version(2, draft_updated=False)
    with pytest.raises(WeightSyncError, match="draft is at weight version 1 but the policy was pushed as version 2"):
        check_draft_version(backend, 2)
    backend.shutdown()

    # a separate draft checkpoint is not the policy: no push updates it, nothing to check
    standin.configure(spec={"algorithm": "EAGLE", "num_draft_tokens": 3, "correct": [1]})
    separate = SGLangBackend(_settings(standin, speculative_algorithm="EAGLE3", speculative_draft_model_path="/d"),
                             output_dir=str(tmp_path))
    separate.start(str(policy_dir), version=0)
    assert separate.draft_weight_version is None
    separate.shutdown()


# ------------------------------------------------------------------- sglang-tensor -------


def _no_second_read(*_args):
    raise AssertionError("a bucket was read again after its fill: its checksums come from the fill's copies")


def test_tensor_sync_sequence_and_exact_delivery(standin, policy_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(Bucket, "checksums", _no_second_read)
    standin.configure(tp_size=2)
    backend = _started(standin, policy_dir, tmp_path)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=600, verify=True)
    new = _weights(1)
    report = sync.push(iter(new), backend, version=1)
    state = standin.state()
    routes = [e["route"] for e in state["log"]][1:]  # after the initial disk load
    checker = [e["fields"]["action"] for e in state["log"] if e["route"] == "/weights_checker"]
    assert checker == ["snapshot", "reset_tensors", "compare", "checksum", "checksum"]
    # self-test: snapshot, reset, the startup checkpoint re-sent in a session, compare; then the push
    first_end = routes.index("/end_weight_update")
    assert routes[:3] == ["/weights_checker", "/weights_checker", "/begin_weight_update"]
    assert routes[first_end + 1:first_end + 4] == ["/weights_checker", "/weights_checker", "/begin_weight_update"]
    assert routes[-2:] == ["/end_weight_update", "/weights_checker"]
    updates = _updates(state)
    selftest, push = updates[:len(updates) // 2], updates[len(updates) // 2:]
    for phase, version in ((selftest, "0"), (push, "1")):
        assert len(phase) > 2, "several buckets, so the flush rule is visible"
        assert [u["fields"]["flush_cache"] for u in phase] == [False] * (len(phase) - 1) + [True]
        assert [u["fields"]["weight_version"] for u in phase] == [None] * (len(phase) - 1) + [version]
        assert all(u["payloads"] == 2 and u["fields"]["load_format"] == "flattened_bucket" for u in phase)
    received = {}
    for u in push:
        received.update(u["received"])
    assert received == _sent(new)  # through SGLang's deserializer, in another process
    assert state["weights"] == _sent(new) and state["weight_version"] == "1" and not state["session"]
    assert report.verified and report.checked == len(new) and report.num_tensors == len(new)
    assert report.num_buckets == len(push) and backend.weight_version == 1
    assert report.details["selftest"]["engine_tensors"] == len(new)

    # the same weights again: SGLang's checksum unchanged, and that is fine
    assert sync.push(iter(new), backend, version=2).verified and backend.weight_version == 2


def _updates_per_layer(state):
    """For every (layer, dtype): how many update requests carried its tensors."""
    where: dict[tuple[str, str], set[int]] = {}
    for i, u in enumerate(_updates(state)):
        for name, (dtype, _, _) in u["received"].items():
            where.setdefault((layer_key(name), dtype), set()).add(i)
    return {key: len(v) for key, v in where.items() if ".layers." in key[0]}


def test_old_server_gets_no_session_and_layer_buckets(standin, policy_dir, tmp_path):
    # 700-byte buckets split layer 0's bf16 tensors after the embedding unless layers are kept together
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    SGLangTensorSync(_settings(standin), bucket_bytes=700, verify=False).push(iter(_weights(2)), backend, 1)
    assert max(_updates_per_layer(standin.state()).values()) > 1  # 0.5.23: the session makes splits harmless

    standin.configure(version="0.5.20")
    # a server started from a model with one more layer (a push must carry what the server holds)
    deeper = tmp_path / "policy_deeper"
    deeper.mkdir()
    (deeper / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS + 1, "num_experts_per_tok": TOPK}))
    (deeper / "tokenizer_config.json").write_text("{}")
    save_file(dict(_weights(0, extra_layer=True)), str(deeper / "model.safetensors"))
    backend = _started(standin, deeper, tmp_path)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=700, verify=False)
    new = _weights(2, extra_layer=True)
    sync.push(iter(new), backend, version=1)
    state = standin.state()
    assert "/begin_weight_update" not in [e["route"] for e in state["log"]]
    assert set(_updates_per_layer(state).values()) == {1}  # keep_together=auto → layer without the session
    assert state["weights"] == _sent(new) and state["weight_version"] == "1"

    checked = SGLangTensorSync(_settings(standin, verify_skip=["k_scale"]), bucket_bytes=1 << 20, verify=True)
    before = len(state["log"])
    with pytest.raises(WeightSyncError, match="cannot skip tensors"):
        checked.push(iter(new), backend, version=2)
    assert standin.state()["log"][before:] == [], "nothing may be reset when the skip list cannot be honoured"


def test_failed_bucket_closes_the_session_and_says_the_versions_mix(standin, policy_dir, tmp_path):
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    standin.configure(fail_update=1, reset=False)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=600, verify=False)
    with pytest.raises(WeightSyncError, match="mix of versions 0 and 1") as info:
        sync.push(iter(_weights(3)), backend, version=1)
    assert info.value.receiver_version is None and backend.weight_version == 0
    state = standin.state()
    assert [e["route"] for e in state["log"]][-1] == "/end_weight_update" and not state["session"]
    standin.configure(fail_update=None, reset=False)
    sync.push(iter(_weights(3)), backend, version=1)  # the next push starts a fresh session
    assert standin.state()["weights"] == _sent(_weights(3)) and backend.weight_version == 1


def test_a_dropped_update_is_detected(standin, policy_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(Bucket, "checksums", _no_second_read)  # the fingerprint comes from the fills
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=1 << 20, verify=True)
    sync.push(iter(_weights(4)), backend, version=1)
    standin.configure(drop_updates=True, reset=False)
    with pytest.raises(WeightSyncError, match="did not take them"):
        sync.push(iter(_weights(5)), backend, version=2)


def test_selftest_names_engine_only_tensors_and_verify_skip_excludes_them(standin, policy_dir, tmp_path):
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    standin.configure(extra_weights={"model.layers.0.self_attn.attn.k_scale": [1]}, reset=False)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=1 << 20, verify=True)
    with pytest.raises(WeightSyncError, match="(?s)self-test failed.*k_scale.*restart it.*sglang.verify_skip"):
        sync.push(iter(_weights(6)), backend, version=1)

    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    standin.configure(extra_weights={"model.layers.0.self_attn.attn.k_scale": [1]}, reset=False)
    skip = SGLangTensorSync(_settings(standin, verify_skip=["k_scale"]), bucket_bytes=1 << 20, verify=True)
    report = skip.push(iter(_weights(6)), backend, version=1)
    assert report.verified and report.checked == len(_weights(6))
    checker = [e["fields"] for e in standin.state()["log"] if e["route"] == "/weights_checker"]
    assert all(f["skip_tensor_list"] == ["k_scale"] for f in checker)


# --------------------------------------------------------------------- sglang-nccl -------


def test_nccl_sync_through_sglangs_receiver_over_gloo(standin, policy_dir, tmp_path):
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    settings = _settings(standin, nccl_backend="gloo", nccl_group_name=f"rlcore-test-{free_port()}")
    sync = SGLangNCCLSync(settings, bucket_bytes=600, verify=True)
    new = _weights(7)
    try:
        report = sync.push(iter(new), backend, version=1)
        state = standin.state()
        init = next(e for e in state["log"] if e["route"] == "/init_weights_update_group")["fields"]
        assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
        updates = _updates(state, "/update_weights_from_distributed")
        push = updates[len(updates) // 2:]
        assert [u["fields"]["flush_cache"] for u in push] == [False] * (len(push) - 1) + [True]
        received = {}
        for u in push:
            received.update(u["received"])
        assert received == _sent(new) and state["weights"] == _sent(new)
        assert report.verified and backend.weight_version == 1 and state["weight_version"] == "1"
    finally:
        sync.close()
    assert standin.routes()[-1] == "/destroy_weights_update_group"


# --------------------------------------------------------------------- sglang-disk -------


def test_disk_sync_writes_a_loadable_version(standin, policy_dir, tmp_path):
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    sync = SGLangDiskSync(_settings(standin, disk_dir=str(tmp_path / "versions")), bucket_bytes=600, verify=True)
    new = _weights(8)
    report = sync.push(iter(new), backend, version=1)
    loads = _updates(standin.state(), "/update_weights_from_disk")
    last = loads[-1]
    assert last["fields"]["model_path"] == str((tmp_path / "versions" / "v1").resolve())
    assert last["fields"]["weight_version"] == "1" and len(last["files"]) == report.num_buckets > 1
    assert {"config.json", "tokenizer_config.json"} <= set(last["others"])
    assert standin.state()["weights"] == _sent(new) and report.verified and backend.weight_version == 1


def test_partial_push_and_wrong_shape_fail_although_sglangs_checksum_changes(standin, policy_dir, tmp_path):
    """On main a push without some tensors passed: SGLang's checksum changed, which was taken as
    verification. Now every push is checked against the checkpoint the server started from."""
    standin.configure()
    backend = _started(standin, policy_dir, tmp_path)
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=600, verify=True)
    full = _weights(6)
    gone = "model.layers.1.self_attn.qkv_proj.weight"
    with pytest.raises(WeightSyncError, match=rf"partial push.*{re.escape(gone)}"):
        sync.push(iter([(n, t) for n, t in full if n != gone]), backend, version=1)
    bad = [(n, torch.cat([t, t[:, :1]], 1) if n == gone else t) for n, t in full]
    with pytest.raises(WeightSyncError, match=rf"{re.escape(gone)}.*\(24, 9\).*\(24, 8\)"):
        sync.push(iter(bad), backend, version=2)
    assert gone not in {n for u in _updates(standin.state())[-1:] for n in u["received"]}, "refused before sending"
    report = sync.push(iter(full), backend, version=3)
    assert report.verified and report.details["level"] == "coverage" and backend.weight_version == 3


def test_release_for_training_frees_memory_after_each_rollout_and_the_push_brings_it_back(standin, policy_dir,
                                                                                           tmp_path):
    """sglang.release_for_training (the colocated GPU run): after a rollout the KV cache and the
    weights are released (once SGLang is idle: a successful cache flush), so the trainer has the
    memory while it trains; core's push then gets the weights back before the buckets (their
    contents are overwritten) and the KV cache after them. A second rollout with no push between
    refuses: without --enable-weights-cpu-backup SGLang did not keep the released weights."""
    from rlcore.push import push_weights

    standin.configure()
    backend = _started(standin, policy_dir, tmp_path, release_for_training=["kv_cache", "weights"])
    prompts, params = [Prompt(ids=[3, 1, 2], index=0)], SamplingSettings(n=1, max_new_tokens=3)
    before = len(standin.state()["log"])
    backend.generate(prompts, params)
    events = standin.state()["log"][before:]
    assert [e["route"] for e in events] == ["/generate", "/flush_cache", "/release_memory_occupation"]
    assert events[-1]["fields"]["tags"] == ["kv_cache", "weights"]
    assert backend.released_tags == {"kv_cache", "weights"}
    assert "rollout/training_release_seconds" in backend.rollout_metrics()

    before = len(standin.state()["log"])
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=1 << 20, verify=False)
    push_weights(backend, sync, iter(_weights(1)), 1, release_kv=True)
    events = standin.state()["log"][before:]
    routes = [e["route"] for e in events]
    assert routes[:3] == ["/pause_generation", "/resume_memory_occupation", "/begin_weight_update"]
    assert events[1]["fields"]["tags"] == ["weights"]  # the KV cache stays released during the push
    assert routes[-4:] == ["/end_weight_update", "/resume_memory_occupation", "/flush_cache", "/continue_generation"]
    assert events[-3]["fields"]["tags"] == ["kv_cache"]
    assert standin.state()["weights"] == _sent(_weights(1)) and backend.released_tags == frozenset()

    backend.generate(prompts, params)  # released again after this rollout
    with pytest.raises(RolloutError, match="enable-weights-cpu-backup"):
        backend.generate(prompts, params)
    backend.shutdown()


def test_release_for_training_without_core_releasing_the_kv_cache(standin, policy_dir, tmp_path):
    """rollout.release_kv_cache: never: core does not call release_memory before the push, so the
    sync itself brings the weights released for training back; the KV cache comes back with the
    next rollout."""
    from rlcore.push import push_weights

    standin.configure()
    backend = _started(standin, policy_dir, tmp_path, release_for_training=["kv_cache", "weights"])
    prompts, params = [Prompt(ids=[3, 1, 2], index=0)], SamplingSettings(n=1, max_new_tokens=3)
    backend.generate(prompts, params)
    before = len(standin.state()["log"])
    sync = SGLangTensorSync(_settings(standin), bucket_bytes=1 << 20, verify=False)
    push_weights(backend, sync, iter(_weights(2)), 1, release_kv=False)
    events = standin.state()["log"][before:]
    assert [e["route"] for e in events][:3] == ["/pause_generation", "/resume_memory_occupation",
                                                "/begin_weight_update"]
    assert events[1]["fields"]["tags"] == ["weights"]
    assert standin.state()["weights"] == _sent(_weights(2)) and backend.released_tags == {"kv_cache"}
    before = len(standin.state()["log"])
    assert backend.generate(prompts, params)[0].weight_version == 1
    events = standin.state()["log"][before:]
    assert [e["route"] for e in events][:2] == ["/resume_memory_occupation", "/generate"]
    assert events[0]["fields"]["tags"] == ["kv_cache"]
    backend.shutdown()
