#!/usr/bin/env python3
"""Prefill/decode split through lmcache-core: a small OpenAI-compatible proxy.

Each completion request goes first to the prefill engine (``kv_role: kv_producer``)
with ``max_tokens: 1``: it computes the prompt's KV, which the connector saves into
the shared tier; then the unchanged request goes to the decode engine
(``kv_role: kv_consumer``), whose connector loads that KV instead of computing it,
and its answer (streamed or not) is returned to the client.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

If the prefill engine fails or times out, the request still goes to the decode
engine, which then computes the prompt itself (slower, same output). Standard
library only; loopback or a trusted network (it adds no authentication of its own:
run it where the engines' own ``--api-key`` would be, and it forwards
``Authorization``). Request bodies are limited to ``--max-body`` bytes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED = ("Authorization", "Content-Type")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill engine: the same prompt and sampling, one token,
    not streamed."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("n", None)
    return out


def _connect(base: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(base)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {base!r}")
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


class Proxy(BaseHTTPRequestHandler):
    server_version = "lmcache-pd-proxy/1"
    prefill: str
    decode: str
    timeout: float
    max_body: int

    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s " + fmt, self.address_string(), *args)

    def _headers(self) -> dict[str, str]:
        return {h: self.headers[h] for h in FORWARDED if self.headers.get(h)}

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # /v1/models, /health: the decode engine answers
        self._relay("GET", self.path, None)

    def do_POST(self) -> None:
        if self.path not in ROUTES:
            self._reply(404, {"error": f"only {', '.join(ROUTES)}"})
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if n < 0 or n > self.max_body:
            if n > 0:
                self.rfile.read(min(n, 1 << 20))  # bounded drain: the client then reads our answer
            self._reply(413 if n > 0 else 400, {"error": f"a JSON body of at most {self.max_body} bytes is required"})
            return
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            self._reply(400, {"error": f"bad JSON body: {err}"})
            return
        self._prefill(body)
        self._relay("POST", self.path, raw)

    def _prefill(self, body: dict[str, Any]) -> None:
        try:
            conn, base = _connect(self.prefill, self.timeout)
            try:
                conn.request("POST", base + self.path, json.dumps(prefill_body(body)).encode(), self._headers())
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    log.warning("prefill engine answered %d: the decode engine computes the prompt", resp.status)
            finally:
                conn.close()
        except (OSError, http.client.HTTPException, ValueError) as err:
            log.warning("prefill engine unreachable (%s): the decode engine computes the prompt", err)

    def _relay(self, method: str, path: str, raw: bytes | None) -> None:
        try:
            conn, base = _connect(self.decode, self.timeout)
        except ValueError as err:
            self._reply(502, {"error": str(err)})
            return
        try:
            conn.request(method, base + path, raw, self._headers())
            resp = conn.getresponse()
            self.send_response(resp.status)
            for h in ("Content-Type", "Content-Length", "Cache-Control"):
                if resp.getheader(h):
                    self.send_header(h, resp.getheader(h))
            self.end_headers()
            while chunk := resp.read1(65536):  # streamed answers pass through as they come
                self.wfile.write(chunk)
                self.wfile.flush()
        except (OSError, http.client.HTTPException) as err:
            log.warning("decode engine failed: %s", err)
            try:
                self._reply(502, {"error": f"decode engine: {err}"})
            except OSError:
                pass
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer engine")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    ap.add_argument("--max-body", type=int, default=16 << 20, help="largest request body accepted (bytes)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd_proxy %(levelname)s %(message)s")
    for url in (args.prefill, args.decode):
        _connect(url, 1.0)  # fails early on a malformed URL
    handler = type(
        "Handler", (Proxy,), dict(prefill=args.prefill, decode=args.decode, timeout=args.timeout, max_body=args.max_body)
    )
    srv = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"pd_proxy listening on http://{args.host}:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
