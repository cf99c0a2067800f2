"""End to end: circuit breaking in a real Envoy with 2 workers, against an
upstream Envoy whose fault filter fails or delays requests on demand."""

import json
import threading
import time

import http1
from harness import Stack, free_port, metric, settle, time_passes, wait_until

# Every worker re-reads the breakers' shared state within 20 ms. No condition
# shows that it has without a request, and a request to a breaker that is not
# yet open everywhere would change what is measured: a fixed pause.
SHARED_STATE_S = 0.1
# A breaker's open interval of 1 s, plus up to 20% jitter.
OPEN_1S_S = 1.3

FAIL = {"x-envoy-fault-abort-request": "503"}


def breaker(**extra):
    b = {"name": "backend", "min_requests": 10, "error_rate": 0.5,
         "open": {"base": "1s", "max": "4s"}, "half_open": {"probes": 1}}
    b.update(extra)
    return b


def trip(s, n=10, headers=FAIL, path="/"):
    c = http1.Conn(s.port)
    got = [c.request(path, headers).status for _ in range(n)]
    c.close()
    settle(SHARED_STATE_S)
    return got


def test_opens_on_error_rate_and_fails_fast_without_reaching_the_upstream():
    with Stack({"circuit_breakers": [breaker(open={"base": "3s", "max": "4s"})]}) as s:
        c = http1.Conn(s.port)
        assert [c.request("/", FAIL).status for _ in range(9)] == [503] * 9  # below min_requests
        assert c.request("/").status == 200  # 1 success in 10: 90% errors, trips
        assert c.request("/", FAIL).status == 503  # 10 failures of 11: trips now
        settle(SHARED_STATE_S)
        before = s.upstream_requests()
        got = [http1.get(s.port) for _ in range(20)]  # new connections: both workers
        assert [r.status for r in got] == [503] * 20
        assert s.upstream_requests() == before, "an open breaker let requests reach the upstream"
        r = got[0]
        assert r.header("x-sluice-circuit") == "open"
        body = json.loads(r.body)
        assert body["error"] == "circuit_open" and body["breaker"] == "backend"
        assert int(r.header("retry-after")) * 1000 >= body["retry_after_ms"] > 2000
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1)
        s.front.wait_stat(metric("sluice_cb_fast_failed_total", breaker="backend"), lambda v: v >= 20)
        s.front.wait_stat(metric("sluice_cb_open_keys", breaker="backend"), 1)
        assert 'sluice_cb_open_keys{domain="default",breaker="backend"} 1' in s.front.admin("/stats/prometheus")


def test_a_small_sample_never_trips():
    with Stack({"circuit_breakers": [breaker()]}) as s:
        assert trip(s, n=9) == [503] * 9  # 100% errors, but only 9 requests
        assert s.front.settled_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened")) == 0
        before = s.upstream_requests()
        assert http1.get(s.port).status == 200  # still reaches the upstream
        assert s.upstream_requests() == before + 1


def test_exactly_one_probe_reaches_the_upstream_and_success_closes():
    with Stack({"circuit_breakers": [breaker()]}) as s:
        trip(s)
        assert http1.get(s.port).status == 503
        time_passes(OPEN_1S_S)
        before = s.upstream_requests()
        slow = {"x-envoy-fault-delay-request": "400"}  # the probe stays in flight
        batches = [[http1.build("/", slow)] for _ in range(30)]  # one request per connection, all at once
        got = [r.status for b in http1.burst(s.port, batches) for r in b]
        assert s.upstream_requests() - before == 1, got
        assert got.count(200) == 1 and got.count(503) == 29
        s.front.wait_stat(metric("sluice_cb_probes_total", breaker="backend"), 1)
        wait_until(lambda: http1.get(s.port).status == 200, 2, "the breaker closed on every worker")
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="closed"), 1)


def test_a_failed_probe_reopens_for_longer():
    with Stack({"circuit_breakers": [breaker()]}) as s:
        trip(s)
        time_passes(OPEN_1S_S)
        r = http1.get(s.port, "/", FAIL)  # the probe fails
        assert r.status == 503 and r.header("x-sluice-circuit") is None  # the upstream's own 503
        settle(SHARED_STATE_S)
        r = http1.get(s.port)
        assert r.header("x-sluice-circuit") == "open"
        wait = json.loads(r.body)["retry_after_ms"]
        assert 1800 <= wait <= 2400, wait  # 2 s (doubled) plus up to 20%
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="reopened"), 1)


def test_route_timeouts_and_refused_connections_count_as_failures():
    dead = free_port()  # nothing listens here
    routes = [
        {"name": "dead", "match": {"prefix": "/dead"}, "route": {"cluster": "dead", "timeout": "2s"}},
        {"name": "slow", "match": {"prefix": "/slow"}, "route": {"cluster": "upstream", "timeout": "0.1s"}},
        {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "5s"}},
    ]
    cfg = {"circuit_breakers": [breaker(key="route", min_requests=3, failure={"statuses": ["500"]})]}
    with Stack(cfg, routes=routes, extra_clusters=[("dead", dead)]) as s:
        assert trip(s, n=3, headers={}, path="/dead") == [503] * 3
        r = http1.get(s.port, "/dead")
        assert r.header("x-sluice-circuit") == "open"
        assert trip(s, n=3, headers={"x-envoy-fault-delay-request": "1000"}, path="/slow") == [504] * 3
        assert http1.get(s.port, "/slow").header("x-sluice-circuit") == "open"
        # Keyed by route: the default route is unaffected, and its upstream 503s
        # are not failures for this breaker (only 500 and Envoy-side failures are).
        assert trip(s, n=5, path="/") == [503] * 5
        assert http1.get(s.port, "/").status == 200
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 2)


def test_a_healthy_second_cluster_is_unaffected():
    routes = [
        {"name": "other", "match": {"prefix": "/other"}, "route": {"cluster": "other", "timeout": "5s"}},
        {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "5s"}},
    ]
    with Stack({"circuit_breakers": [breaker()]}, routes=routes, extra_clusters=[("other", None)]) as s:
        trip(s)
        assert http1.get(s.port, "/").header("x-sluice-circuit") == "open"
        assert [http1.get(s.port, "/other").status for _ in range(10)] == [200] * 10
        # Failures on the other cluster are counted for it alone.
        assert trip(s, n=10, path="/other") == [503] * 10
        assert http1.get(s.port, "/other").header("x-sluice-circuit") == "open"
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 2)


def test_rate_limit_and_breaker_work_together():
    cfg = {"rate_limits": [{"name": "rl", "bucket": {"rate": 1, "period": "1h", "burst": 12}}],
           "circuit_breakers": [breaker()]}
    with Stack(cfg) as s:
        trip(s)  # 10 failures spend 10 tokens
        got = [http1.get(s.port) for _ in range(5)]
        assert all(r.header("x-sluice-circuit") == "open" for r in got)
        time_passes(OPEN_1S_S)
        # Fast-failed requests spent nothing: 2 tokens are left for the probe and one more.
        assert http1.get(s.port).status == 200  # the probe closes the breaker
        assert http1.get(s.port).status == 200
        r = http1.get(s.port)
        assert r.status == 429  # refused by the limiter: not an upstream failure
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1)


def test_slow_calls_trip_the_breaker_before_they_are_answered():
    """failure.slow_call: a call in flight for longer counts as a failure as
    soon as it has taken that long, so a dependency that hangs trips the
    breaker before its timeouts do."""
    cfg = {"circuit_breakers": [breaker(min_requests=3, failure={"slow_call": "100ms"},
                                        open={"base": "5s", "max": "5s"})]}
    with Stack(cfg) as s:
        hang = {"x-envoy-fault-delay-request": "4000"}
        answered = []

        def hanging_call():
            r = http1.get(s.port, "/", headers=hang)
            answered.append((time.time(), r.status))

        threads = [threading.Thread(target=hanging_call) for _ in range(3)]
        t0 = time.time()
        for t in threads:
            t.start()
        # The calls become slow at 100 ms and are counted on the next tick or
        # two; no request in between (a success would dilute the error rate).
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1)
        assert time.time() - t0 < 1.5
        assert answered == [], "the breaker opened only after the hanging calls were answered"
        settle(SHARED_STATE_S)  # every worker has read the open state
        r = http1.get(s.port)
        assert (r.status, r.header("x-sluice-circuit")) == (503, "open"), (r.status, r.headers)
        assert answered == []
        for t in threads:
            t.join(timeout=10)
        # The hanging calls themselves were let through before the breaker opened.
        assert sorted(st for _, st in answered) == [200] * 3, answered


def test_slow_call_times_the_upstream_not_a_wait_in_a_later_shedder():
    """A request that waits in sluice (a shedder's queue, after the breaker
    let it through) is not a slow call for that wait: 20 calls of 30 ms,
    one at a time behind a shedder, wait up to 600 ms in all, under a
    200 ms slow_call."""
    cfg = {"circuit_breakers": [breaker(min_requests=5, failure={"slow_call": "200ms"},
                                        open={"base": "5s", "max": "5s"})],
           "shedders": [{"name": "one", "match": {"path_prefix": "/q"}, "priority": {"default": "critical"},
                         "concurrency": {"max": 1, "queue": 50, "max_wait": "3s"}}]}
    with Stack(cfg) as s:
        quick = {"x-envoy-fault-delay-request": "30"}
        t0 = time.time()
        got = [b[0].status for b in http1.burst(s.port, [[http1.build("/q", quick)] for _ in range(20)])]
        assert got == [200] * 20 and time.time() - t0 >= 0.5, got
        settle()  # past a tick: the breaker would have counted them
        r = http1.get(s.port)
        assert r.status == 200 and r.header("x-sluice-circuit") is None, r.headers
        assert s.front.settled_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened")) == 0
        # Calls slow at the upstream still count (30 at once, past the shedder:
        # more than half of the window's calls).
        slow = {"x-envoy-fault-delay-request": "300"}
        got = [b[0].status for b in http1.burst(s.port, [[http1.build("/", slow)] for _ in range(30)])]
        assert got == [200] * 30, got
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1, timeout=5)


def test_a_later_filters_local_reply_counts_neither_way_whatever_its_status():
    """A filter after sluice that answers itself (here Envoy's fault filter,
    as a cache or a redirect would) says nothing about the upstream: its
    200s do not dilute the upstream's error rate."""
    fault = {"name": "envoy.filters.http.fault", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
        "abort": {"http_status": 200, "percentage": {"numerator": 100}},
        "headers": [{"name": "x-local", "present_match": True}]}}
    cfg = {"circuit_breakers": [breaker(open={"base": "5s", "max": "5s"})]}
    with Stack(cfg, extra_filters=[fault]) as s:
        c = http1.Conn(s.port)
        assert [c.request("/", {"x-local": "1"}).status for _ in range(20)] == [200] * 20
        assert s.upstream_requests() == 0
        assert [c.request("/", FAIL).status for _ in range(10)] == [503] * 10
        c.close()
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1, timeout=5)
        r = http1.get(s.port)
        assert (r.status, r.header("x-sluice-circuit")) == (503, "open"), r.headers


def test_graded_breaking_refuses_in_proportion_to_the_error_rate():
    """graded: below the trip rate, requests are refused at random with a
    chance rising with the error rate (0 at `from`, `max` at the trip
    rate), so the half that would succeed still does; the rate of refusals
    tracks the error rate as it changes."""
    cfg = {"circuit_breakers": [breaker(error_rate=1.0, min_requests=20, window="2s",
                                        graded={"from": 0.1, "max": 0.9})]}
    with Stack(cfg) as s:
        def phase(error_every):
            c = http1.Conn(s.port)
            got = []
            for i in range(400):
                r = c.request("/", FAIL if i % error_every == 0 else {})
                got.append(r.header("x-sluice-circuit") == "throttled")
            c.close()
            return sum(got[100:]) / 300  # after the window has filled

        # 50% errors: 0.9 x (0.5 - 0.1) / 0.9 = 40% refused.
        half = phase(2)
        assert 0.25 <= half <= 0.55, half
        time_passes(2.5)  # the 2 s window forgets
        # 25% errors: 0.9 x (0.25 - 0.1) / 0.9 = 15% refused.
        quarter = phase(4)
        assert 0.05 <= quarter <= 0.27, quarter
        assert quarter < half
        s.front.wait_stat(metric("sluice_cb_throttled_total", breaker="backend"), lambda v: v > 0)
        assert s.front.settled_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened")) == 0


def test_graded_refusals_stop_within_half_a_window_of_a_recovery():
    """graded: once the upstream recovers, refusals stop within about half
    the window (the newer half's error rate counts when it is clearly
    lower), not once the old failures have left the whole window. With
    `from: 0` any failure counted refuses now and then: here the newer
    half (1 s) is clear of them by 1.0 s after the recovery, the whole
    window (2 s) only by 1.8 to 2.0 s."""
    cfg = {"circuit_breakers": [breaker(error_rate=1.0, min_requests=20, window="2s",
                                        graded={"from": 0, "max": 0.9})]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        start, i = time.time(), 0
        throttled_while_failing = 0
        while time.time() - start < 2.2:  # half failing, over the whole window
            r = c.request("/", FAIL if i % 2 == 0 else {})
            throttled_while_failing += r.header("x-sluice-circuit") == "throttled"
            i += 1
        assert throttled_while_failing > 50
        healed, last = time.time(), None
        while time.time() - healed < 2.5:
            sent = time.time() - healed  # a slow answer does not count against it
            if c.request("/").header("x-sluice-circuit") == "throttled":
                last = sent
        c.close()
        assert last is not None  # the old failures still counted at first
        assert last < 1.4, f"refused {last:.2f} s after the upstream recovered"


def test_grpc_errors_in_an_upstream_200_trip_it_as_admission_control_counts_them():
    """A gRPC server answers an error with HTTP 200 and `grpc-status` in
    its headers (trailers-only): UNAVAILABLE counts as a failure, NOT_FOUND
    (the caller's) does not, as in Envoy's admission_control."""
    grpc = {"content-type": "application/grpc", "te": "trailers"}

    def calls(s, status, n):
        c = http1.Conn(s.port)
        got = [c.request("/", dict(grpc, **{"x-envoy-fault-abort-grpc-request": status}), method="POST")
               for _ in range(n)]
        c.close()
        return [(r.status, r.header("grpc-status"), r.header("x-sluice-circuit")) for r in got]

    with Stack({"circuit_breakers": [breaker()]}) as s:
        assert calls(s, "5", 12) == [(200, "5", None)] * 12
        assert s.front.settled_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened")) == 0
        before = s.upstream_requests()
        assert calls(s, "5", 1) == [(200, "5", None)], "NOT_FOUND tripped the breaker"
        assert s.upstream_requests() == before + 1
    with Stack({"circuit_breakers": [breaker()]}) as s:
        assert calls(s, "14", 10) == [(200, "14", None)] * 10
        settle(SHARED_STATE_S)
        before = s.upstream_requests()
        got = [http1.Conn(s.port).request("/", grpc, method="POST") for _ in range(10)]  # both workers
        assert [(r.status, r.header("grpc-status"), r.header("x-sluice-circuit")) for r in got] == \
            [(200, "14", "open")] * 10
        assert s.upstream_requests() == before, "an open breaker let gRPC calls reach the upstream"
        s.front.wait_stat(metric("sluice_cb_transitions_total", breaker="backend", transition="opened"), 1)
