"""The OpenAPI schema and the server agree: a bounded schemathesis run against the real server.

schemathesis (4.x) reads /openapi.json, generates valid and invalid requests for every operation
(the structured-output and tool fields included) and runs all its checks: no 5xx, responses
conform to the schema, schema-valid requests are accepted, schema-violating ones rejected,
documented content types (SSE streams, Prometheus text). Rules no JSON Schema can state are
listed in tests/schemathesis_hooks.py, which keeps generated bodies clear of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.schemathesis_hooks import MAX_MODEL_LEN
from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("schemathesis") is None and not (Path(sys.executable).parent / "schemathesis").exists(), reason="schemathesis is not installed")  # fmt: skip
def test_schema_and_server_agree(tmp_path):
    server = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "200000000")
    try:
        cli = Path(sys.executable).parent / "schemathesis"
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
            "PYTHONPATH": str(ROOT),
        }
        proc = subprocess.run(
            [str(cli), "run", f"{server.url}/openapi.json", "--checks", "all",
             "--phases", "examples,fuzzing", "--max-examples", "12", "--seed", "1",
             "--request-timeout", "60", "--max-response-time", "60", "--workers", "1",
             "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "14/14" in proc.stdout  # every operation was tested (/ping: GET and POST)
