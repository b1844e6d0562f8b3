"""A tiny HTTP server on loopback for tests that need an endpoint to misbehave in a
way a real server (moto) never does: answers from the test's own handler class."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing (the test's asserts say what happened)."""

    def log_message(self, *args: object) -> None:
        pass


class LoopbackHttp:
    """Serves ``handler`` on 127.0.0.1 (a free port) on a daemon thread until
    :meth:`close`; :attr:`endpoint` is its URL."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
