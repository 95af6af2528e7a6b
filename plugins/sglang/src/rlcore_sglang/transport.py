"""How rlcore reaches SGLang: over HTTP (a server it launched or one already running), or in
process through ``sglang.Engine``. Both carry the same request bodies (:mod:`.protocol`).

* :class:`HTTPTransport` POSTs JSON to SGLang's routes through core's client
  (:class:`rlcore_enginekit.serving.JSONClient`, standard library only); ``bytes`` values become base64.
* :class:`EngineTransport` builds SGLang's request struct from the same body and awaits the
  ``TokenizerManager`` coroutine that SGLang's own ``Engine`` methods and HTTP routes call, so
  fields the ``Engine`` convenience methods do not expose (``weight_version``, ``selector``,
  ``return_sampling_mask``) work in process too.
* :func:`server_command` is the ``python -m sglang.launch_server`` command line; core's
  :func:`rlcore_enginekit.serving.launch_server` starts it and polls its health.

Every failure to reach SGLang or a refusal is a :class:`rlcore_enginekit.serving.EngineServerError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rlcore_enginekit.serving import EngineServerError, JSONClient

from rlcore_sglang.protocol import REQUEST_STRUCTS, json_default
from rlcore_sglang.settings import OWNED_LAUNCH_FLAGS


class Transport(Protocol):
    def call(self, route: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any: ...

    def server_info(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


# -------------------------------------------------------------------------------- HTTP -----


class HTTPTransport:
    """JSON over HTTP to an SGLang server at ``base_url`` (``SGLANG_API_KEY`` as bearer token)."""

    def __init__(self, base_url: str, timeout: float = 1800.0, api_key: str | None = None):
        self.client = JSONClient(base_url, timeout=timeout, name="SGLang server", json_default=json_default,
                                 api_key=api_key if api_key is not None else os.environ.get("SGLANG_API_KEY"))

    @property
    def base_url(self) -> str:
        return self.client.base_url

    def describe(self) -> str:
        return self.client.describe()

    def call(self, route: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        return self.client.post(route, {} if body is None else body, timeout=timeout)

    def get(self, route: str, *, timeout: float | None = None) -> Any:
        return self.client.get(route, timeout=timeout)

    def server_info(self) -> dict[str, Any]:
        # /server_info since 0.5.16; /get_server_info is the deprecated spelling of older servers
        try:
            return self.get("/server_info", timeout=60)
        except EngineServerError as exc:
            if exc.status != 404:
                raise
        return self.get("/get_server_info", timeout=60)

    def healthy(self) -> bool:
        return self.client.healthy()

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------ Engine -----


#: route → (TokenizerManager coroutine, whether it also takes the HTTP request (None here), how its
#: return value maps to the JSON the HTTP route answers)
_ENGINE_ROUTES: dict[str, tuple[str, bool, str]] = {
    "/update_weights_from_tensor": ("update_weights_from_tensor", True, "ack"),
    "/update_weights_from_distributed": ("update_weights_from_distributed", True, "ack"),
    "/update_weights_from_disk": ("update_weights_from_disk", True, "ack"),
    "/init_weights_update_group": ("init_weights_update_group", True, "ack"),
    "/destroy_weights_update_group": ("destroy_weights_update_group", True, "ack"),
    "/begin_weight_update": ("begin_weight_update", True, "ack"),
    "/end_weight_update": ("end_weight_update", True, "ack"),
    "/update_weight_version": ("update_weight_version", False, "none"),
    "/pause_generation": ("pause_generation", False, "none"),
    "/continue_generation": ("continue_generation", False, "none"),
    "/release_memory_occupation": ("release_memory_occupation", True, "none"),
    "/resume_memory_occupation": ("resume_memory_occupation", True, "none"),
    "/weights_checker": ("check_weights", True, "checker"),
}


def engine_request(route: str, body: Mapping[str, Any]) -> Any:
    """SGLang's request struct for ``route`` built from ``body`` (imports SGLang)."""
    from sglang.srt.managers import io_struct

    name = REQUEST_STRUCTS.get(route)
    if name is None:
        raise EngineServerError(f"no in-process equivalent of SGLang route {route}")
    return getattr(io_struct, name)(**body)


def _normalise(kind: str, result: Any) -> Any:
    if kind == "ack":
        success, message = result[0], result[1]
        return {"success": bool(success), "message": str(message)}
    if kind == "checker":
        success, message, ranks, per_engine = result
        out: dict[str, Any] = {"success": bool(success), "message": str(message)}
        if ranks is not None:
            out["ranks"] = ranks
        if per_engine is not None:
            out["per_engine_checksum"] = per_engine
        return out
    return None


class EngineTransport:
    """``sglang.Engine`` in this process, started from the same CLI flags as a server."""

    def __init__(self, engine: Any):
        self.engine = engine

    @classmethod
    def launch(cls, cli_args: Sequence[str]) -> EngineTransport:
        import argparse

        import sglang
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(prog="rlcore-sglang engine")
        ServerArgs.add_cli_args(parser)
        server_args = ServerArgs.from_cli_args(parser.parse_args(list(cli_args)))
        return cls(sglang.Engine(server_args=server_args))

    def describe(self) -> str:
        return "in-process sglang.Engine"

    def call(self, route: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        tm = self.engine.tokenizer_manager
        obj = engine_request(route, dict(body or {}))
        if route == "/generate":
            # what Engine.generate does for a non-streaming request
            return self.engine.loop.run_until_complete(tm.generate_request(obj, None).__anext__())
        method, takes_request, kind = _ENGINE_ROUTES[route]
        coro = getattr(tm, method)(obj, None) if takes_request else getattr(tm, method)(obj)
        return _normalise(kind, self.engine.loop.run_until_complete(coro))

    def server_info(self) -> dict[str, Any]:
        return dict(self.engine.get_server_info())

    def close(self) -> None:
        self.engine.shutdown()


# -------------------------------------------------------------------- launched server -----


def server_cli_args(
    model_dir: str,
    *,
    host: str,
    port: int,
    weight_version: int,
    extra: Sequence[str] = (),
    memory_saver: bool = False,
    routed_experts: bool = False,
    speculative: Mapping[str, Any] | None = None,
) -> list[str]:
    """``sglang.launch_server`` flags; the tests parse them with SGLang's own ``ServerArgs``
    parser. ``extra`` (the user's ``launch_args``) comes last and may not repeat a flag the
    plugin sets."""
    clash = sorted(a for a in extra if a.split("=", 1)[0] in OWNED_LAUNCH_FLAGS)
    if clash:
        raise ValueError(
            f"sglang.launch_args sets {', '.join(clash)}, which rlcore sets itself "
            "(model path from the trainer, host/port from sglang.host/sglang.port)"
        )
    args = ["--model-path", str(model_dir), "--host", host, "--port", str(port), "--weight-version", str(weight_version)]
    if memory_saver and "--enable-memory-saver" not in extra:
        args.append("--enable-memory-saver")
    if routed_experts and "--enable-return-routed-experts" not in extra:
        args.append("--enable-return-routed-experts")
    for key, value in (speculative or {}).items():
        if value in (None, "", 0):
            continue
        flag = "--" + key.replace("_", "-")
        if flag in extra:
            raise ValueError(f"{flag} is set both in sglang.launch_args and as sglang.{key}; keep one")
        args += [flag, str(value)]
    return args + list(extra)


def server_command(python: str, cli_args: Sequence[str]) -> list[str]:
    """``python -m sglang.launch_server`` with ``cli_args`` (:func:`server_cli_args`); an empty
    ``python`` is this interpreter."""
    return [python or sys.executable, "-m", "sglang.launch_server", *cli_args]
