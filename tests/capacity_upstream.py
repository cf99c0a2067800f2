"""An upstream whose capacity changes at run time, for adaptive concurrency
tests and benchmarks: at most CAPACITY requests are served at once, each
taking DELAY_MS; the rest wait in line, as in a real overloaded service.
Run as a child process:
    python capacity_upstream.py PORT CAPACITY DELAY_MS
GET /__capacity?n=N sets the capacity; GET /__stats returns requests served,
in flight now (`busy`), the most in flight since the last /__stats?reset=1,
the error rate, and `busy_slot_ms`: the slots in use (at most the capacity)
integrated over time, in slot-milliseconds, up to `clock_ms` (this
process's monotonic clock), so that the busy share of the capacity between
two snapshots is the difference of `busy_slot_ms` over capacity x the
difference of `clock_ms`. Every control path answers such a snapshot.
GET /__errors?pct=P makes P% of requests answer 503 (after the same
service time). GET /__jitter?ms=J makes each service time uniform within
DELAY_MS +- J (however many are in flight). GET
/__service?lo=A&hi=B&slow_pct=P&slow_ms=S replaces both: each service time
is S ms for P% of requests (bimodal; default 0) and else uniform within A
to B ms (`hi` defaults to `lo`); GET /__service without `lo` returns to
DELAY_MS +- J.
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
         "jitter_ms": 0, "service": None, "busy_slot_ms": 0.0, "clock_ms": time.monotonic() * 1000}


def account():
    """Adds the slots in use since the last change to `busy_slot_ms` (call
    with `cond` held, before `busy` or the capacity changes)."""
    now = time.monotonic() * 1000
    state["busy_slot_ms"] += min(state["busy"], state["capacity"]) * (now - state["clock_ms"])
    state["clock_ms"] = now


def service_ms():
    """One request's service time (ms), as the last /__service or /__jitter set it."""
    s = state["service"]
    if s is None:
        return DELAY_MS + random.uniform(-state["jitter_ms"], state["jitter_ms"])
    if random.random() * 100 < s["slow_pct"]:
        return s["slow_ms"]
    return random.uniform(s["lo"], s["hi"])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def control(self, url):
        q = parse_qs(url.query)
        with cond:
            account()
            if url.path == "/__capacity":
                state["capacity"] = int(q["n"][0])
                cond.notify_all()
            elif url.path == "/__errors":
                state["errors_pct"] = int(q["pct"][0])
            elif url.path == "/__jitter":
                state["jitter_ms"] = int(q["ms"][0])
            elif url.path == "/__service":
                lo = float(q["lo"][0]) if "lo" in q else None
                state["service"] = None if lo is None else {
                    "lo": lo, "hi": float(q.get("hi", [lo])[0]),
                    "slow_pct": float(q.get("slow_pct", [0])[0]), "slow_ms": float(q.get("slow_ms", [0])[0])}
            body = json.dumps(state).encode()
            if q.get("reset"):
                state["max_in_flight"] = state["busy"]
        return 200, body

    def serve(self):
        with cond:
            while state["busy"] >= state["capacity"]:
                cond.wait()
            account()
            state["busy"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["busy"])
            fail = random.random() * 100 < state["errors_pct"]
            delay_ms = service_ms()
        time.sleep(delay_ms / 1000)  # the service time
        with cond:
            account()
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
