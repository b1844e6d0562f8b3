"""examples/pd_proxy.py on bad input and dead engines (no vLLM needed): clear HTTP
errors, bounded bodies, and the proxy keeps serving. The happy path with real engines
is tests/connector/test_e2e_pd.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from pd_proxy import prefill_body  # noqa: E402


def _dead() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def proxy():
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "pd_proxy.py"),
            "--prefill",
            _dead(),
            "--decode",
            _dead(),
            "--port",
            "0",
            "--max-body",
            "1000",
            "--timeout",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # bounded: the proxy prints it before serving, or exits
    assert line.startswith("pd_proxy listening on "), line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(timeout=10)


def _post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback only
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_prefill_request_is_one_unstreamed_token_of_the_same_prompt():
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"x": 1},
        "n": 2,
        "temperature": 0,
        "max_completion_tokens": 50,
    }
    out = prefill_body(body)
    assert out == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "max_completion_tokens": 1,
    }
    assert body["max_tokens"] == 50  # the decode engine gets the request unchanged


def test_bad_requests_get_clear_errors_and_dead_engines_a_502(proxy):
    assert _post(proxy, "/v1/embeddings", b"{}")[0] == 404
    assert _post(proxy, "/v1/completions", b"not json")[0] == 400
    assert _post(proxy, "/v1/completions", b"[1, 2]")[0] == 400
    status, body = _post(proxy, "/v1/completions", b'{"prompt": "' + b"x" * 2000 + b'"}')
    assert status == 413 and "1000 bytes" in body["error"]
    status, body = _post(proxy, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 2}')
    assert status == 502 and "decode engine" in body["error"]  # prefill failing alone is not an error
    assert _post(proxy, "/v1/completions", b"{}")[0] == 502  # still serving
