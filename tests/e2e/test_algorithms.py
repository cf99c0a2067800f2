"""End to end: the rate-limit algorithms besides the token bucket, in a real
Envoy with several workers: sliding-window quotas and shaping by delay."""

import json
import socket
import threading
import time

import http1
from harness import FrontOf, SlowUpstream, Stack, metric, time_passes, wait_until, METRICS_DUE_S

WINDOW_S = 4
LIMIT = 10


def window_rule(limit=LIMIT, period=f"{WINDOW_S}s", **extra):
    r = {"name": "plan", "algorithm": "sliding_window", "window": {"limit": limit, "period": period}}
    r.update(extra)
    return r


def burst_statuses(port, n, headers=None, sent_at=None):
    """n requests at once, each on its own connection (so over the workers);
    `sent_at` as in `http1.burst`."""
    got = http1.burst(port, [[http1.build("/", headers)] for _ in range(n)], sent_at)
    return [b[0] for b in got]


def sleep_until_offset(offset_s, period_s=WINDOW_S):
    """Sleeps until `offset_s` into a fixed window (windows start at
    multiples of the period since the Unix epoch, as sluice's do)."""
    now = time.time()
    into = now % period_s
    wait = offset_s - into if into < offset_s else period_s - into + offset_s
    time_passes(wait)


def test_a_boundary_burst_is_not_admitted_twice_and_retry_after_is_never_early():
    cfg = {"rate_limits": [window_rule()],
           "response": {"retry_after_jitter": "0s", "headers_on_allowed": True}}
    with Stack(cfg) as s:
        # A burst just before a window boundary: exactly the limit passes
        # (across both workers), the rest are refused.
        sleep_until_offset(WINDOW_S - 0.4)
        first = burst_statuses(s.port, 25)
        assert sum(r.status == 200 for r in first) == LIMIT, [r.status for r in first]
        assert {r.status for r in first} == {200, 429}
        ok = next(r for r in first if r.status == 200)
        assert ok.header("ratelimit-policy") == f'"plan";q={LIMIT};w={WINDOW_S}'
        # Just after the boundary a fixed window would admit the limit
        # again; the sliding window weighs the previous window by what is
        # left of it, so only what slid out (limit * e / W) may pass.
        sleep_until_offset(0.1)
        second = burst_statuses(s.port, 25)
        e = time.time() % WINDOW_S  # the latest offset any of them had
        admitted = sum(r.status == 200 for r in second)
        assert admitted <= int(LIMIT * e / WINDOW_S), (admitted, e)
        refused = next(r for r in second if r.status == 429)
        body = json.loads(refused.body)
        assert body["rule"] == "plan"
        wait_ms = body["retry_after_ms"]
        assert int(refused.header("retry-after")) * 1000 >= wait_ms
        # At the wait it states (plus a margin for the clock between this
        # process and Envoy's), one request fits again.
        time_passes(wait_ms / 1000 + 0.05)
        assert http1.get(s.port).status == 200
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="plan", result="allowed"), LIMIT + admitted + 1)


def test_a_sliding_window_counts_per_key_and_refuses_with_the_standard_headers():
    cfg = {"rate_limits": [window_rule(limit=3, period="1h", key=[{"header": "x-tenant"}])],
           "response": {"retry_after_jitter": "0s"}}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        a = [c.request("/", {"x-tenant": "a"}).status for _ in range(4)]
        b = [c.request("/", {"x-tenant": "b"}).status for _ in range(4)]
        assert a == [200, 200, 200, 429] and b == [200, 200, 200, 429]
        r = c.request("/", {"x-tenant": "a"})
        assert r.status == 429
        # The count drops below the limit when the window rolls over and
        # enough of it has slid out: never sooner than the end of this hour.
        into = time.time() % 3600
        assert int(r.header("retry-after")) >= 3600 - into - 2
        assert r.header("x-ratelimit-limit") == "3"
        assert r.header("x-ratelimit-remaining") == "0"


def PacedStack(plugin_config, concurrency=4):
    """A front Envoy (4 workers by default) in front of an upstream (a child
    process) that records when each request arrived."""
    return FrontOf(SlowUpstream(1000, 0), plugin_config, concurrency)


RATE = 100  # per second: one request every 10 ms
SPACING_S = 1 / RATE
# Arrival times are taken in the upstream's handler threads (time.monotonic,
# the same clock as this process's). Scheduling of those threads and of
# Envoy's workers (each releases held requests from its own 1 ms tick), with
# 4 workers and 500 clients on this machine's 2 cores, makes a release late
# by a few milliseconds, sometimes more under load, and a late one arrives
# closer to the next: measured here, closest pair 4.5-6.8 ms apart, 20
# consecutive arrivals at least 186.9 ms apart (ideal 190) in 95% of the
# spans (the shortest 1-2% fell to 150-178 ms on a busy day, each after a
# late release, so the 5th percentile is checked). A release is
# never early, so the k-th arrival is never before the burst's start plus
# k turns: that is checked exactly (within 1 ms for reading the clocks).
# Two requests sent in one turn would break it, or arrive ~0 ms apart.
TOLERANCE_S = 0.008
CLOCK_S = 0.001


def paced_rule(**extra):
    r = {"name": "pace", "bucket": {"rate": RATE, "period": "1s", "burst": 1},
         "on_limit": "delay", "max_delay": "10s"}
    r.update(extra)
    return r


def test_shaping_spaces_a_burst_of_500_to_the_rate_at_the_upstream():
    n = 500
    with PacedStack({"rate_limits": [paced_rule()]}) as s:
        sent_at = []
        got = burst_statuses(s.port, n, sent_at=sent_at)
        started = sent_at[0]
        took = time.monotonic() - started
        assert [r.status for r in got] == [200] * n
        arrivals = sorted(s.up.stats()["arrivals"])
        assert len(arrivals) == n
        # Never ahead of the schedule: at most k + 1 requests by k turns
        # after the first request left, whatever the workers (a second
        # request let through at the start, or two in one turn anywhere,
        # puts every later arrival a turn early).
        early = [(k, a - started - k * SPACING_S) for k, a in enumerate(arrivals)
                 if a < started + k * SPACING_S - CLOCK_S]
        assert not early, early[:5]
        # Evenly spaced: closer pairs only where a release was late (a
        # worker's tick delayed on a loaded runner; the next request then
        # leaves on time, close behind it): 16 of 499 in one fresh-clone
        # run on a loaded machine. A pacer that
        # released two per turn would make half of them close, and the
        # check above would already find every later arrival early.
        gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
        close = [g for g in gaps if g < SPACING_S - TOLERANCE_S]
        assert len(close) <= n // 20, (len(close), gaps[:10])
        spans = sorted(arrivals[i + 19] - arrivals[i] for i in range(n - 19))
        assert spans[len(spans) // 20] >= 19 * SPACING_S - TOLERANCE_S, spans[:25]
        # And not slower than needed: about the rate on the whole.
        median = gaps[len(gaps) // 2]
        assert abs(median - SPACING_S) < 0.002, median
        assert took < n * SPACING_S + 2, took
        # The first is allowed at once, and so is any request that reaches
        # the filter only after its turn has come (on a loaded runner a
        # burst can take more than a turn to reach the filter: 2 allowed,
        # 498 delayed was seen in CI when each of 500 threads released by
        # a barrier sent its own request); every other waits.
        counts = []

        def all_counted():
            counts.append([s.front.stat(metric("sluice_rl_requests_total", rule="pace", result=r))
                           for r in ("allowed", "delayed")])
            return sum(counts[-1]) == n

        wait_until(all_counted, METRICS_DUE_S, f"allowed + delayed == {n}")
        allowed, delayed = counts[-1]
        assert 1 <= allowed <= n // 50, (allowed, delayed)
        assert s.front.settled_stat(metric("sluice_rl_held", rule="pace")) == 0
        prom = s.front.admin("/stats/prometheus")
        assert 'sluice_rl_delay_ms_bucket{domain="default",rule="pace"' in prom


def test_a_turn_beyond_max_delay_or_the_held_bound_is_refused_at_once():
    cfg = {"rate_limits": [paced_rule(max_delay="200ms", max_delayed=1000)],
           "response": {"retry_after_jitter": "0s"}}
    with PacedStack(cfg, concurrency=2) as s:
        got = burst_statuses(s.port, 60)
        ok = [r for r in got if r.status == 200]
        refused = [r for r in got if r.status == 429]
        # Turns 0, 10, ..., 200 ms: 21 requests go (a turn or two more if
        # the burst took a while to arrive), the rest are refused at once.
        assert 21 <= len(ok) <= 26, len(ok)
        assert len(refused) == 60 - len(ok)
        assert all(int(r.header("retry-after")) >= 1 for r in refused)
    # A worker holds at most `max_delayed`: beyond, requests are refused
    # even though their turn is within max_delay.
    cfg = {"rate_limits": [paced_rule(bucket={"rate": 5, "period": "1s", "burst": 1}, max_delay="10s",
                                      max_delayed=3)]}
    with PacedStack(cfg, concurrency=1) as s:
        got = burst_statuses(s.port, 10)
        assert sum(r.status == 200 for r in got) == 4, [r.status for r in got]  # one at once, 3 held


def test_held_requests_carry_the_rate_limit_headers_of_an_admitted_one():
    cfg = {"rate_limits": [paced_rule(bucket={"rate": 5, "period": "1s", "burst": 1})],
           "response": {"headers_on_allowed": True, "ratelimit_headers": "both"}}
    with PacedStack(cfg, concurrency=2) as s:
        c = http1.Conn(s.port)
        got = [c.request("/") for _ in range(3)]
        c.close()
        assert [r.status for r in got] == [200] * 3
        # The first at once, the next two held a turn each (200 ms): all
        # three admitted, all three told the same way where they stand.
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="pace", result="delayed"), 2)
        for r in got:
            assert (r.header("ratelimit-policy") or "").startswith('"pace";q=1;'), r.headers
            assert r.header("ratelimit") is not None and r.header("x-ratelimit-limit") == "1", r.headers


def test_a_held_requests_reset_counts_from_its_release_not_its_arrival():
    cfg = {"rate_limits": [paced_rule(bucket={"rate": 1, "period": "1s", "burst": 1})],
           "response": {"headers_on_allowed": True, "ratelimit_headers": "both"}}
    with PacedStack(cfg, concurrency=2) as s:
        got = burst_statuses(s.port, 3)  # turns at 0, 1 and 2 s
        assert [r.status for r in got] == [200] * 3
        # Each answered at its turn, with the bucket full 1 s later.
        assert [r.header("x-ratelimit-reset") for r in got] == ["1"] * 3, [r.headers for r in got]
        assert all(r.header("ratelimit").endswith(";t=1") for r in got), [r.headers for r in got]


def test_clients_that_leave_while_held_leave_nothing_behind():
    cfg = {"rate_limits": [paced_rule(bucket={"rate": 10, "period": "1s", "burst": 1})]}
    with PacedStack(cfg, concurrency=2) as s:
        # 20 requests, all but the first held (turns 100 ms apart); the
        # clients give up after 300 ms.
        socks = []
        for _ in range(20):
            k = socket.create_connection(("127.0.0.1", s.port))
            k.sendall(http1.build("/"))
            socks.append(k)
        time_passes(0.3)  # the clients give up
        for k in socks:
            k.close()
        s.front.wait_stat(metric("sluice_rl_held", rule="pace"), 0)
        # Those that left never reach the upstream: only the turns that came
        # before they left (0, 100, 200, 300 ms; one more at the edge).
        seen = len(s.up.stats()["arrivals"])
        assert 3 <= seen <= 5, seen
        time_passes(2.5)  # the abandoned turns (2 s in all) pass: none may reach the upstream
        assert len(s.up.stats()["arrivals"]) == seen
        # Once the abandoned turns have passed, the rate is whole again.
        got = burst_statuses(s.port, 3)
        assert [r.status for r in got] == [200] * 3
        assert s.front.settled_stat(metric("sluice_rl_held", rule="pace")) == 0


def test_held_requests_never_wait_past_their_deadline_and_carry_it_reduced():
    cfg = {"rate_limits": [paced_rule(bucket={"rate": 10, "period": "1s", "burst": 1})],
           "deadlines": {}}
    with PacedStack(cfg, concurrency=1) as s:
        # A deadline of 250 ms: turns at 0, 100, 200 ms fit, 300 ms does not.
        got = burst_statuses(s.port, 5, {"grpc-timeout": "250m"})
        assert sorted(r.status for r in got) == [200, 200, 200, 429, 429]
