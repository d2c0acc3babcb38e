"""A local HTTP server for the download tests: on a free loopback port, in a thread, shut down
when the test ends or after a time limit (so a hung test cannot keep it serving)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def serving(
    handler: type[BaseHTTPRequestHandler], limit_s: float, **state: Any
) -> Iterator[ThreadingHTTPServer]:
    """A server of ``handler`` with ``state`` as its attributes (what the handler reads and
    records), serving until the block ends or ``limit_s`` passes."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    for name, value in state.items():
        setattr(srv, name, value)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    stop = threading.Timer(limit_s, srv.shutdown)
    stop.daemon = True
    stop.start()
    try:
        yield srv
    finally:
        stop.cancel()
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def url(srv: ThreadingHTTPServer, path: str) -> str:
    """The address of ``path`` on ``srv``."""
    return f"http://127.0.0.1:{srv.server_address[1]}{path}"
