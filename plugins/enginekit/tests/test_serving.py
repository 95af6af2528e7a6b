"""rlcore_enginekit.serving against real servers: a tiny HTTP server in a thread for the client and the
health poll, and real child processes for launch, crash and stop."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rlcore.errors import ConfigError, RolloutError
from rlcore_enginekit.serving import (
    LOOPBACK,
    EngineServerError,
    JSONClient,
    ServerProcess,
    check_bind_host,
    is_loopback,
    launch_server,
    local_url,
    wait_healthy,
)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        state = self.server.state
        if self.path == "/health":
            state["health_calls"] += 1
            if time.monotonic() < state["healthy_at"]:
                return self._answer(503, b'{"detail": "starting"}')
            return self._answer(200, b"")
        if self.path == "/text":
            return self._answer(500, b"plain failure text", "text/plain")
        return self._answer(404, json.dumps({"error": {"message": f"no route {self.path}"}}).encode())

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.state["seen"].append((self.path, self.headers.get("Authorization"), body))
        if self.path.startswith("/refuse"):
            return self._answer(400, b'{"success": false, "message": "bad weights for layer 3"}')
        return self._answer(200, json.dumps({"path": self.path, "body": json.loads(body) if body else None}).encode())


@pytest.fixture
def http_server():
    server = ThreadingHTTPServer((LOOPBACK, 0), _Handler)
    server.state = {"healthy_at": 0.0, "seen": [], "health_calls": 0}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _client(server, **kw) -> JSONClient:
    return JSONClient(local_url(LOOPBACK, server.server_address[1]), timeout=10, name="test server", **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def test_client_sends_json_query_and_auth(http_server):
    client = _client(http_server, api_key="k1", json_default=lambda b: b.hex())
    got = client.post("/update", {"blob": b"\x01\x02"}, query={"tags": ["a", "b"]})
    assert got == {"path": "/update?tags=a&tags=b", "body": {"blob": "0102"}}
    assert http_server.state["seen"][-1][1] == "Bearer k1"
    assert client.post("/empty") == {"path": "/empty", "body": None}


def test_refusals_name_route_status_and_reason(http_server):
    client = _client(http_server)
    with pytest.raises(EngineServerError, match="POST /refuse answered HTTP 400: bad weights for layer 3") as err:
        client.post("/refuse", {})
    assert err.value.status == 400 and err.value.answer["success"] is False
    assert isinstance(err.value, RolloutError)
    with pytest.raises(EngineServerError, match="HTTP 404: no route /nowhere"):
        client.get("/nowhere")
    with pytest.raises(EngineServerError, match="HTTP 500: plain failure text"):
        client.get("/text")


def test_unreachable_server_is_a_clear_error():
    client = JSONClient(local_url(LOOPBACK, _free_port()), timeout=2, name="vLLM server")
    with pytest.raises(EngineServerError, match="vLLM server at http://127.0.0.1:.* unreachable for GET /health") as err:
        client.get("/health")
    assert err.value.status is None
    assert client.healthy() is False


def test_health_poll_waits_for_a_starting_server(http_server):
    healthy_at = http_server.state["healthy_at"] = time.monotonic() + 1.0
    wait_healthy(_client(http_server), 30, timeout_setting="x.start_timeout_s", poll_s=0.1)
    # it kept asking while the server answered 503, and returned once it answered 200
    assert time.monotonic() >= healthy_at and http_server.state["health_calls"] >= 2


def test_health_poll_times_out_naming_the_setting(http_server):
    http_server.state["healthy_at"] = time.monotonic() + 60
    with pytest.raises(EngineServerError, match=r"not healthy after 0 s \(vllm.start_timeout_s\)"):
        wait_healthy(_client(http_server), 0.3, timeout_setting="vllm.start_timeout_s", poll_s=0.1)


def test_launch_serve_and_stop_a_real_server(tmp_path):
    port = _free_port()
    client = JSONClient(local_url(LOOPBACK, port), timeout=5, name="test server")
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", LOOPBACK, "--directory", str(tmp_path)]
    (tmp_path / "health").write_text("ok")
    server = launch_server(cmd, client, log_path=tmp_path / "logs" / "server.log", name="test server",
                           start_timeout=30, timeout_setting="t.start_timeout_s", port_setting="t.port", poll_s=0.2)
    try:
        assert client.healthy()
        # the port is taken now: a second launch must not mistake this server for its own
        with pytest.raises(EngineServerError, match="something already answers at .*set t.port"):
            launch_server(cmd, client, log_path=tmp_path / "second.log", name="test server", start_timeout=5,
                          timeout_setting="t.start_timeout_s", port_setting="t.port")
    finally:
        proc = server.proc
        server.stop(grace=10)
    assert proc.poll() is not None and not client.healthy()
    assert "GET /health" in (tmp_path / "logs" / "server.log").read_text()
    server.stop()  # a second stop is harmless


def test_a_server_that_dies_while_starting_reports_its_log(tmp_path):
    client = JSONClient(local_url(LOOPBACK, _free_port()), timeout=2, name="test server")
    cmd = [sys.executable, "-c", "import sys; print('cannot load the model: out of memory'); sys.exit(3)"]
    with pytest.raises(EngineServerError, match="(?s)exited with code 3 while starting.*out of memory"):
        launch_server(cmd, client, log_path=tmp_path / "s.log", name="test server", start_timeout=30,
                      timeout_setting="t.start_timeout_s", port_setting="t.port", poll_s=0.1)


def test_a_server_that_never_gets_healthy_is_stopped(tmp_path):
    client = JSONClient(local_url(LOOPBACK, _free_port()), timeout=2, name="test server")
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"], log_path=tmp_path / "s.log",
                           name="test server")
    proc = server.proc
    with pytest.raises(EngineServerError, match=r"not healthy after 0 s \(t.start_timeout_s\)"):
        wait_healthy(client, 0.3, timeout_setting="t.start_timeout_s", server=server, poll_s=0.1)
    assert proc.poll() is not None and server.proc is None


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "::", "localhost", "node-3.cluster.local"])
def test_bind_hosts_accepted(host):
    check_bind_host(host, "x.host")


@pytest.mark.parametrize("host", ["", " ", None, 5, "http://127.0.0.1", "127.0.0.1:8000", "a b", "host/path"])
def test_bind_hosts_refused_naming_the_key(host):
    with pytest.raises(ConfigError, match="x.host.*expected an IP address or host name") as err:
        check_bind_host(host, "x.host")
    assert err.value.key == "x.host"


def test_loopback_and_local_urls():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("node-3")
    assert local_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert local_url("::", 80) == "http://[::1]:80"
    assert local_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"
