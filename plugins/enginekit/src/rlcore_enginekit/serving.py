"""Engine servers a rollout plugin starts or talks to: bind address, launch, health polling, and a
JSON-over-HTTP client. One implementation for every plugin that drives an engine over HTTP
(rlcore-vllm's OpenAI server, rlcore-sglang's ``launch_server``).

Standard library only: the trainer's environment needs no HTTP package, and importing this
module imports no engine.

**Bind address.** A server rlcore launches listens on :data:`LOOPBACK` unless the plugin's
``host`` setting says otherwise. Engine servers expose unauthenticated routes that replace the
model's weights, run RPCs in the workers and pause generation; bound to loopback they cannot be
reached from another host. Plugins validate their ``host`` setting with :func:`check_bind_host`
at config time.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, RolloutError

#: the address an engine server rlcore launches listens on unless configured otherwise
LOOPBACK = "127.0.0.1"
#: the longest refusal text quoted in an error
_DETAIL_CHARS = 2000
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class EngineServerError(RolloutError):
    """An engine server did not start, could not be reached, or refused a request.

    ``status`` is the HTTP status of a refusal (None when nothing answered); ``answer`` is the
    refusal's decoded body."""

    def __init__(self, message: str, status: int | None = None, answer: Any = None):
        super().__init__(message)
        self.status = status
        self.answer = answer


# ------------------------------------------------------------------------ bind address -----


def check_bind_host(host: Any, key: str) -> None:
    """Config-time check of a server's bind address; the error names ``key`` and what it takes.

    Accepted: an IPv4 or IPv6 address (``127.0.0.1``, ``0.0.0.0``, ``::1``) or a host name
    (``localhost``). Not a URL, not ``host:port``."""
    expected = ("an IP address or host name to listen on, e.g. 127.0.0.1 (loopback, the default) "
                "or 0.0.0.0 (every interface)")
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"bad value for config key '{key}': {host!r}; expected {expected}", key=key)
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not _HOSTNAME.match(host):
        raise ConfigError(f"bad value for config key '{key}': {host!r} is neither an IP address nor a host "
                          f"name (no scheme, port or path); expected {expected}", key=key)


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_url(bind_host: str, port: int) -> str:
    """The URL this machine reaches a server on ``bind_host:port`` at (a wildcard bind address is
    reached through loopback)."""
    host = {"0.0.0.0": LOOPBACK, "::": "::1"}.get(bind_host, bind_host)
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{int(port)}"


# ------------------------------------------------------------------------------ client -----


def answer_message(answer: Any) -> str:
    """The human part of a server's answer: its ``message`` / ``error`` / ``detail`` field when it
    has one (FastAPI and the engines' own error bodies), else the answer itself."""
    if isinstance(answer, Mapping):
        for key in ("message", "error", "detail"):
            if key in answer:
                value = answer[key]
                return str(value.get("message", value)) if isinstance(value, Mapping) else str(value)
    return str(answer)[:_DETAIL_CHARS]


def decode_answer(raw: bytes) -> Any:
    """A server's answer: its JSON, None when empty, ``{"message": text}`` when it is not JSON."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"message": raw.decode(errors="replace").strip()[:_DETAIL_CHARS]}


class JSONClient:
    """JSON requests to the engine server at ``base_url``.

    :param name: how errors name the server (``"vLLM server"``).
    :param api_key: sent as ``Authorization: Bearer``; None sends none.
    :param json_default: encoder for values ``json`` cannot write (e.g. bytes as base64).
    """

    def __init__(self, base_url: str, *, timeout: float, name: str, api_key: str | None = None,
                 json_default: Callable[[Any], Any] | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.name = name
        self.api_key = api_key
        self.json_default = json_default

    def describe(self) -> str:
        return f"{self.name} {self.base_url}"

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        """Send ``body`` as JSON (None: no body); the decoded answer, or :class:`EngineServerError`
        naming the route and the server's reason."""
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body, default=self.json_default).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            answer = decode_answer(exc.read())
            raise EngineServerError(f"{self.name} {method} {path} answered HTTP {exc.code}: {answer_message(answer)}",
                                    status=exc.code, answer=answer) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineServerError(f"{self.name} at {self.base_url} unreachable for {method} {path}: {reason} "
                                    f"(is the server running?)") from None
        return decode_answer(raw)

    def post(self, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> Any:
        return self.request("POST", path, body, query=query, timeout=timeout)

    def get(self, path: str, *, query: Mapping[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.request("GET", path, None, query=query, timeout=timeout)

    def healthy(self, path: str = "/health", timeout: float = 5.0) -> bool:
        """Whether the server answers ``GET path`` with a success status."""
        try:
            self.get(path, timeout=timeout)
            return True
        except EngineServerError:
            return False


# ------------------------------------------------------------------- launched servers -----


class ServerProcess:
    """An engine server this process launched, with its output in ``log_path`` (appended).

    The server runs in its own session, so :meth:`stop` reaches the worker processes it spawned
    and nothing else."""

    def __init__(self, cmd: Sequence[str], *, log_path: str | Path, name: str, env: Mapping[str, str] | None = None):
        self.cmd = [str(c) for c in cmd]
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ if env is None else env))

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(deque(fh, maxlen=lines))
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server's session, SIGKILL after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:  # it exited between poll() and killpg()
            proc.wait()


def launch_server(cmd: Sequence[str], client: JSONClient, *, log_path: str | Path, name: str, start_timeout: float,
                  timeout_setting: str, port_setting: str, env: Mapping[str, str] | None = None,
                  poll_s: float = 1.0, health_path: str = "/health") -> ServerProcess:
    """Launch ``cmd`` and wait until ``client`` finds it healthy.

    Refuses when something already answers at the client's address: the health poll would
    otherwise succeed against that foreign server while ours fails to bind. ``port_setting``
    names the config key that moves ours."""
    if client.healthy(health_path):
        raise EngineServerError(f"something already answers at {client.base_url}; set {port_setting} to launch "
                                f"rlcore's own {name} on a free port")
    server = ServerProcess(cmd, log_path=log_path, name=name, env=env)
    wait_healthy(client, start_timeout, timeout_setting=timeout_setting, server=server, poll_s=poll_s,
                 health_path=health_path)
    return server


def wait_healthy(client: JSONClient, timeout: float, *, timeout_setting: str, server: ServerProcess | None = None,
                 poll_s: float = 1.0, health_path: str = "/health") -> None:
    """Poll ``health_path`` until the server answers it.

    Raises :class:`EngineServerError` when ``timeout`` passes (naming ``timeout_setting``, the key
    that raises it) or when ``server``, a process we launched, exits first (with its log's last
    lines); a launched server is stopped before raising."""
    deadline = time.monotonic() + timeout
    while True:
        code = server.proc.poll() if server is not None and server.proc is not None else None
        if code is not None:
            server.stop()
            raise EngineServerError(f"the {server.name} exited with code {code} while starting "
                                    f"({' '.join(server.cmd)}); last lines of {server.log_path}:\n{server.log_tail()}")
        if client.healthy(health_path):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    where = f"; last lines of {server.log_path}:\n{server.log_tail()}" if server is not None else ""
    if server is not None:
        server.stop()
    raise EngineServerError(f"{client.describe()} was not healthy after {timeout:.0f} s ({timeout_setting}){where}")
