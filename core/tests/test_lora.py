"""LoRA on the hf engine (rlcore.lora, docs/lora.md): adapters trained over a frozen base, pushed alone
into the local rollout (or merged, for a backend without adapters), each push verified; the reference
is the base; checkpoints hold the adapters and resume exactly; exports hold the PEFT adapter and the
merged model; engines and backends without the capability are refused naming the key."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
import torch
from rlcore import PLUGIN_API, hookimpl
from rlcore.errors import ConfigError, MissingCapabilityError, WeightSyncError
from rlcore.push import push_weights
from rlcore.rollout_local import LocalRollout
from rlcore.stack import load_config, load_stack, resolve
from rlcore.testing.runs import Trainer, load_checkpoint, main, read_metrics
from rlcore.types import Cap, EngineSpec, RolloutBackendSpec
from rlcore.weight_sync import InprocSync

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml")
QUIET = ["output.plot=false", "output.progress=false", "output.tensorboard=false"]
LORA = ["lora.rank=8", "lora.alpha=32"]
SMALL = ["data.prompts_per_step=4", "rollout.n=4"]


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(load_stack(TINY, [*LORA, *QUIET, f"output.dir={tmp_path}", *overrides]))


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_a_lora_run_learns_on_the_embedded_default(tmp_path):
    """~15 s: the successor task from chance level with rank-8 adapters (base, embeddings and head
    frozen); 0.10 -> 0.99 in 120 steps at lr 2e-3 on this machine (full fine-tuning: 0.12 -> 0.81 in 60)."""
    assert main(["train", TINY, "--output", str(tmp_path), *LORA, *QUIET, "training.lr=0.002", "training.steps=100",
                 "output.checkpoint_every=0"]) == 0
    rows = read_metrics(tmp_path)
    start, end = _mean(r["reward_mean"] for r in rows[:5]), _mean(r["reward_mean"] for r in rows[-8:])
    print(f"lora reward {start:.3f} (first 5 steps) -> {end:.3f} (last 8)")
    assert start < 0.2 and end > start + 0.3


def test_adapter_pushes_carry_the_adapters_only_verified(tmp_path):
    t = _trainer(tmp_path, "training.steps=3", "output.checkpoint_every=0", *SMALL)
    t.run()
    engine, backend = t.engine, t.backend
    adapter = dict(engine.export_adapter())
    full = sum(v.numel() * v.element_size() for _, v in engine.export_hf_weights())
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter.values())
    rows = read_metrics(tmp_path)
    assert [r["sync_level"] for r in rows] == ["coverage+exact"] * 3
    assert {r["sync_bytes"] for r in rows} == {adapter_bytes} and adapter_bytes * 5 < full  # 131 kB of 1.2 MB here
    # only the adapters train: the base the rollout loaded is the engine's base, the adapters equal
    assert all(n.startswith("base_model.model.") and (".lora_A." in n or ".lora_B." in n) for n in adapter)
    assert backend.adapters is not None and backend.weight_version == 3
    for name, held in backend.adapters.tensors():
        assert torch.equal(held, adapter[name]), name
    assert any(bool(v.abs().sum()) for n, v in adapter.items() if ".lora_B." in n), "lora_B moved from 0"
    trainable = {id(p) for p in engine.model.parameters() if p.requires_grad}
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert optimized == trainable == {id(p) for _, p in engine.adapters.tensors()}


def test_merged_pushes_send_full_weights_equal_to_base_plus_adapters(tmp_path):
    t = _trainer(tmp_path / "run", "lora.push=merged", "training.steps=2", "output.checkpoint_every=0", *SMALL)
    t.run()
    assert t.backend.adapters is None and not t.push_adapter
    full = sum(v.numel() * v.element_size() for _, v in t.engine.export_hf_weights())
    assert [(r["sync_level"], r["sync_bytes"]) for r in read_metrics(tmp_path / "run")] == [("coverage+exact", full)] * 2
    # into a rollout started from the merged model: what it holds after a push is base + adapters
    engine = _trainer(tmp_path / "built", "lora.push=merged", "training.steps=1").engine
    with torch.no_grad():
        for _, p in engine.adapters.tensors():
            p.normal_(0.0, 0.05)
    engine.save_merged(tmp_path / "merged")
    backend = LocalRollout()
    backend.start(str(tmp_path / "merged"), version=0)
    merged = dict(engine.export_hf_weights())
    report, _ = push_weights(backend, InprocSync(1 << 20), iter(merged.items()), 1, release_kv=False)
    assert report.details["level"] == "coverage+exact" and report.bytes == full
    assert set(backend._views) == set(merged)
    for name, v in merged.items():
        assert torch.equal(backend._views[name], v), name
    # the merged weight of an adapted layer is W + scaling * B @ A of the engine's own tensors
    layer = engine.adapters._layers["model.layers.0.self_attn.q_proj"]
    want = layer.base_layer.weight + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 4.0
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], want, rtol=1e-6, atol=1e-6)


def test_the_reference_is_the_base_without_a_second_copy(tmp_path):
    t = _trainer(tmp_path, "algorithm.kl_coef=0.1", "training.steps=3", "output.checkpoint_every=0",
                 "training.lr=0.01", *SMALL)
    t.run()
    ref = t.reference
    assert ref.policy is t.engine and list(ref.parameters()) == []
    base = Trainer(load_stack(TINY, [*QUIET, f"output.dir={tmp_path / 'base'}", "training.steps=1"])).engine
    batch = _batch(t.engine)
    with torch.no_grad():
        h_ref = ref.forward(batch).hidden
        h_base = base.forward(batch).hidden
        h_policy = t.engine.forward(batch).hidden
    torch.testing.assert_close(h_ref, h_base, rtol=0, atol=1e-6)  # same weights, same ops in this process
    assert not torch.allclose(h_policy, h_base, atol=1e-4), "the trained adapters change the policy"
    assert all(r["kl"] > 0 for r in read_metrics(tmp_path)[1:])


def _batch(engine):
    from rlcore.batch import PackedBatch

    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 3, 4])]
    return PackedBatch.pack(seqs, [2, 1], pad_id=engine.info.pad_token_id)


def test_a_resumed_lora_run_equals_the_uninterrupted_one(tmp_path):
    common = [*LORA, *QUIET, *SMALL, "output.checkpoint_every=2", "training.lr=0.01"]
    assert main(["train", TINY, "--output", str(tmp_path / "full"), "training.steps=4", *common]) == 0
    cut = tmp_path / "cut"
    assert main(["train", TINY, "--output", str(cut), "training.steps=2", *common]) == 0
    assert main(["train", TINY, "--output", str(cut), "--resume", "training.steps=4", *common]) == 0
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(cut)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "sync_bytes"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} != {b[key]}"
    a = load_checkpoint(tmp_path / "full")[0]["engine"]
    b = load_checkpoint(cut)[0]["engine"]
    assert "model" not in a and a["lora"] == {"rank": 8, "alpha": 32.0, "target_modules": sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
    assert a["adapter"].keys() == b["adapter"].keys()
    for k in a["adapter"]:
        assert torch.equal(a["adapter"][k], b["adapter"][k]), k
    # a full fine-tuning run does not resume from adapters
    code = main(["train", TINY, "--output", str(cut), "--resume", "training.steps=5", *QUIET, *SMALL,
                 "output.checkpoint_every=2", "training.lr=0.01", "--allow-config-change"])
    assert code != 0


def test_exports_hold_the_peft_adapter_and_the_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert main(["train", TINY, "--output", str(tmp_path), *LORA, *QUIET, *SMALL, "training.steps=2",
                 "training.lr=0.01", "output.checkpoint_every=0", "lora.export_merged=true"]) == 0
    model = tmp_path / "model"
    assert (model / "adapter" / "adapter_config.json").exists() and (model / "merged" / "config.json").exists()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model)
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, model / "adapter")(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(model / "merged")(ids).logits
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_logits, merged_logits, atol=1e-4)


def _rollout(tmp_path: Path) -> tuple[Trainer, LocalRollout]:
    t = _trainer(tmp_path, "training.steps=1")
    t.engine.save_hf(tmp_path / "policy")
    backend = LocalRollout(lora=t.cfg.lora)
    backend.start(str(tmp_path / "policy"), version=0)
    return t, backend


def test_stale_partial_and_full_weight_pushes_into_an_adapter_rollout_are_refused(tmp_path):
    t, backend = _rollout(tmp_path)
    sync = InprocSync(1 << 20)
    adapter = list(t.engine.export_adapter())
    report, _ = push_weights(backend, sync, iter(adapter), 1, release_kv=False)
    assert report.details["level"] == "coverage+exact" and backend.weight_version == 1
    with pytest.raises(WeightSyncError, match="partial push of version 2"):
        push_weights(backend, sync, iter(adapter[:-1]), 2, release_kv=False)
    with pytest.raises(WeightSyncError, match="holds no tensor of that name"):
        push_weights(backend, sync, t.engine.export_hf_weights(), 2, release_kv=False)
    assert backend.weight_version == 1

    class KeepsOldAdapter(LocalRollout):  # takes the push but keeps serving the version before
        def commit_update(self, version: int) -> None:
            super().commit_update(version)
            self._version = version - 1

    stale = KeepsOldAdapter(lora=t.cfg.lora)
    stale.start(str(tmp_path / "policy"), version=1)
    with pytest.raises(WeightSyncError, match="reports weight version 1, expected 2"):
        push_weights(stale, sync, iter(adapter), 2, release_kv=False)


def test_an_adapter_push_into_a_rollout_holding_other_adapters_is_refused(tmp_path):
    t, _ = _rollout(tmp_path)
    other = LocalRollout(lora=types.SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"]))
    with pytest.raises(WeightSyncError, match="does not fit this model's LoRA layers"):  # the saved adapter
        other.start(str(tmp_path / "policy"), version=0)
    shutil.rmtree(tmp_path / "policy" / "adapter")
    other.start(str(tmp_path / "policy"), version=0)
    with pytest.raises(WeightSyncError, match=r"received shape \(8, 128\), the local rollout holds \(4, 128\).*stays on"):
        push_weights(other, InprocSync(1 << 20), t.engine.export_adapter(), 1, release_kv=False)


def _register(pm, name: str, hook: str, spec: object) -> None:
    mod = types.ModuleType(name)
    mod.PLUGIN_API = PLUGIN_API

    def provide():
        yield spec

    setattr(mod, hook, hookimpl(provide))
    pm.register(mod, name)


def test_an_engine_without_lora_is_refused_naming_the_key(rlcore_plugin_manager):
    _register(rlcore_plugin_manager, "nolora", "engine",
              EngineSpec(name="nolora", factory=lambda ctx: None, capabilities={Cap.MOE}))
    cfg, pm = load_config(TINY, ["engine.name=nolora", "lora.rank=8"], plugins=rlcore_plugin_manager)
    with pytest.raises(MissingCapabilityError, match="capability 'lora'.*engine 'nolora'") as err:
        resolve(cfg, pm)
    assert "lora.rank=8" in str(err.value)
    cfg, pm = load_config(TINY, ["engine.name=nolora"], plugins=rlcore_plugin_manager)
    resolve(cfg, pm)  # full fine-tuning needs no LoRA


def test_an_adapter_push_needs_a_backend_that_loads_adapters(rlcore_plugin_manager):
    _register(rlcore_plugin_manager, "fullonly", "rollout_backend",
              RolloutBackendSpec(name="fullonly", factory=lambda ctx: None,
                                 capabilities={Cap.LOGPROBS, Cap.RECEIVE_BUCKETS, Cap.WEIGHT_CHECKSUMS}))
    over = ["rollout.backend=fullonly", "lora.rank=8"]
    cfg, pm = load_config(TINY, [*over, "lora.push=adapter"], plugins=rlcore_plugin_manager)
    with pytest.raises(MissingCapabilityError, match="receive_adapters.*lora.push=merged"):
        resolve(cfg, pm)
    for push in ("auto", "merged"):  # auto: merged full weights into a backend without adapters
        cfg, pm = load_config(TINY, [*over, f"lora.push={push}"], plugins=rlcore_plugin_manager)
        resolve(cfg, pm)


@pytest.mark.parametrize(("override", "key"), [
    ("lora.rank=-1", "lora.rank"), ("lora.alpha=0", "lora.alpha"), ("lora.dropout=1.0", "lora.dropout"),
    ("lora.push=all", "lora.push"), ("lora.target_modules=[]", "lora.target_modules"),
    ("lora.target_modules=[model.q_proj]", "lora.target_modules"),
])
def test_bad_lora_settings_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_stack(TINY, ["lora.rank=8", override])
    assert key in str(err.value)


def test_targets_the_model_lacks_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="lora.target_modules.*no linear layer"):
        _trainer(tmp_path, "lora.target_modules=[c_attn]")


def test_a_lora_engine_does_not_offer_its_own_parameters_for_lending():
    """Merged weights are computed per push: a sync that lends the exported storages (vLLM's
    ``mapped`` transport, rlcore-ray's ``mapped``) must not take them as the engine's parameters."""
    assert load_stack(TINY, []).has("engine", Cap.EXPORTS_OWN_PARAMETERS)
    assert not load_stack(TINY, ["lora.rank=8"]).has("engine", Cap.EXPORTS_OWN_PARAMETERS)
