"""A deliberately limited upstream for shedding tests: at most CAPACITY
requests are served at once, each taking DELAY_MS; the rest wait in line,
as they would in a real overloaded service. Run as a child process:
    python slow_upstream.py PORT CAPACITY DELAY_MS [blind]
A request's `x-sleep-ms` header replaces DELAY_MS for it. A request the
proxy resets (its client left) stops counting as in flight at once, unless
`blind`: then it is served in full all the same (work done for nobody, as
by a service that does not notice cancellations).

GET /__stats: requests received, in flight, the most ever in flight, served,
when each request arrived (`arrivals`, seconds of CLOCK_MONOTONIC, the same
clock as the tests');
and per tenant (the `x-tenant` header) in flight, peak, served, gone (reset
before the answer), the `x-deadline-ms` values they came with and each
request's [start, end, gone]. GET /__reset clears the tenants' peaks and
intervals.
"""

import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, CAPACITY, DELAY_MS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
BLIND = sys.argv[4:5] == ["blind"]
slots = threading.Semaphore(CAPACITY)
lock = threading.Lock()
stats = {"received": 0, "served": 0, "in_flight": 0, "max_in_flight": 0, "tenants": {}, "arrivals": []}


def tenant(t):
    return stats["tenants"].setdefault(t, {"in_flight": 0, "peak": 0, "served": 0, "gone": 0, "deadlines": [],
                                                   "intervals": []})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave at once: no 40 ms delayed-ACK stalls

    def log_message(self, *args):
        pass

    def sleep_unless_gone(self, seconds):
        """Sleeps, unless the proxy closes the connection first (it resets
        the request: a client gone): then returns True at once, so that a
        request no longer in flight is no longer counted as such."""
        if BLIND:
            time.sleep(seconds)  # the service time, served in full
            return False
        end = time.time() + seconds
        poll = select.poll()  # not select(): descriptors may pass 1024 here
        poll.register(self.connection, select.POLLIN | select.POLLHUP)
        while (left := end - time.time()) > 0:
            if poll.poll(left * 1000):
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return True
                except OSError:
                    return True
                time.sleep(min(left, 0.005))  # data (not expected): keep sleeping
        return False

    def do_GET(self):
        if self.path == "/__stats":
            with lock:
                body = json.dumps(stats).encode()
        elif self.path == "/__reset":
            with lock:
                for t in stats["tenants"].values():
                    t["peak"] = t["in_flight"]
                    t["intervals"] = []
            body = b"reset\n"
        else:
            arrived = time.monotonic()
            with lock:
                stats["received"] += 1
                stats["arrivals"].append(arrived)
            t = self.headers.get("x-tenant")
            sleep_ms = int(self.headers.get("x-sleep-ms", DELAY_MS))
            with slots:
                start = time.monotonic()
                with lock:
                    stats["in_flight"] += 1
                    stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
                    if t is not None:
                        one = tenant(t)
                        one["in_flight"] += 1
                        one["peak"] = max(one["peak"], one["in_flight"])
                        if self.headers.get("x-deadline-ms") is not None:
                            one["deadlines"].append(int(self.headers["x-deadline-ms"]))
                gone = self.sleep_unless_gone(sleep_ms / 1000)
                with lock:
                    stats["in_flight"] -= 1
                    stats["served"] += 1
                    if t is not None:
                        tenant(t)["in_flight"] -= 1
                        tenant(t)["gone" if gone else "served"] += 1
                        tenant(t)["intervals"].append([start, time.monotonic(), gone])
            if gone:
                self.close_connection = True
                return
            body = b"ok\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512


Server(("127.0.0.1", PORT), Handler).serve_forever()
