"""End to end: deadlines in a real Envoy with 2 workers. A request that
cannot finish in time is refused at once (504, or gRPC DEADLINE_EXCEEDED);
a queued request never waits past its deadline; and one that waited goes
upstream with its deadline reduced by the wait, as the upstream sees it."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import http1
from harness import TRAFFIC_SEEN_S, Stack, free_port, metric, time_passes, wait_until

ROUTES = [{"name": "echo", "match": {"prefix": "/"}, "route": {"cluster": "echo", "timeout": "10s"}}]


class Echo:
    """An upstream that sleeps `x-sleep-ms` and records the deadline header
    it received; `arrived` counts the requests it has begun to serve."""

    def __init__(self):
        seen = self.seen = []
        grpc = self.grpc = []
        arrived = self.arrived = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                arrived.append(time.monotonic())
                time_passes(int(self.headers.get("x-sleep-ms", "0")) / 1000)  # the service time asked for
                seen.append(self.headers.get("x-deadline-ms"))
                grpc.append(self.headers.get("grpc-timeout"))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def hold(echo, port, ms, headers=None):
    """A request that the upstream serves for `ms`, holding its place in
    sluice meanwhile: returns its thread once the upstream has it."""
    n = len(echo.arrived)
    t = threading.Thread(target=http1.get, args=(port, "/slow"),
                         kwargs={"headers": dict(headers or {}, **{"x-sleep-ms": str(ms)})})
    t.start()
    wait_until(lambda: len(echo.arrived) > n, TRAFFIC_SEEN_S, "the slow request at the upstream")
    return t


def test_deadlines_refuse_cap_the_queue_and_reach_the_upstream_reduced():
    cfg = {"deadlines": {"headers": ["grpc-timeout", "x-deadline-ms"], "min_remaining": "10ms"},
           "shedders": [{"name": "q", "concurrency": {"max": 1, "queue": 8, "max_wait": "3s"},
                         "priority": {"default": "critical"}}]}
    with Echo() as echo, Stack(cfg, routes=ROUTES, extra_clusters=[("echo", echo.port)]) as s:
        c = http1.Conn(s.port)
        # Too little left: refused at once, before anything else.
        r = c.request("/", {"x-deadline-ms": "5"})
        assert r.status == 504 and r.header("x-sluice-deadline") == "exceeded", r.headers
        g = c.request("/pkg.S/M", {"content-type": "application/grpc", "grpc-timeout": "3m", "te": "trailers"},
                      method="POST")
        assert (g.status, g.header("grpc-status")) == (200, "4"), g.headers
        # A part of a millisecond counts, rounded up as Envoy's router
        # reads it: 10.001 ms is more than min_remaining, 10 ms is not.
        assert c.request("/", {"grpc-timeout": "10001u"}).status == 200
        assert c.request("/", {"grpc-timeout": "10000u"}).status == 504
        s.front.wait_stat(metric("sluice_deadline_refused_total"), 3)

        # Queued behind a slow request: answered when its deadline passes,
        # not at max_wait.
        slow = hold(echo, s.port, 1500)
        t = time.time()
        r = c.request("/", {"x-deadline-ms": "300"})
        waited = time.time() - t
        assert r.status == 504, r.headers
        assert 0.25 <= waited < 0.8, waited
        slow.join(timeout=10)

        # Queued, then let in: the upstream sees the deadline less the wait.
        echo.seen.clear()
        slow = hold(echo, s.port, 700)
        r = c.request("/", {"x-deadline-ms": "5000"})
        slow.join(timeout=10)
        assert r.status == 200
        sent = [int(v) for v in echo.seen if v is not None]
        assert len(sent) == 1 and 4000 <= sent[0] <= 4700, echo.seen
        # Not queued: the header goes upstream untouched.
        echo.seen.clear()
        assert c.request("/", {"x-deadline-ms": "5000"}).status == 200
        assert echo.seen == ["5000"], echo.seen


def test_shed_early_answers_at_once_a_request_that_would_wait_past_its_deadline():
    """With `shed_early`, a request whose expected wait in the queue is past
    its deadline gets the deadline's answer on arrival, not when the
    deadline passes; one with time enough waits and is served."""
    cfg = {"deadlines": {"headers": ["x-deadline-ms"]},
           "shedders": [{"name": "q", "concurrency": {"max": 1, "queue": 50, "max_wait": "5s",
                                                        "shed_early": True},
                         "priority": {"default": "critical"}}]}
    with Echo() as echo, Stack(cfg, routes=ROUTES, extra_clusters=[("echo", echo.port)]) as s:
        stop = threading.Event()

        def busy():  # keeps the one slot taken and both workers' lines full
            c = http1.Conn(s.port)
            while not stop.is_set():
                c.request("/", {"x-sleep-ms": "40"})
            c.close()

        threads = [threading.Thread(target=busy) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            time_passes(1.0)  # the shedder measures the service time; the lines stand
            took = []
            for _ in range(7):
                c = http1.Conn(s.port)
                t = time.time()
                r = c.request("/", {"x-deadline-ms": "150"})
                took.append(time.time() - t)
                c.close()
                assert r.status == 504 and r.header("x-sluice-deadline") == "exceeded", (r.status, r.headers)
            # On arrival (measured: a few ms), not when the 150 ms pass.
            took.sort()
            assert took[len(took) // 2] < 0.075, took
            # Time enough: it waits its turn and is served.
            assert http1.get(s.port, "/", headers={"x-deadline-ms": "20000"}).status == 200
        finally:
            stop.set()
            for t in threads:
                t.join()
        s.front.wait_stat(metric("sluice_deadline_refused_total"), lambda v: v >= 7)


def test_a_repeated_deadline_or_attempt_header_counts_by_its_first_value():
    """Envoy joins repeated values of the headers it knows (`grpc-timeout`,
    `x-envoy-attempt-count`) into one, `5m,5m`: the first value counts, as
    for any repeated header, so a second copy neither hides a deadline nor
    turns a retry into a first try."""
    cfg = {"deadlines": {"min_remaining": "10ms"},
           "retry_budgets": [{"name": "none", "ratio": 0, "min_per_second": 0}]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)

        def twice(name, value):
            return c.send_all([f"GET / HTTP/1.1\r\nHost: test\r\n{name}: {value}\r\n{name}: {value}\r\n\r\n"
                               .encode()])[0]

        r = twice("grpc-timeout", "5m")
        assert r.status == 504 and r.header("x-sluice-deadline") == "exceeded", r.headers
        r = twice("x-envoy-attempt-count", "3")
        assert r.status == 429 and r.header("x-sluice-retry-budget") == "exhausted", r.headers
        # Once each, for comparison: the same answers.
        assert c.request("/", {"grpc-timeout": "5m"}).status == 504
        assert c.request("/", {"x-envoy-attempt-count": "3"}).status == 429
        assert c.request("/", {"x-envoy-attempt-count": "1"}).status == 200
        c.close()


def test_a_waiting_request_is_answered_once_it_has_only_min_remaining_left():
    """A request waits in sluice (a bulkhead's line, a shedder's queue) only
    until it has `min_remaining` left: past that it could not be served in
    time by the operator's own measure, and gets the deadline's answer; one
    let in before goes upstream with more than `min_remaining` left."""
    cfg = {"deadlines": {"headers": ["x-deadline-ms"], "min_remaining": "200ms", "propagate": True},
           "concurrency_limits": [{"name": "l", "key": [{"header": "x-tenant"}], "max": 1, "max_wait": "3s"}],
           "shedders": [{"name": "q", "concurrency": {"max": 1, "queue": 8, "max_wait": "3s"},
                         "priority": {"default": "critical"}}]}
    with Echo() as echo, Stack(cfg, routes=ROUTES, extra_clusters=[("echo", echo.port)]) as s:
        c = http1.Conn(s.port)
        for where, headers in (("bulkhead/l", {"x-tenant": "a"}), ("shed/q", {})):
            # Behind a request holding the place for 1.5 s: a deadline of
            # 600 ms waits 400 ms, not 600.
            slow = hold(echo, s.port, 1500, headers)
            t = time.time()
            r = c.request("/", dict(headers, **{"x-deadline-ms": "600"}))
            waited = time.time() - t
            assert r.status == 504 and r.header("x-sluice-deadline") == "exceeded", (where, r.status, r.headers)
            assert 0.35 <= waited < 0.55, (where, waited)
            # It says the time it truly had left: min_remaining, less how
            # late the tick that answered it came.
            body = json.loads(r.body)
            assert body["by"] == where and 100 <= body["remaining_ms"] <= 200, (where, body)
            slow.join(timeout=10)
            # Behind one of 300 ms: let in with about 700 of 1,000 ms left.
            echo.seen.clear()
            slow = hold(echo, s.port, 300, headers)
            r = c.request("/", dict(headers, **{"x-deadline-ms": "1000"}))
            slow.join(timeout=10)
            assert r.status == 200, (where, r.status)
            sent = [int(v) for v in echo.seen if v is not None]
            assert len(sent) == 1 and 200 < sent[0] <= 900, (where, echo.seen)
        c.close()


def test_every_deadline_header_a_request_carries_is_reduced_by_its_wait():
    """A request carrying both `grpc-timeout` and `x-deadline-ms` that waits
    in a queue reaches the upstream with both reduced by the wait, each in
    its own format: no header the next hop may read overstates the time
    left."""
    cfg = {"deadlines": {"headers": ["grpc-timeout", "x-deadline-ms"]},
           "shedders": [{"name": "q", "concurrency": {"max": 1, "queue": 8, "max_wait": "3s"},
                         "priority": {"default": "critical"}}]}
    with Echo() as echo, Stack(cfg, routes=ROUTES, extra_clusters=[("echo", echo.port)]) as s:
        c = http1.Conn(s.port)
        slow = hold(echo, s.port, 600)
        echo.seen.clear()
        echo.grpc.clear()
        r = c.request("/", {"grpc-timeout": "3000m", "x-deadline-ms": "3000"})
        slow.join(timeout=10)
        assert r.status == 200, r.status
        got = [(g, d) for g, d in zip(echo.grpc, echo.seen) if d is not None]
        assert len(got) == 1, (echo.grpc, echo.seen)
        grpc, millis = got[0]
        assert grpc.endswith("m") and 2000 <= int(grpc[:-1]) <= 2800, got
        # Both were reduced by the same wait (read within a millisecond).
        assert abs(int(millis) - int(grpc[:-1])) <= 1, got
        c.close()


def test_an_admitted_request_carries_its_rate_limit_headers_beside_deadlines():
    """With a `deadlines` section, whether or not the request sent a
    deadline, the rate-limit headers of an admitted request reach its
    response, once, on every worker."""
    cfg = {"deadlines": {"min_remaining": "10ms"},
           "rate_limits": [{"name": "r", "bucket": {"rate": 1, "period": "1h", "burst": 20}}],
           "response": {"headers_on_allowed": True}}
    with Stack(cfg) as s:
        left = []
        for i in range(8):
            h = {"x-envoy-expected-rq-timeout-ms": "5000"} if i % 2 else {}
            # A connection each, read raw: both workers serve, and a header
            # sent twice would show.
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
                c.sendall(http1.build("/", dict(h, connection="close")))
                raw = b""
                while chunk := c.recv(65536):
                    raw += chunk
            head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower().split("\r\n")
            assert head[0].split(" ")[1] == "200", head
            values = [line.split(":", 1)[1].strip() for line in head if line.startswith("x-ratelimit-remaining:")]
            assert len(values) == 1 and "x-ratelimit-limit: 20" in head, head
            left.append(int(values[0]))
        assert sorted(left, reverse=True) == list(range(19, 11, -1)), left
