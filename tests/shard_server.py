"""A real HTTP server on 127.0.0.1 serving a directory with Range support (the stdlib handler has none),
for the URL-shard tests: start, stop and restart on the same port, count requests."""
from __future__ import annotations

import http.server
import os
import re
import threading
from pathlib import Path


class RangeHandler(http.server.BaseHTTPRequestHandler):
    root: Path
    counter: dict

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.counter["requests"] = self.counter.get("requests", 0) + 1
        path = (self.root / self.path.lstrip("/").split("?")[0]).resolve()
        if self.root.resolve() not in path.parents or not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m:
                self.send_error(400)
                return
            a = int(m.group(1))
            b = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            if a >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.counter["ranges"] = self.counter.get("ranges", 0) + 1
            body = data[a:b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ShardServer:
    """``ShardServer(dir).start()``; ``url`` is ``http://127.0.0.1:PORT``; ``stop()`` then ``start()`` again
    serves on the same port."""

    def __init__(self, root: str | os.PathLike, port: int = 0):
        self.root, self.port = Path(root), port
        self.counter: dict = {}
        self.httpd = None
        self.thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ShardServer":
        handler = type("Handler", (RangeHandler,), {"root": self.root, "counter": self.counter})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join()
            self.httpd = None

    def restart_after(self, seconds: float) -> threading.Timer:
        t = threading.Timer(seconds, self.start)
        t.daemon = True
        t.start()
        return t

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
