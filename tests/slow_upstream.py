"""A deliberately limited upstream for shedding tests: at most CAPACITY
requests are served at once, each taking DELAY_MS; the rest wait in line,
as they would in a real overloaded service. Run as a child process:
    python slow_upstream.py PORT CAPACITY DELAY_MS
It counts requests in flight and the most ever seen, and records when each
request arrived (seconds, CLOCK_MONOTONIC), served at GET /__stats.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, CAPACITY, DELAY_MS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
slots = threading.Semaphore(CAPACITY)
lock = threading.Lock()
stats = {"served": 0, "in_flight": 0, "max_in_flight": 0, "arrivals": []}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave at once: no 40 ms delayed-ACK stalls

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/__stats":
            with lock:
                body = json.dumps(stats).encode()
        else:
            arrived = time.monotonic()
            with lock:
                stats["arrivals"].append(arrived)
            with slots:
                with lock:
                    stats["in_flight"] += 1
                    stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
                time.sleep(DELAY_MS / 1000)
                with lock:
                    stats["in_flight"] -= 1
                    stats["served"] += 1
            body = b"ok\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512


Server(("127.0.0.1", PORT), Handler).serve_forever()
