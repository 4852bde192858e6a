"""The dashboard's HTTP server (stdlib ``http.server``) and the loop that follows the run.

Routes: ``GET /`` the page (:mod:`.page`), ``GET /api/run`` the JSON (:mod:`.payload`), ``GET /healthz``
``ok``. The server runs in a daemon thread; the caller's thread follows the run
(:class:`~dora_rl.consumers.monitor_feed.RunFeed`) until ``stop()`` or Ctrl-C. A request snapshots the
view under the feed's lock, so a page never sees a half-folded batch of records. The dashboard of a
finished run keeps serving what its topics hold.
"""

from __future__ import annotations

import html
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

from dora_rl.infra.endpoints import Endpoints
from dora_rl.infra.kafka.io import now_ms

from ..monitor_feed import RunFeed
from .page import render_page
from .payload import payload

log = logging.getLogger(__name__)


class DashboardServer:
    """Serves one run's dashboard on ``bind:port`` (0: a free port) while following the run."""

    def __init__(self, bootstrap: str, run_id: str | None, bind: str = "127.0.0.1", port: int = 0,
                 advertised_host: str | None = None) -> None:
        self.feed = RunFeed(bootstrap, run_id, tool="dashboard")
        self.page = render_page(html.escape(f"dora-rl {self.feed.run_id}")).encode()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", server.page)
                elif path == "/api/run":
                    self._send(200, "application/json", json.dumps(server.document()).encode())
                elif path == "/healthz":
                    self._send(200, "text/plain", b"ok")
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("dashboard: " + format, *args)

        self.http = ThreadingHTTPServer((bind, port), Handler)
        self.http.daemon_threads = True
        ep = Endpoints(bind_host=bind, advertised_host=advertised_host or (None if bind not in ("0.0.0.0", "::")
                                                                           else "localhost"))
        self.url = f"http://{ep.address(int(self.http.server_address[1]))}/"

    def document(self) -> dict[str, Any]:
        """The JSON of ``/api/run`` now."""
        with self.feed.lock:
            return payload(self.feed.view.snapshot(now_ms()), self.feed.view.timeline)

    def serve(self, stop: Callable[[], bool] = lambda: False, out: TextIO | None = None) -> None:
        """Serve and follow the run until ``stop()`` (or Ctrl-C); prints the URL first."""
        thread = threading.Thread(target=self.http.serve_forever, name="dashboard-http", daemon=True)
        thread.start()
        if out is not None:
            print(f"dashboard of run {self.feed.run_id}: {self.url}", file=out, flush=True)
        try:
            while not stop():
                self.feed.poll(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.http.shutdown()
            self.http.server_close()
            self.feed.close()


__all__ = ["DashboardServer"]
