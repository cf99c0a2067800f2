"""An upstream whose capacity changes at run time, for adaptive concurrency
tests and benchmarks: at most CAPACITY requests are served at once, each
taking DELAY_MS; the rest wait in line, as in a real overloaded service.
Run as a child process:
    python capacity_upstream.py PORT CAPACITY DELAY_MS
GET /__capacity?n=N sets the capacity; GET /__stats returns requests served,
in flight now, the most in flight since the last /__stats?reset=1, and the
error rate. GET /__errors?pct=P makes P% of requests answer 503 (after the
same service time). GET /__jitter?ms=J makes each service time uniform
within DELAY_MS +- J (however many are in flight).
"""

import json
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PORT, CAPACITY, DELAY_MS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cond = threading.Condition()
state = {"capacity": CAPACITY, "busy": 0, "served": 0, "max_in_flight": 0, "errors_pct": 0, "failed": 0,
         "jitter_ms": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def control(self, url):
        q = parse_qs(url.query)
        with cond:
            if url.path == "/__capacity":
                state["capacity"] = int(q["n"][0])
                cond.notify_all()
            elif url.path == "/__errors":
                state["errors_pct"] = int(q["pct"][0])
            elif url.path == "/__jitter":
                state["jitter_ms"] = int(q["ms"][0])
            body = json.dumps(state).encode()
            if q.get("reset"):
                state["max_in_flight"] = state["busy"]
        return 200, body

    def serve(self):
        with cond:
            while state["busy"] >= state["capacity"]:
                cond.wait()
            state["busy"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["busy"])
            fail = random.random() * 100 < state["errors_pct"]
            jitter = state["jitter_ms"]
        time.sleep((DELAY_MS + random.uniform(-jitter, jitter)) / 1000)  # the service time
        with cond:
            state["busy"] -= 1
            state["served"] += 1
            state["failed"] += int(fail)
            cond.notify()
        return (503 if fail else 200), b"ok\n"

    def do_GET(self):
        url = urlparse(self.path)
        status, body = self.control(url) if url.path.startswith("/__") else self.serve()
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


Server(("127.0.0.1", PORT), Handler).serve_forever()
