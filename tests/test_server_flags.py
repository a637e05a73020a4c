"""``llmserve serve``'s vLLM-style server flags on a real server: HTTPS (a self-signed
certificate made with ``openssl``), --enable-log-requests with --max-log-len, the periodic
stats line (its interval shortened through LLMSERVE_LOG_STATS_INTERVAL),
--disable-fastapi-docs, --root-path, and the tool-call flags vLLM's command lines carry."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import httpx
import pytest

from tests.server_process import SMALL_SERVER_ARGS, ServerProcess

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")

PROMPT = "The capital of France is"
KEY = "flag-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    flags = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    flags += ["--enable-log-requests", "--max-log-len", "5", "--disable-log-requests"]
    flags += ["--disable-fastapi-docs", "--root-path", "/llm", "--api-key", KEY]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    env = {"LLMSERVE_LOG_STATS_INTERVAL": "0.5"}
    server = ServerProcess(*SMALL_SERVER_ARGS, *flags, env=env)
    yield server
    server.close()


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, verify=False)


def test_https_requests_are_logged_and_stats_lines_follow(server):
    assert server.url.startswith("https://")
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the port
        httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
    logged = re.search(r"Received request (cmpl-\w+): prompt: '([^']*)'", server.logs())
    assert logged is not None and logged.group(2) == PROMPT[:5]  # cut to --max-log-len
    assert f"{logged.group(1)}: prompt: '{PROMPT[:5]}', prompt_token_ids: None" in server.logs()
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.logs() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = re.search(r"Avg prompt throughput: ([\d.]+) tokens/s.*Running: \d+ reqs", server.logs())
    assert line is not None and float(line.group(1)) > 0


def test_docs_are_off_and_the_root_path_is_announced(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10, verify=False).status_code == 404
    assert "/llm/v1" in server.logs()  # the URL it announces sits under the proxy's prefix
    body = {"prompt": PROMPT, "max_tokens": 1}
    assert post(server, "/v1/completions", body, key=None).status_code == 401  # still guarded
    for path in ("/ping", "/health"):  # open, as vLLM's; /ping takes POST too
        assert httpx.get(server.url + path, timeout=10, verify=False).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=10, verify=False).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    assert post(server, "/v1/chat/completions", body).status_code == 200  # tool_choice auto
