"""Tests that need no vLLM: plugin registration, config, capability reporting, sampling and
server arguments, routed-expert decoding, shared-memory buckets. They run in the main venv and in
the vllm venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import rlcore_vllm.plugin as vllm_plugin
import torch
from rlcore.errors import ConfigError, IncompatiblePluginsError
from rlcore.sync import iter_buckets
from rlcore.testing.imports import modules_loaded_by
from rlcore.types import Cap, SamplingSettings
from rlcore_vllm.backend import VLLMBackend, sampling_kwargs
from rlcore_vllm.bucket_requests import bucket_request
from rlcore_vllm.engines import engine_environment, engine_kwargs, serve_command
from rlcore_vllm.platform import (
    CPU_LIMITS,
    DECLARED_BACKEND_CAPABILITIES,
    missing_reasons,
    runtime_backend_capabilities,
)
from rlcore_vllm.settings import VLLMSettings, check_settings
from rlcore_vllm.shm import SharedBucketPool, map_segment


def test_plugin_import_loads_neither_vllm_nor_torch():
    assert modules_loaded_by("import rlcore_vllm.plugin", ["vllm", "torch"]) == []


def test_registers_backend_sync_and_section(register_plugin, rlcore_plugin_manager):
    register_plugin(vllm_plugin, "vllm")
    spec = rlcore_plugin_manager.select("rollout_backend", "vllm", key="rollout.backend")
    sync = rlcore_plugin_manager.select("weight_sync", "vllm", key="sync.name")
    assert spec.capabilities == DECLARED_BACKEND_CAPABILITIES
    assert sync.backends == frozenset({"vllm"}) and Cap.VERIFIED in sync.capabilities
    assert "vllm" in {ps.section for ps in rlcore_plugin_manager.plugin_settings()}


def test_config_defaults_and_errors(register_plugin, rlcore_config, rlcore_plugin_manager):
    register_plugin(vllm_plugin, "vllm")
    cfg = rlcore_config("rollout.backend=vllm", "sync.name=vllm", "vllm.multiprocessing=false")
    assert cfg.vllm.mode == "offline" and cfg.vllm.multiprocessing is False
    check_settings(cfg.vllm)
    with pytest.raises(ConfigError, match="vllm.nonsense"):
        rlcore_config("vllm.nonsense=1")
    # value checks run when the config is validated (PluginSettings.validate), before anything is built
    with pytest.raises(ConfigError, match="vllm.mode.*offline, http"):
        rlcore_config("vllm.mode=grpc")
    with pytest.raises(ConfigError, match="vllm.transport"):
        rlcore_config("vllm.transport=rdma")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        rlcore_config("vllm.gpu_memory_utilization=0")


def test_sync_only_feeds_the_vllm_backend(register_plugin, rlcore_plugin_manager):
    from rlcore import config as cfgmod
    from rlcore.stack import resolve

    register_plugin(vllm_plugin, "vllm")
    raw = cfgmod.read_raw(None, ["rollout.backend=local", "sync.name=vllm"])
    cfg = cfgmod.validate(raw, rlcore_plugin_manager.plugin_settings())
    with pytest.raises(IncompatiblePluginsError, match="feeds only rollout backends vllm"):
        resolve(cfg, rlcore_plugin_manager)


def test_rlcore_check_reports_the_vllm_stack(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-m", "rlcore.cli", "check", "--json",
                          os.path.join(root, "examples", "vllm_tiny.yaml")], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    desc = json.loads(out.stdout)
    assert desc["rollout_backend"]["name"] == "vllm" and desc["rollout_backend"]["distribution"].startswith("rlcore-vllm")
    assert desc["weight_sync"]["name"] == "vllm"
    # declared capabilities; what the platform lacks is reported when the engine starts
    assert set(desc["rollout_backend"]["capabilities"]) == DECLARED_BACKEND_CAPABILITIES


def test_runtime_capabilities_by_platform():
    cpu = runtime_backend_capabilities(is_cpu=True, sleep_mode=True, routed_experts=True, speculative=False)
    gpu = runtime_backend_capabilities(is_cpu=False, sleep_mode=True, routed_experts=True, speculative=True,
                                       adapters=True)
    assert cpu == {Cap.LOGPROBS, Cap.PAUSE, Cap.PREFIX_CACHE_RESET, Cap.REPLICA, Cap.ANY_MTP_LAYOUT}
    assert gpu == DECLARED_BACKEND_CAPABILITIES
    assert cpu <= DECLARED_BACKEND_CAPABILITIES
    reasons = missing_reasons(cpu, is_cpu=True)
    for cap in (Cap.RELEASE_KV_CACHE, Cap.RELEASE_WEIGHTS, Cap.ROUTED_EXPERTS):
        assert reasons[cap] == CPU_LIMITS[cap]
    assert "speculative_config" in reasons[Cap.SPECULATIVE]
    assert "started without LoRA" in reasons[Cap.RECEIVE_ADAPTERS]
    off = runtime_backend_capabilities(is_cpu=False, sleep_mode=False, routed_experts=False, speculative=False)
    assert "enable_sleep_mode" in missing_reasons(off, is_cpu=False)[Cap.RELEASE_KV_CACHE]


def test_unstarted_backend_has_no_capabilities_and_refuses_calls():
    from rlcore.errors import RolloutError

    b = VLLMBackend(VLLMSettings())
    assert b.capabilities() == frozenset()
    with pytest.raises(RolloutError, match="start"):
        b.generate([], SamplingSettings())


def test_sampling_kwargs_map_rlcore_settings():
    sp = sampling_kwargs(SamplingSettings(n=4, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=5,
                                          stop_token_ids=(1, 2)), seed=11)
    assert sp == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 5, "seed": 11,
                  "stop_token_ids": [1, 2], "logprobs": 0}
    assert sampling_kwargs(SamplingSettings(top_k=20), seed=0)["top_k"] == 20
    assert sampling_kwargs(SamplingSettings(temperature=1e-6), seed=0)["temperature"] == 0.0  # vLLM: would be 0.01


def test_engine_kwargs_follow_the_platform():
    s = VLLMSettings(kv_cache_gib=0.5, engine_args={"max_num_seqs": 8})
    cpu = engine_kwargs(s, "/m", "float32", is_cpu=True, routed_experts=True, transport="shm")
    gpu = engine_kwargs(s, "/m", "bfloat16", is_cpu=False, routed_experts=True, transport="nccl")
    assert cpu["logprobs_mode"] == gpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["worker_extension_cls"] == "rlcore_vllm.worker_ext.RLCoreWorkerExtension"
    assert cpu["kv_cache_memory_bytes"] == 1 << 29 and cpu["max_num_seqs"] == 8
    assert "enable_sleep_mode" not in cpu and "enable_return_routed_experts" not in cpu
    assert "weight_transfer_config" not in cpu
    assert gpu["enable_sleep_mode"] and gpu["enable_return_routed_experts"]
    assert gpu["weight_transfer_config"] == {"backend": "nccl"}
    # unset enforce_eager: CUDA graphs on a GPU, eager on CPU; a value given wins on both
    assert cpu["enforce_eager"] is True and gpu["enforce_eager"] is False
    for forced in (True, False):
        for is_cpu in (True, False):
            kw = engine_kwargs(VLLMSettings(enforce_eager=forced), "/m", "float32", is_cpu=is_cpu,
                               routed_experts=False, transport="shm")
            assert kw["enforce_eager"] is forced


class _FlatColumns:
    """The column surface of vLLM's ``FlatLogprobs`` (``start_indices``, ``end_indices``,
    ``token_ids``, ``logprobs``), as rlcore_vllm.logprobs.sampled_logprobs reads it."""

    def __init__(self, positions):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []
        for entries in positions:
            self.start_indices.append(len(self.token_ids))
            for tok, lp in entries:
                self.token_ids.append(tok)
                self.logprobs.append(lp)
            self.end_indices.append(len(self.token_ids))


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


def test_sampled_logprobs_read_flat_columns_and_dicts_alike():
    from rlcore_vllm.logprobs import sampled_logprobs

    ids = [5, 7, 2]
    # vLLM's order: the sampled token first, then the top-k (which may hold it again)
    positions = [[(5, -0.5)], [(7, -1.25), (3, -0.25), (7, -1.25)], [(2, -3.0), (9, -0.1)]]
    as_dicts = [{t: _Logprob(lp) for t, lp in reversed(entries)} for entries in positions]
    assert sampled_logprobs(_FlatColumns(positions), ids) == [-0.5, -1.25, -3.0]
    assert sampled_logprobs(as_dicts, ids) == [-0.5, -1.25, -3.0]
    # a position where the sampled token is not first is searched; one without it raises as a dict does
    assert sampled_logprobs(_FlatColumns([[(3, -0.25), (7, -1.5)]]), [7]) == [-1.5]
    with pytest.raises(KeyError):
        sampled_logprobs(_FlatColumns([[(3, -0.25)]]), [7])
    with pytest.raises(KeyError):
        sampled_logprobs([{3: _Logprob(-0.25)}], [7])
    assert sampled_logprobs(None, ids) == [] and sampled_logprobs(_FlatColumns([]), []) == []


def test_engine_environment():
    env = engine_environment(VLLMSettings(multiprocessing=False), cpu_build=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "TORCH_COMPILE_DISABLE" in env
    assert "TORCH_COMPILE_DISABLE" not in engine_environment(VLLMSettings(), cpu_build=False)


def test_serve_command_uses_vllm_flags():
    kw = engine_kwargs(VLLMSettings(enable_prefix_caching=False), "/models/p", "float32", is_cpu=False,
                       routed_experts=False, transport="nccl")
    cmd = serve_command(kw, port=9000, python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/models/p"]
    joined = " ".join(cmd)
    assert "--port 9000" in joined and "--logprobs-mode processed_logprobs" in joined
    assert "--worker-extension-cls rlcore_vllm.worker_ext.RLCoreWorkerExtension" in joined
    assert "--no-enable-prefix-caching" in cmd and "--no-enforce-eager" in cmd  # a GPU: CUDA graphs by default
    eager = serve_command(engine_kwargs(VLLMSettings(), "/m", "float32", is_cpu=True, routed_experts=False,
                                        transport="shm"), port=9000, python="py")
    assert "--enforce-eager" in eager
    assert cmd[cmd.index("--weight-transfer-config") + 1] == json.dumps({"backend": "nccl"})


def test_launched_server_listens_on_loopback_by_default():
    settings = VLLMSettings(mode="http")
    kw = engine_kwargs(settings, "/models/p", "float32", is_cpu=True, routed_experts=False, transport="shm")
    cmd = serve_command(kw, port=settings.port, host=settings.host)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd.count("--host") == 1
    exposed = serve_command(kw, port=9000, host="0.0.0.0")
    assert exposed[exposed.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("override, message", [
    ("vllm.host=http://0.0.0.0", "vllm.host.*neither an IP address nor a host name"),
    ("vllm.host=127.0.0.1:8000", "vllm.host.*neither an IP address nor a host name"),
    ("vllm.host=''", "vllm.host.*expected an IP address or host name"),
    ("vllm.port=70000", "vllm.port.*1..65535"),
    ("vllm.engine_args.host=0.0.0.0", "engine_args sets 'host', which rlcore sets itself from vllm.host"),
    ("vllm.engine_args.port=9", "engine_args sets 'port'.*vllm.port"),
])
def test_server_address_settings_are_checked_at_config_time(register_plugin, rlcore_config, override, message):
    register_plugin(vllm_plugin, "vllm")
    assert rlcore_config("vllm.host=0.0.0.0").vllm.host == "0.0.0.0"
    with pytest.raises(ConfigError, match=message):
        rlcore_config(override)


def _reader(path, capacity, offset, nbytes, q):
    # another process maps the segment and reads the bytes in place
    t = map_segment(path, capacity)
    q.put(bytes(t[offset:offset + nbytes].numpy()))


def test_shared_buckets_are_readable_from_another_process():
    import multiprocessing as mp

    weights = [(f"w{i}", torch.randn(100 + i, 7)) for i in range(6)] + [("h", torch.randn(50).half())]
    pool = SharedBucketPool()
    try:
        buckets = []
        for b in iter_buckets(weights, 8 * 1024, device="cpu", allocator=pool.allocate):
            seg = pool.segment_of(b.buffer)
            req = bucket_request(b, seg.path, seg.capacity, verify=True)
            assert [t[0] for t in req["tensors"]] == b.names
            name, dtype, shape, offset, nbytes = req["tensors"][-1]
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_reader, args=(seg.path, seg.capacity, offset, nbytes, q))
            p.start()
            got = q.get(timeout=60)
            p.join(60)
            want = dict(weights)[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            assert got == want and dtype in ("float32", "float16") and shape == list(dict(weights)[name].shape)
            buckets.append(b.index)
            pool.release(b.buffer)
        assert len(buckets) > 2
        # recycled segments never make buckets larger than asked for
        assert len(buckets) == len(list(iter_buckets(weights, 8 * 1024)))
        # released segments are recycled: far fewer files than buckets
        assert len(pool.paths) < len(buckets)
    finally:
        paths = pool.paths
        pool.close()
    assert not any(os.path.exists(p) for p in paths)


def test_shared_pool_refuses_gpu_buckets():
    with pytest.raises(ValueError, match="device='cpu'"):
        SharedBucketPool().allocate(16, torch.device("meta"))


# ------------------------------------------------- vLLM engines as Ray rollout replicas -----

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")
RAY_REPLICAS = ["cluster.backend=ray", "cluster.rollout.replicas=2"]  # with plugins=[...,ray] (rlcore-ray)


def test_vllm_runs_as_replicas_and_what_is_refused():
    from rlcore.stack import load_stack
    from rlcore_vllm.settings import choose_transport, runs_as_replicas

    example = os.path.join(EXAMPLES, "vllm_tiny.yaml")
    cfg = load_stack(example, ["plugins=[vllm,ray]", *RAY_REPLICAS]).config
    assert runs_as_replicas(cfg) and cfg.rollout.seed_per_prompt is True
    assert choose_transport(cfg.vllm, cfg) == "shm"  # the fleet's path, whatever the device
    assert not runs_as_replicas(load_stack(example).config)
    for override, key, message in [("vllm.transport=nccl", "vllm.transport", "the 'shm' transport only"),
                                   ("vllm.mode=http", "vllm.mode", "servers as replicas are not built")]:
        with pytest.raises(ConfigError, match=message) as err:
            load_stack(example, ["plugins=[vllm,ray]", *RAY_REPLICAS, override])
        assert err.value.key == key
    with pytest.raises(ConfigError, match="draft's weight version is not carried") as err:
        load_stack(os.path.join(EXAMPLES, "vllm_tiny_mtp.yaml"), ["plugins=[mtp,vllm,ray]", *RAY_REPLICAS])
    assert err.value.key == "vllm.speculative"


def test_engine_in_a_ray_replica_uses_no_ray_executor():
    s = VLLMSettings()
    assert engine_kwargs(s, "/m", "float32", is_cpu=True, routed_experts=False, transport="shm",
                         ray_replica=True)["distributed_executor_backend"] == "uni"
    tp2 = engine_kwargs(VLLMSettings(tensor_parallel_size=2), "/m", "float32", is_cpu=False, routed_experts=False,
                        transport="shm", ray_replica=True)
    assert tp2["distributed_executor_backend"] == "mp"  # not "ray", which vLLM picks in a placement group
    assert "distributed_executor_backend" not in engine_kwargs(s, "/m", "float32", is_cpu=True, routed_experts=False,
                                                               transport="shm")
    assert engine_environment(s, cpu_build=True, ray_replica=True)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def _sleep_forever():
    import time

    time.sleep(3600)


def test_engine_core_watch_wakes_waiting_calls_when_the_process_dies():
    """A real process standing in for vLLM's engine core, and the two places a synchronous vLLM
    client waits (its output queue and its utility futures)."""
    import multiprocessing
    import queue
    import signal
    import time
    import types
    from concurrent.futures import Future

    from rlcore_vllm.liveness import EngineCoreWatch

    proc = multiprocessing.get_context("spawn").Process(target=_sleep_forever, name="EngineCore_DP0")
    proc.start()
    try:
        client = types.SimpleNamespace(outputs_queue=queue.Queue(), utility_results={1: Future()},
                                       resources=types.SimpleNamespace(
                                           engine_manager=types.SimpleNamespace(processes=[proc])))
        watch = EngineCoreWatch(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=client)))
        assert watch.dead is None
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        woken = client.outputs_queue.get(timeout=10)  # what LLM.generate waits on
        assert time.monotonic() - t0 < 10
        assert isinstance(woken, RuntimeError) and f"pid {proc.pid}) exited with code -9" in str(woken)
        with pytest.raises(RuntimeError, match="EngineCore_DP0"):
            client.utility_results[1].result(timeout=1)  # what collective_rpc waits on
        assert "exited with code -9" in watch.dead
        watch.stop()
    finally:
        proc.kill()
        proc.join()


def test_engine_core_watch_stop_is_no_death():
    import multiprocessing
    import types

    from rlcore_vllm.liveness import EngineCoreWatch

    proc = multiprocessing.get_context("spawn").Process(target=_sleep_forever)
    proc.start()
    client = types.SimpleNamespace(resources=types.SimpleNamespace(engine_manager=types.SimpleNamespace(
        processes=[proc])))
    watch = EngineCoreWatch(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=client)))
    watch.stop()  # a deliberate shutdown: the process ending afterwards is not reported
    proc.kill()
    proc.join()
    assert watch.dead is None
    assert EngineCoreWatch(types.SimpleNamespace()).processes == []  # in-process engine: nothing to watch


def test_tempered_logprobs_equal_the_softmax_at_that_temperature():
    """Behaviour log-probs recomputed at rollout.temperature from vLLM's temperature-1 top log-probs
    (rlcore_vllm.logprobs) lie within the stated bound of log_softmax(logits / T); with every
    token returned the bound is 0. float64, so the comparison is about the method, not rounding."""
    from rlcore_vllm.logprobs import needs_tempering, tempered_logprob

    gen = torch.Generator().manual_seed(0)
    vocab = 60
    for _ in range(20):
        logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * 3
        raw = torch.log_softmax(logits, -1)  # what vLLM returns at temperature 1 (raw, or greedy)
        top = torch.topk(raw, 20).indices.tolist()
        for temperature in (1e-6, 0.05, 0.7, 1.0, 2.0):
            want = torch.log_softmax(logits / temperature, -1)
            for chosen in (top[0], top[5], int(torch.argmin(raw))):
                entries = {t: float(raw[t]) for t in set(top) | {chosen}}
                value, bound = tempered_logprob(chosen, entries, temperature, vocab)
                eps = 1e-12 * max(1.0, abs(float(want[chosen])))  # float64 rounding (values reach -1e7 nats)
                # the tokens not returned only add to the normaliser: value - bound <= true <= value
                assert value - bound - eps <= float(want[chosen]) <= value + eps
                full, zero = tempered_logprob(chosen, {t: float(raw[t]) for t in range(vocab)}, temperature, vocab)
                assert zero == 0.0 and abs(full - float(want[chosen])) <= eps
            if temperature == 1e-6:  # greedy: the argmax's log-prob is 0, the bound negligible
                value, bound = tempered_logprob(top[0], {t: float(raw[t]) for t in top}, temperature, vocab)
                assert value == pytest.approx(0.0, abs=1e-12) and bound < 1e-12
    assert needs_tempering(1e-6, 0.0, raw_logprobs=False)  # sent greedy: vLLM returns temperature 1
    assert needs_tempering(0.7, 0.7, raw_logprobs=True) and not needs_tempering(0.7, 0.7, raw_logprobs=False)
    assert not needs_tempering(1.0, 1.0, raw_logprobs=True)


def test_lora_adapter_pushes_need_an_offline_engine_and_are_refused_by_name_elsewhere():
    """lora.push=adapter with a vLLM mode that cannot load adapters is refused at config time, naming
    the mode (core's rule on the backend's receive_adapters gap); auto then pushes merged weights."""
    import types

    from rlcore.errors import MissingCapabilityError
    from rlcore.stack import load_stack
    from rlcore_vllm.backend import build_backend

    example = os.path.join(EXAMPLES, "vllm_tiny.yaml")
    lora = ["lora.rank=8", "lora.push=adapter"]
    stack = load_stack(example, lora)  # offline: loads adapters
    assert Cap.RECEIVE_ADAPTERS not in stack.gaps["rollout_backend"]
    assert build_backend(types.SimpleNamespace(config=stack.config, settings=stack.config.vllm,
                                               output_dir=None)).lora.rank == 8
    for override, message in [("vllm.mode=http", "vllm.mode=http"), ("vllm.speculative=mtp", "speculative draft")]:
        with pytest.raises(MissingCapabilityError, match=f"receive_adapters.*lora.push='adapter'.*{message}"):
            load_stack(os.path.join(EXAMPLES, "vllm_tiny_mtp.yaml") if "mtp" in override else example,
                       [*lora, override] + (["plugins=[mtp,vllm]"] if "mtp" in override else []))
    with pytest.raises(MissingCapabilityError, match="Ray fleet carries full weights"):
        load_stack(example, ["plugins=[vllm,ray]", *RAY_REPLICAS, *lora])
    # auto where adapters cannot load: merged pushes, and a start directory with adapters is refused
    http = load_stack(example, ["lora.rank=8", "vllm.mode=http"]).config
    backend = build_backend(types.SimpleNamespace(config=http, settings=http.vllm, output_dir=None))
    assert backend.lora is None and "vllm.mode=http" in backend.adapter_refusal
    assert build_backend(types.SimpleNamespace(config=stack.config, settings=stack.config.vllm,
                                               output_dir=None)).adapter_refusal is None


def test_lora_engine_arguments_and_what_vllm_must_hold():
    from rlcore.sync import tensor_checksum
    from rlcore_vllm.adapters import AdapterStore, adapter_scaling, expected_checksums, max_lora_rank

    kw = engine_kwargs(VLLMSettings(), "/m", "float32", is_cpu=True, routed_experts=False, transport="shm",
                       lora_rank=8)
    assert {k: kw[k] for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras", "lora_dtype")} == \
        {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1, "lora_dtype": "auto"}
    assert engine_kwargs(VLLMSettings(), "/m", "bfloat16", is_cpu=False, routed_experts=False, transport="shm",
                         lora_rank=12)["lora_dtype"] == "bfloat16"
    assert "enable_lora" not in engine_kwargs(VLLMSettings(), "/m", "float32", is_cpu=True, routed_experts=False,
                                              transport="shm")
    assert [max_lora_rank(r) for r in (1, 2, 8, 12, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(Exception, match="up to rank 512"):
        max_lora_rank(600)
    assert adapter_scaling({"r": 8, "lora_alpha": 32}) == 4.0
    assert adapter_scaling({"r": 16, "lora_alpha": 8, "use_rslora": True}) == 2.0
    with pytest.raises(Exception, match="rank_pattern"):
        adapter_scaling({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}})
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    sums = expected_checksums({"x.lora_A.weight": a, "x.lora_B.weight": b}, 4.0)
    assert sums == {"x.lora_A.weight": tensor_checksum(a), "x.lora_B.weight": tensor_checksum(b * 4.0)}
    store = AdapterStore({"r": 8, "lora_alpha": 32})
    try:
        first = store.write(1, {"x.lora_A.weight": a})
        second = store.write(2, {"x.lora_A.weight": a})
        assert sorted(p.name for p in store.root.iterdir()) == ["v1", "v2"]  # no temporary left behind
        assert json.loads((first / "adapter_config.json").read_text()) == {"r": 8, "lora_alpha": 32}
        store.keep_only(second)
        assert [p.name for p in store.root.iterdir()] == ["v2"]
        if os.path.isdir("/dev/shm"):
            assert str(store.root).startswith("/dev/shm/")
    finally:
        store.close()
    assert not store.root.exists()
