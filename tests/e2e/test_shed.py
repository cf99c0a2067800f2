"""End to end: load shedding by queue latency in a real Envoy with 2
workers, in front of an upstream that serves 4 requests at a time, 20 ms
each (about 200 requests/s), driven past its capacity by 16 clients."""

import json
import re
import threading
import time

import pytest

import http1
from harness import (Envoy, FrontOf, SlowUpstream, assert_burst_within_limit, free_port, front_bootstrap, metric,
                     sluice_filter, time_passes, wait_until)

SLOW_MS = 20


def SlowStack(plugin_config, concurrency=2):
    """The limited upstream (a child process) and a front Envoy."""
    return FrontOf(SlowUpstream(4, SLOW_MS), plugin_config, concurrency)


def load(port, seconds, clients=16, headers_for=lambda i: {}, abandon_every=0):
    """Closed-loop load: each client sends requests back to back for
    `seconds`. Returns (status, latency_s, client, x-sluice-shed, started_s)
    per request. With
    `abandon_every`, every n-th request of a client is abandoned mid-flight
    (its connection closed before the answer)."""
    results = []
    lock = threading.Lock()
    start = time.time()
    stop = start + seconds

    def client(i):
        c = http1.Conn(port)
        n = 0
        while time.time() < stop:
            n += 1
            h = headers_for(i)
            if abandon_every and n % abandon_every == 0:
                c.sock.sendall(http1.build("/", h))
                time_passes(0.002)  # mid-flight: the client leaves
                c.close()
                c = http1.Conn(port)
                continue
            t = time.time()
            r = c.request("/", h)
            with lock:
                results.append((r.status, time.time() - t, i, r.header("x-sluice-shed"), t - start))
            if r.header("connection") == "close":
                c.close()
                c = http1.Conn(port)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def p99(latencies):
    xs = sorted(latencies)
    return xs[int(len(xs) * 0.99)] if xs else 0.0


QUEUE = {"name": "api", "concurrency": {"max": 4, "queue": 64, "max_wait": "500ms"},
         "priority": {"header": "x-priority"}, "target": "5ms", "interval": "100ms"}


def test_admitted_latency_stays_near_the_floor_under_overload_while_it_grows_without_sluice():
    with SlowStack(None) as s:
        without = load(s.port, 3)
    with SlowStack({"shedders": [QUEUE]}) as s:
        with_sluice = load(s.port, 3, headers_for=lambda i: {"x-tenant": "t"})
        stats = s.upstream_stats()
        assert stats["max_in_flight"] <= 4
        s.front.wait_stat(metric("sluice_shed_total", shedder="api", priority="default"), lambda v: v > 0)
    # The floor is the upstream's service time as it was on this machine in
    # this run (20 ms asleep, more on a loaded machine), not the nominal one.
    floor = p99([end - start for start, end, gone in stats["tenants"]["t"]["intervals"] if not gone])
    # Sustained overload: the first half second (CoDel's first intervals) aside.
    base = p99([r[1] for r in without if r[0] == 200 and r[4] > 0.5])
    admitted = [r[1] for r in with_sluice if r[0] == 200 and r[4] > 0.5]
    shed = [r for r in with_sluice if r[0] == 503]
    ours = p99(admitted)
    print(f"p99 without sluice {base * 1000:.1f} ms, with sluice {ours * 1000:.1f} ms "
          f"({len(admitted)} admitted, {len(shed)} shed), upstream service p99 {floor * 1000:.1f} ms")
    # 16 clients on 4 slots: without sluice every request waits for about 3
    # others (~80 ms); with sluice, admitted requests wait about the target.
    assert base > 0.060
    assert ours < base / 2
    assert SLOW_MS / 1000 <= floor
    # Floor + target + slack for a loaded machine: CI's ran the admitted
    # requests at 59.6 ms (its upstream served 150/s, not 200), where a
    # shedder that queued without shedding would give 16 clients / 4 slots
    # x 20 ms = 80 ms or more.
    assert ours < floor + 0.005 + 0.040
    assert all(r[3] == "default" for r in shed)
    # Goodput is kept: the upstream stays busy.
    assert len(admitted) >= 0.7 * len([1 for r in without if r[0] == 200 and r[4] > 0.5])


def test_sheddable_work_is_shed_before_critical_work_and_shedding_stops_afterwards():
    classes = ["sheddable", "critical"]
    with SlowStack({"shedders": [QUEUE]}) as s:
        got = load(s.port, 3, headers_for=lambda i: {"x-priority": classes[i % 2]})
        by = {c: [r for r in got if r[2] % 2 == classes.index(c)] for c in classes}
        shed_rate = {c: sum(1 for r in by[c] if r[0] == 503) / max(1, len(by[c])) for c in classes}
        critical_p99 = p99([r[1] for r in by["critical"]])
        print("shed rate", shed_rate, f"critical p99 {critical_p99 * 1000:.1f} ms")
        assert shed_rate["sheddable"] > 0.5
        assert shed_rate["critical"] < 0.05
        # 8 critical clients on 4 slots wait about one request (20 ms) each,
        # whichever worker their connection is on: a slot that frees on
        # one worker goes to the oldest waiter on either (a worker that
        # kept its own slots starved the other's clients until max_wait).
        assert critical_p99 < 0.2
        assert shed_rate["sheddable"] > 10 * shed_rate["critical"]
        # Load drops: shedding stops by itself, within half a second.
        time_passes(0.5)
        c = http1.Conn(s.port)
        quiet = [c.request("/", {"x-priority": "sheddable"}).status for _ in range(10)]
        assert quiet == [200] * 10
        s.front.wait_stat(metric("sluice_shed_overloaded_workers", shedder="api"), 0)


def test_no_slot_leaks_whatever_way_requests_end():
    cfg = {"shedders": [QUEUE]}
    with SlowStack(cfg) as s:
        load(s.port, 2, abandon_every=3)  # a third of the requests abandoned mid-flight
        gauges = [metric("sluice_shed_in_flight", shedder="api"), metric("sluice_shed_queued", shedder="api")]
        wait_until(lambda: not any(s.front.stat(g) for g in gauges), 5, "the shedder's gauges back to 0", interval=0.05)
        assert [s.front.settled_stat(g) for g in gauges] == [0, 0]
        # All 4 slots are really free: 4 concurrent requests pass without queueing.
        got = http1.burst(s.port, [[http1.build("/")] for _ in range(4)])
        assert [b[0].status for b in got] == [200] * 4
        h = s.front.admin("/stats?filter=sluice_shed_queue_ms")
        assert "sluice_shed_queue_ms" in h


def test_a_request_waiting_past_max_wait_gets_503_not_a_hang():
    cfg = {"shedders": [dict(QUEUE, concurrency={"max": 1, "queue": 10, "max_wait": "100ms"})]}
    with SlowStack(cfg) as s:
        slow = {"x-priority": "critical"}
        batches = [[http1.build("/", slow)] for _ in range(8)]
        t = time.time()
        got = [b[0] for b in http1.burst(s.port, batches)]
        assert time.time() - t < 2
        statuses = sorted(r.status for r in got)
        assert 200 in statuses and 503 in statuses
        shed = [r for r in got if r.status == 503]
        assert all(r.header("x-sluice-shed") == "critical" for r in shed)
        body = json.loads(shed[0].body)
        assert body["error"] == "overloaded" and body["shedder"] == "api"
        assert int(shed[0].header("retry-after")) >= 1


def test_latency_mode_sheds_sheddable_work_when_upstream_latency_rises():
    cfg = {"shedders": [{"name": "lat", "priority": {"header": "x-priority"},
                         "latency": {"floor_window": "30s"}, "target": "5ms", "interval": "100ms"}]}
    classes = ["sheddable", "critical"]
    with SlowStack(cfg) as s:
        c = http1.Conn(s.port)
        for _ in range(20):  # learn the no-load floor (~20 ms)
            assert c.request("/").status == 200
        got = load(s.port, 3, headers_for=lambda i: {"x-priority": classes[i % 2]})
        shed = [r for r in got if r[0] == 503]
        assert shed, "no shedding under 4x overload"
        assert all(r[3] == "sheddable" for r in shed)
        assert s.front.settled_stat(metric("sluice_shed_total", shedder="lat", priority="critical")) == 0


def test_requests_sluice_sheds_are_not_upstream_failures_for_a_breaker():
    cfg = {"circuit_breakers": [{"name": "up", "min_requests": 5, "error_rate": 0.2}],
           "shedders": [{"name": "tight", "concurrency": {"max": 1, "queue": 2, "max_wait": "50ms"}}]}
    with SlowStack(cfg) as s:
        got = [b[0] for b in http1.burst(s.port, [[http1.build("/")] for _ in range(12)])]
        shed = [r for r in got if r.status == 503 and r.header("x-sluice-shed")]
        assert len(shed) >= 5, [r.status for r in got]
        # Most requests were answered 503 by sluice itself, yet the breaker,
        # which trips at 20% errors, saw only the upstream's successes.
        assert s.front.settled_stat(metric("sluice_cb_transitions_total", breaker="up", transition="opened")) == 0
        assert [http1.get(s.port).status for _ in range(3)] == [200] * 3


def test_with_leased_slots_the_limit_still_holds_across_workers_and_nothing_leaks():
    """From a limit of 64, each worker leases a few slots ahead of need (see
    the README): the limit must still hold across the 2 workers, and the
    leases must come back, burst after burst."""
    cfg = {"shedders": [{"name": "wide", "concurrency": {"max": 64, "queue": 0}}]}
    port = free_port()
    # An upstream that serves up to 200 at once, 300 ms each: requests overlap.
    with SlowUpstream(200, 300) as up, \
            Envoy(front_bootstrap(port, free_port(), up.port, [sluice_filter(cfg)]), 2) as front:
        # Light load first: both workers lease slots.
        c = http1.Conn(port)
        assert [c.request("/").status for _ in range(5)] == [200] * 5
        c.close()
        for _ in range(3):
            assert_burst_within_limit(port, 64)
            # Ticks: the leases go back (nothing shows when: the gauges
            # count requests, not leases).
            time_passes(0.3)
            front.wait_stat(metric("sluice_shed_in_flight", shedder="wide"), 0)
        assert up.stats()["max_in_flight"] <= 64



def test_latency_mode_overload_holds_while_everything_is_shed():
    """An upstream that slowed to 200 ms, all traffic sheddable: once
    overloaded, intervals in which everything was shed (so no response
    measured the delay) must not end the overload. One probe per interval
    per worker still goes through, to see a recovery."""
    from harness import Stack
    cfg = {"shedders": [{"name": "lat", "priority": {"default": "sheddable"},
                         "latency": {"floor_window": "30s"}, "target": "5ms", "interval": "100ms"}]}
    slow = {"x-envoy-fault-delay-request": "200"}
    with Stack(cfg) as s:
        # Each worker learns its own no-load floor (about 1 ms): a worker
        # whose first response is already slow takes that for its floor.
        for conns in connections_by_worker(s, {0: 1, 1: 1}).values():
            for c in conns:
                for _ in range(10):
                    assert c.request("/").status == 200
                c.close()
        got = load(s.port, 3, clients=8, headers_for=lambda i: slow)
    first = min((r[4] for r in got if r[0] == 503), default=None)
    assert first is not None, "no shedding with the upstream 200 ms over its floor"
    after = [r for r in got if r[4] >= first + 0.3]
    shed = sum(1 for r in after if r[0] == 503) / max(1, len(after))
    assert shed >= 0.9, f"only {shed:.0%} shed at full overload"
    # No 200 ms window in which the filter let everything in again.
    windows = {}
    for r in after:
        windows.setdefault(int(r[4] / 0.2), []).append(r[0])
    admitted = {w: v.count(200) / len(v) for w, v in windows.items() if len(v) >= 10}
    assert max(admitted.values(), default=0) < 0.5, admitted


def test_latency_mode_probes_once_an_interval_while_all_is_shed():
    """One connection (one worker), all traffic sheddable, the upstream
    40 ms over its floor: while everything else is shed, a probe goes
    through in every 100 ms interval, though each is answered within the
    interval it went out in (and so measured it)."""
    from harness import Stack
    cfg = {"shedders": [{"name": "lat", "priority": {"default": "sheddable"},
                         "latency": {"floor_window": "30s"}, "target": "5ms", "interval": "100ms"}]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        for _ in range(20):
            assert c.request("/").status == 200
        slow = {"x-envoy-fault-delay-request": "40"}
        got, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 3.0:
            got.append((time.monotonic() - t0, c.request("/", slow).status))
        c.close()
    first = min((t for t, st in got if st == 503), default=None)
    assert first is not None, "no shedding with the upstream 40 ms over its floor"
    late = [(t, st) for t, st in got if t >= first + 0.3]
    span = late[-1][0] - late[0][0]
    passed = sum(1 for _, st in late if st == 200)
    # One per interval; at most one more where an interval boundary falls.
    assert 0.8 * span * 10 <= passed <= span * 10 + 2, (passed, round(span, 2))


def connections_by_worker(s, want, limit=200):
    """Opens keep-alive connections until `want` = {worker: n} are placed;
    which worker took a connection shows in its listener stats."""
    got = {w: [] for w in want}
    extra = []
    key = lambda w: f"listener.127.0.0.1_{s.port}.worker_{w}.downstream_cx_total"
    for _ in range(limit):
        if all(len(got[w]) >= n for w, n in want.items()):
            break
        before = {w: s.front.stat(key(w)) for w in want}
        c = http1.Conn(s.port)
        c.request("/warm")
        after = {w: s.front.stat(key(w)) for w in want}
        w = next((w for w in want if after[w] > before[w]), None)
        (got[w] if w is not None and len(got[w]) < want[w] else extra).append(c)
    for c in extra:
        c.close()
    assert all(len(got[w]) >= n for w, n in want.items()), {w: len(v) for w, v in got.items()}
    return got


def test_a_quiet_workers_sheddable_waiters_are_shed_while_the_shared_queue_stands():
    """One worker saturates the shared queue with critical work; sheddable
    requests that land on the other, quiet, worker must be shed within about
    an interval, not wait out max_wait: the decision reflects the shared
    queue whichever worker a request lands on."""
    from harness import Stack
    cfg = {"shedders": [{"name": "q", "match": {"path_prefix": "/api"},
                         "concurrency": {"max": 2, "queue": 64, "max_wait": "1s"},
                         "priority": {"header": "x-priority"}, "target": "5ms", "interval": "100ms"}]}
    with Stack(cfg) as s:
        conns = connections_by_worker(s, {0: 6, 1: 1})
        stop = time.time() + 4
        busy_h = {"x-priority": "critical", "x-envoy-fault-delay-request": "100"}

        def busy(c):
            while time.time() < stop:
                c.request("/api/busy", busy_h)

        threads = [threading.Thread(target=busy, args=(c,)) for c in conns[0]]
        for t in threads:
            t.start()
        time_passes(1.0)  # the shared queue stands: 6 clients, 2 slots, 100 ms each
        quiet = conns[1][0]
        waits = []
        for _ in range(8):
            t = time.time()
            r = quiet.request("/api/quiet", {"x-priority": "sheddable"})
            waits.append((r.status, time.time() - t))
            time_passes(0.05)  # the quiet worker's requests, 50 ms apart
        for t in threads:
            t.join()
        for c in conns[0] + conns[1]:
            c.close()
    shed = [w for st, w in waits if st == 503]
    assert len(shed) >= 6, waits
    assert max(shed) < 0.4, f"a sheddable waiter on the quiet worker waited {max(shed):.3f} s: {waits}"


def worker_connections(envoy):
    """Connections each worker of `envoy` has accepted so far."""
    out = {}
    for name, value in envoy.stats().items():
        m = re.match(r"^listener\.127\.0\.0\.1_\d+\.worker_(\d+)\.downstream_cx_total$", name)
        if m:
            out[int(m.group(1))] = value
    return out


def connections_on_workers(port, envoy, want):
    """Opens keep-alive connections until worker w has want[w] of them
    (Envoy picks the worker; Envoy's per-worker counters tell which)."""
    got = {w: [] for w in want}
    spare = []
    while any(len(got[w]) < n for w, n in want.items()):
        before = worker_connections(envoy)
        c = http1.Conn(port)
        c.request("/ping", {})
        after = worker_connections(envoy)
        w = next(k for k in after if after[k] != before.get(k, 0))
        (got[w] if w in got and len(got[w]) < want[w] else spare).append(c)
        assert len(spare) < 200, "Envoy never gave the connections to the workers wanted"
    for c in spare:
        c.close()
    return got


@pytest.mark.slow
def test_shares_hold_however_each_class_is_spread_over_the_workers():
    """Shares 50/50 under overload from clients held on chosen workers: a
    class whose clients sit on both workers gets no more than one whose
    clients sit on one (67/33 were each worker to keep its own turns)."""
    config = {"shedders": [{"name": "api", "priority": {"header": "x-priority",
              "shares": {"critical": 50, "default": 50, "sheddable": 0}},
              "concurrency": {"max": 2, "queue": 100, "max_wait": "2s"}}]}
    for layout in ({"critical": (2, 2), "default": (2, 0)}, {"critical": (4, 0), "default": (1, 1)}):
        with FrontOf(SlowUpstream(2, 20), config) as s:
            want = {w: sum(v[w] for v in layout.values()) for w in (0, 1)}
            conns = connections_on_workers(s.port, s.front, want)
            clients = []
            for w in (0, 1):
                left = iter(conns[w])
                for cls, spread in layout.items():
                    clients += [(next(left), cls) for _ in range(spread[w])]
            results = []
            lock = threading.Lock()
            stop = time.time() + 3

            def loop(conn, cls):
                while time.time() < stop:
                    status = conn.request("/", {"x-priority": cls}).status
                    with lock:
                        results.append((cls, status, time.time()))

            threads = [threading.Thread(target=loop, args=c) for c in clients]
            t0 = time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            for c, _ in clients:
                c.close()
            assert {st for _, st, _ in results} == {200}, results[:5]
            late = [cls for cls, _, t in results if t - t0 > 0.5]
            critical = 100 * late.count("critical") / len(late)
            print(layout, f"critical {critical:.0f}% of {len(late)} admitted")
            assert 42 <= critical <= 58, (layout, critical)


def test_a_request_queued_at_one_shedder_still_passes_the_later_ones():
    """Two shedders match /n: `wide` (max 4, a queue) and `narrow` (max 1, a
    short queue). A request that waited in wide's queue goes through
    narrow's limit when it leaves it, as on arrival: never more than one /n
    in flight at the upstream, and every slot back at the end."""
    sh = [{"name": "wide", "priority": {"default": "critical"},
           "concurrency": {"max": 4, "queue": 50, "max_wait": "3s"}},
          {"name": "narrow", "match": {"path_prefix": "/n"}, "priority": {"default": "critical"},
           "concurrency": {"max": 1, "queue": 4, "max_wait": "2s"}}]
    with FrontOf(SlowUpstream(100, 100), {"shedders": sh}) as s:
        batches = [[http1.build("/n", {"x-tenant": "n"})] for _ in range(12)]
        batches += [[http1.build("/w", {"x-tenant": "w"})] for _ in range(6)]
        got = [b[0] for b in http1.burst(s.port, batches)]
        st = s.upstream_stats()["tenants"]
        assert st["n"]["peak"] == 1, st
        assert st["w"]["peak"] <= 4, st
        statuses = [r.status for r in got]
        # Some /n wait their turn and go (a queue of 4 per worker, 100 ms
        # each, within 2 s); the rest are shed: none fails otherwise.
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 6, statuses
        assert all(r.status == 200 for r in got[12:]), statuses[12:]
        for name in ("wide", "narrow"):
            s.front.wait_stat(metric("sluice_shed_in_flight", shedder=name), 0)
            s.front.wait_stat(metric("sluice_shed_queued", shedder=name), 0)
