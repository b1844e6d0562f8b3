"""A real vLLM engine (in-process ``LLM``, the connector with a given role) behind the
part of the OpenAI completions API the PD proxy uses, for tests where two cold
``vllm serve`` starts would cost minutes: ``python -m tests.connector.serve_proc MODEL
ROLE CONFIG_JSON``. Prints ``READY <port>``; serves ``POST /v1/completions`` with
``prompt`` as token ids, ``max_tokens``, greedy sampling, one request at a time, and
answers ``choices[0].token_ids``, ``usage.prompt_tokens_details.cached_tokens`` and
the connector's ``lmcache`` counters (saved/loaded tokens). Stops when stdin closes."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> int:
    model, role, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from tests.connector.engine_proc import engine

    llm = engine(model, config, role)
    worker = get_kv_transfer_group().worker

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sp = SamplingParams(max_tokens=int(body["max_tokens"]), temperature=0)
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=body["prompt"])], sp, use_tqdm=False)
            stats = worker.stats()
            data = json.dumps(
                {
                    "choices": [{"index": 0, "text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids)}],
                    "usage": {
                        "prompt_tokens": len(body["prompt"]),
                        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
                    },
                    "lmcache": {"saved_tokens": stats["saved_tokens"], "loaded_tokens": stats["loaded_tokens"]},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(f"READY {srv.server_address[1]}", flush=True)
    sys.stdin.read()
    srv.shutdown()
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
