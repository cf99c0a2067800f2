"""End to end: global rules. Several front Envoys (replicas, two workers
each) share one limit through the reference rate-limit service (rls/),
without a call on any request's path; a local backstop serves while the
service is down.
"""

import concurrent.futures
import sys
import threading
import time

import pytest

import http1
from harness import (ROOT, WASM, Envoy, free_port, front_bootstrap, metric, sluice_filter, time_passes,
                     upstream_bootstrap, wait_until)
from rls import Redis, RlsServer, rls_cluster, wait_out_window_edge

RLS_DOMAIN = "fleet"


def limits(per_unit, unit="hour", key="x-tenant"):
    return {"domain": RLS_DOMAIN,
            "descriptors": [{"key": key, "rate_limit": {"unit": unit, "requests_per_unit": per_unit}}]}


def plugin(limit, period="1h", instances=3, **global_fields):
    g = {"cluster": "rls", "domain": RLS_DOMAIN, "instances": instances}
    g.update(global_fields)
    return {"domain": "global-test",
            "rate_limits": [{"name": "per-tenant", "key": [{"header": "x-tenant"}],
                             "algorithm": "sliding_window",
                             "window": {"limit": limit, "period": period},
                             "global": g}]}


class Upstream(Envoy):
    def __init__(self):
        self.port = free_port()
        super().__init__(upstream_bootstrap(self.port, free_port()), concurrency=1)


def replica(upstream, rls_port, config, concurrency=2):
    port = free_port()
    boot = front_bootstrap(port, free_port(), upstream.port, [sluice_filter(config)])
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    e = Envoy(boot, concurrency=concurrency)
    e.port = port
    return e


def get(port, tenant, path="/"):
    return http1.get(port, path, {"x-tenant": tenant})


def wait_out_hour_edge(margin_s=30):
    """Sleeps into the next hour if fewer than `margin_s` seconds of this
    one are left: the requests of a test (at most about 15 s from here)
    then stay in one of the service's hour windows."""
    left = 3600 - time.time() % 3600
    if left < margin_s:
        time_passes(left + 0.5)  # into the next hour's window


def mode(envoy):
    return envoy.stat(metric("sluice_global_mode", domain="global-test", rule="per-tenant"))


def wait_mode(envoys, want, seconds):
    """Waits until every replica's global rule is in mode `want` (0:
    service, 1: backstop); returns the seconds it took."""
    t0 = time.time()
    wait_until(lambda: all(mode(e) == want for e in envoys), seconds,
               lambda: f"every replica in mode {want}: modes {[mode(e) for e in envoys]}", interval=0.1)
    took = time.time() - t0
    # The gauge leads a worker that has not ticked yet by up to one 100 ms
    # tick (docs/global.md): every worker of every replica has switched
    # once a tick has passed since.
    time_passes(0.2)
    return took


class Load:
    """Requests in a loop from a thread (a keep-alive client per replica,
    in turn) until stopped, a new key every 5 requests (so that tokens are
    always being fetched): every status and latency recorded."""

    def __init__(self, ports, tenant):
        self.ports, self.tenant = ports, tenant
        self.results = []  # (status, seconds)
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        conns = [http1.Conn(p) for p in self.ports]
        i = 0
        while not self.stop_flag.is_set() and len(self.results) < 20_000:
            t = time.perf_counter()
            r = conns[i % len(conns)].request("/", {"x-tenant": f"{self.tenant}-{i // 5}"})
            self.results.append((r.status, time.perf_counter() - t))
            i += 1
            time_passes(0.002)  # the load's pace
        for c in conns:
            c.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join(10)

    def latencies_ms(self):
        return sorted(s * 1000 for _, s in self.results)


def pct(xs, p):
    return xs[min(len(xs) - 1, int(len(xs) * p))] if xs else 0.0


def spread(ports, tenant, n, workers=8):
    """n requests for `tenant` over the replicas from `workers` threads;
    returns the statuses."""
    def one(i):
        return get(ports[i % len(ports)], tenant).status
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(n)))


# The documented worst case of under-admission (docs/global.md) for a key
# whose demand stays above its limit to the window's end: each replica
# loses at most one refused batch (at most half its share of what the
# service last said was left) and one refused hit.
def under_admission_bound(limit, instances):
    return limit // 2 + instances


def test_three_replicas_never_admit_more_than_the_global_limit():
    limit, instances = 300, 3
    with RlsServer(limits(limit)) as rls, Upstream() as up, \
            replica(up, rls.port, plugin(limit, instances=instances)) as a, \
            replica(up, rls.port, plugin(limit, instances=instances)) as b, \
            replica(up, rls.port, plugin(limit, instances=instances)) as c:
        wait_out_hour_edge()
        ports = [a.port, b.port, c.port]
        got = {t: spread(ports, t, 1000) for t in ("t1", "t2")}
        for t, statuses in got.items():
            admitted = statuses.count(200)
            assert set(statuses) <= {200, 429}, statuses
            assert admitted <= limit, (t, admitted)
            assert admitted >= limit - under_admission_bound(limit, instances), (t, admitted)
            print(f"{t}: admitted {admitted} of {len(statuses)} (limit {limit})")
        stats = rls.stats()
        # Every admitted request was granted first: the service counted at
        # least that many hits for the two keys.
        assert stats["hits"] >= sum(s.count(200) for s in got.values()), stats
        # Batches: far fewer calls than requests.
        assert stats["calls"] < 0.2 * 2000, stats
        # One VM per Envoy speaks to the service.
        for e in (a, b, c):
            e.wait_stat(metric("sluice_global_leader", domain="global-test"), 1)
        print("rls:", stats)


@pytest.mark.parametrize("outage", ["service", "redis"])
def test_an_outage_switches_every_replica_to_its_backstop_and_back(outage):
    limit, instances = 40, 2
    config = plugin(limit, instances=instances, breaker={"failures": 2, "cooldown": "2s"})
    with Redis() as redis:
        rls_args = {"store": "redis", "redis_url": redis.url} if outage == "redis" else {}
        rls = RlsServer(limits(limit), **rls_args).__enter__()
        try:
            with Upstream() as up, replica(up, rls.port, config) as a, replica(up, rls.port, config) as b:
                wait_out_hour_edge()
                ports = [a.port, b.port]
                spread(ports, "warm", 20, workers=2)
                with Load(ports, "steady") as load:
                    time_passes(0.5)  # the load runs before the outage
                    # The outage: the service, or the Redis under it.
                    (rls.__exit__() if outage == "service" else redis.stop())
                    took = wait_mode([a, b], 1, 10)
                    # Each replica now enforces its backstop: 40 / 2 = 20
                    # per hour for a key, whatever the other does.
                    for p in ports:
                        assert [get(p, "fresh").status for _ in range(30)].count(200) == 20
                    # The service comes back: the breaker's probe closes it.
                    if outage == "service":
                        rls = RlsServer(limits(limit), port=rls.port).__enter__()
                    else:
                        redis.start()
                    back = wait_mode([a, b], 0, 10)
                    time_passes(0.5)  # the load runs on after the recovery
                lat = load.latencies_ms()
                statuses = {s for s, _ in load.results}
                print(f"{outage}: backstop after {took:.1f}s, service again after {back:.1f}s; "
                      f"{len(lat)} requests under load, p50 {pct(lat, .5):.2f} ms p99 {pct(lat, .99):.2f} ms "
                      f"max {lat[-1]:.1f} ms")
                # No request failed or waited on the service.
                assert statuses <= {200, 429}, statuses
                assert pct(lat, 0.99) < 100, lat[-20:]
                # Tokens come from the service again.
                calls = rls.stats()["calls"]
                statuses = []
                for i in range(150):  # 1.5 s: the new key's first tokens come within a few ticks
                    statuses.append(get(ports[i % 2], "after").status)
                    time_passes(0.01)  # 150 requests over 1.5 s
                assert 0 < statuses.count(200) <= limit, statuses
                assert rls.stats()["calls"] > calls
        finally:
            rls.__exit__()


@pytest.mark.slow
def test_a_slow_service_does_not_slow_the_request_path():
    """The service answers in 50 ms: requests never wait for it. About a
    thousand requests a second, in batches of at most 300: calls are in
    flight while the requests are measured."""
    report = {}
    for delay in (0, 50):
        with RlsServer(limits(10_000_000), delay_ms=delay) as rls, Upstream() as up, \
                replica(up, rls.port, plugin(10_000_000, instances=1, max_batch=300)) as fe:
            conn = http1.Conn(fe.port)
            t_end = time.time() + 1.0
            while time.time() < t_end:  # warm, at the same pace: the key's first tokens, its rate
                conn.request("/", {"x-tenant": "hot"})
                time_passes(0.001)  # the pace: about a thousand a second
            calls0 = rls.stats()["calls"]
            lat, statuses = [], []
            for _ in range(1500):
                t = time.perf_counter()
                statuses.append(conn.request("/", {"x-tenant": "hot"}).status)
                lat.append((time.perf_counter() - t) * 1000)
                time_passes(0.001)  # the same pace
            conn.close()
            calls = rls.stats()["calls"] - calls0
            lat.sort()
            report[delay] = (pct(lat, .5), pct(lat, .99), calls / len(lat), sum(x >= 40 for x in lat))
            assert statuses.count(200) == len(statuses), delay
    for delay, (p50, p99, rpc, slow) in report.items():
        print(f"service delay {delay} ms: p50 {p50:.3f} ms, p99 {p99:.3f} ms, {rpc:.4f} calls per request, "
              f"{slow} over 40 ms")
    assert report[50][1] < 25, report
    # A request that waited for the 50 ms call would take more than 40 ms:
    # none does, beyond a rare scheduling stall. At least 4 calls are made
    # (each brings at most 300 tokens, 1,500 requests), so a request path
    # that waited for them would show at least 4 such requests. Comparing
    # the two runs' p99 within 5 ms was this check before; a loaded CI
    # runner's tail moves more than that.
    assert report[50][2] * 1500 >= 4, report
    assert report[50][3] <= 3, report
    assert report[0][2] < 0.05 and report[50][2] < 0.05, report


def first_admission_ms(port, tenant, budget_s=2.0):
    """Requests for a new key on one new connection, 1 ms apart, until the
    first is admitted: the milliseconds from the first request to it."""
    conn = http1.Conn(port)
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget_s:
            status = conn.request("/", {"x-tenant": tenant}).status
            assert status in (200, 429), status
            if status == 200:
                return (time.perf_counter() - t0) * 1000
            time_passes(0.001)  # 1 ms apart
        return budget_s * 1000
    finally:
        conn.close()


def test_a_new_keys_first_tokens_come_without_waiting_for_the_leaders_tick():
    """A new key is refused while its first batch is fetched (no request
    waits for the service). The VM that saw it reports it at once and wakes
    the leader through a shared queue, so the call goes out then, not on
    the leader's next tick (every 100 ms): the key's first admission comes
    a round trip later. Each key arrives on a new connection, so on either
    worker, the leader's or the other's."""
    with RlsServer(limits(100_000)) as rls, Upstream() as up, \
            replica(up, rls.port, plugin(100_000, instances=1)) as e:
        e.wait_stat(metric("sluice_global_leader", domain="global-test"), 1, timeout=10)
        first_admission_ms(e.port, "warm-up")  # the service's first call opens its connection
        waits = sorted(first_admission_ms(e.port, f"new-{k}") for k in range(16))
        print("ms from a new key's first request to its first admission:", [round(w) for w in waits])
        # Waiting for the leader's tick would spread these over 0-100 ms
        # and more (a third or so under 40 ms); woken, nearly all come
        # within a few milliseconds.
        assert sum(w < 40 for w in waits) >= 14, waits
        assert waits[-1] < 1000, waits


def test_a_key_seen_once_is_called_for_though_no_more_traffic_comes():
    """One request of a new key, refused while its first batch is fetched,
    then silence: the worker that saw it has no more traffic, yet its
    demand is reported and the leader calls for the key (the native build
    ticks a worker without traffic from Envoy's main thread); the key's
    requests are admitted once the answer is in."""
    with RlsServer(limits(100_000)) as rls, Upstream() as up, \
            replica(up, rls.port, plugin(100_000, instances=1)) as e:
        e.wait_stat(metric("sluice_global_leader", domain="global-test"), 1, timeout=10)
        calls = rls.stats()["calls"]
        assert get(e.port, "lonely").status == 429
        wait_until(lambda: rls.stats()["calls"] > calls, 2, "a call for the key, with no more requests")
        wait_until(lambda: get(e.port, "lonely").status == 200, 2, "the key's tokens")


def test_with_wait_for_tokens_a_new_keys_first_request_is_admitted():
    """`wait_for_tokens`: a request of a key whose first batch is being
    fetched waits for it, about a round trip, instead of being refused:
    every new key's first request is admitted, on either worker (a new
    connection each), well within the wait."""
    with RlsServer(limits(100_000)) as rls, Upstream() as up, \
            replica(up, rls.port, plugin(100_000, instances=1, wait_for_tokens="300ms")) as e:
        e.wait_stat(metric("sluice_global_leader", domain="global-test"), 1, timeout=10)
        get(e.port, "warm-up")  # the service's first call opens its connection
        got = []
        for k in range(20):
            t = time.perf_counter()
            status = get(e.port, f"first-{k}").status
            got.append((status, (time.perf_counter() - t) * 1000))
        print("status, ms of each new key's first request:", [(s, round(ms)) for s, ms in got])
        assert [s for s, _ in got] == [200] * 20, got
        assert max(ms for _, ms in got) < 300, got
        # The demand was counted once per request, and a call made per key.
        assert rls.stats()["calls"] >= 20


@pytest.mark.wasm_only("the wasm module's exports (test_native.py checks the native build's hooks)")
def test_the_module_keeps_the_callbacks_its_calls_need():
    """The export stripping keeps proxy_on_grpc_receive and
    proxy_on_grpc_close: without them Envoy never hands the service's
    answers to the module, silently; and proxy_on_queue_ready, without
    which the leader is never woken for a new key."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import strip_exports
    data = WASM.read_bytes()
    names = wasm_exports(data, strip_exports.leb)
    assert {"proxy_on_grpc_receive", "proxy_on_grpc_close", "proxy_on_queue_ready"} <= names, sorted(names)
    assert "proxy_on_request_body" not in names
    # Stripping again (idempotent) keeps them too.
    stripped, _ = strip_exports.strip(data)
    assert {"proxy_on_grpc_receive", "proxy_on_grpc_close",
            "proxy_on_queue_ready"} <= wasm_exports(stripped, strip_exports.leb)


def wasm_exports(data, leb):
    i, names = 8, set()
    while i < len(data):
        sid = data[i]
        size, body = leb(data, i + 1)
        if sid == 7:
            count, j = leb(data, body)
            for _ in range(count):
                n, k = leb(data, j)
                names.add(data[k:k + n].decode())
                _, j = leb(data, k + n + 1)
        i = body + size
    return names


@pytest.mark.parametrize("cost", [None, {"header": "x-cost", "max": 3}], ids=["cost-1", "cost-header"])
def test_a_key_over_its_limit_is_refused_until_the_services_reset(cost):
    """Once the service says a key is over its limit, the replica refuses it
    locally with Retry-After reaching the service's reset (never earlier),
    and stops calling for it; a key still filling its pool is told 1 s.
    With a cost header the smallest call is the dearest request's cost
    (`cost.max`): that one refused blocks the key as well."""
    limit = 5
    config = plugin(limit, period="1m", instances=1)
    if cost:
        config["rate_limits"][0]["cost"] = cost
    with RlsServer(limits(limit, unit="minute")) as rls, Upstream() as up, replica(up, rls.port, config) as fe:
        wait_out_window_edge(60, 15)
        got = []
        for _ in range(60):  # about 1.5 s: the pool is filled, spent, refused
            got.append((time.time(), get(fe.port, "t")))
            time_passes(0.02)  # 60 requests over about 1.5 s
        admitted = [r for _, r in got if r.status == 200]
        assert len(admitted) <= limit
        assert len(admitted) >= 1
        refused = [(t, r) for t, r in got if r.status == 429]
        starved = [r for _, r in refused if int(r.header("retry-after")) <= 2]
        assert starved, "the first requests wait for the key's first tokens"
        t, last = refused[-1]
        reset = 60 - t % 60
        assert reset <= int(last.header("retry-after")) <= reset + 2, (reset, last.headers)
        calls = rls.stats()["calls"]
        for _ in range(20):
            assert get(fe.port, "t").status == 429
            time_passes(0.02)  # 20 requests over about 0.5 s
        assert rls.stats()["calls"] == calls, "no call for a key blocked until the reset"


def test_requests_waiting_for_tokens_across_a_live_update_are_admitted():
    """`wait_for_tokens` across an ECDS update: the calls made for the
    waiting keys die with the old configuration; the waiting requests note
    their demand again while they wait, so the new leader calls for them
    and they are admitted, not refused when their wait runs out."""
    from ecds import EcdsStack
    config = plugin(1_000_000, instances=1, wait_for_tokens="1s", timeout="2s")
    with RlsServer(limits(1_000_000), delay_ms=300) as rls, \
            EcdsStack(config, clusters=[rls_cluster("rls", rls.port)]) as s:
        leader = metric("sluice_global_leader", domain="global-test")
        # As before: the test goes on after 5 s without a leader (the first
        # keys' requests then wait for one).
        try:
            s.front.wait_stat(leader, 1, timeout=5)
        except AssertionError:
            pass
        assert http1.get(s.port, "/", {"x-tenant": "warm"}).status in (200, 429)
        got, lock = [], threading.Lock()

        def one(k):
            t = time.time()
            r = http1.Conn(s.port, timeout=8).request("/", {"x-tenant": f"new-{k}"})
            with lock:
                got.append((r.status, time.time() - t))

        threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        # The update lands while the calls for the new keys are in flight
        # (the service answers in 300 ms): a time, not a condition.
        time_passes(0.15)
        s.push(dict(config, rate_limits=config["rate_limits"] + [
            {"name": "other", "match": {"path_prefix": "/other"}, "bucket": {"rate": 5, "period": "1s"}}]))
        assert s.wait_stat("update_success", 2)
        for t in threads:
            t.join(timeout=12)
        assert [g[0] for g in got] == [200] * 6, got
        assert max(g[1] for g in got) < 0.95, got


def test_a_live_update_keeps_one_leader_and_the_tokens_flowing():
    """ECDS replaces the configuration (the global rule unchanged, another
    rule added): the old configuration gives its lease up, one VM of the
    new one leads (the leader gauge sums to 1 again), keys already served
    keep their pools, and a new key gets tokens."""
    from ecds import EcdsStack
    config = plugin(1_000_000, instances=1)
    with RlsServer(limits(1_000_000)) as rls, \
            EcdsStack(config, clusters=[rls_cluster("rls", rls.port)]) as s:
        leader = metric("sluice_global_leader", domain="global-test")
        conn = http1.Conn(s.port)
        statuses = []
        deadline = time.time() + 5
        while time.time() < deadline and statuses[-50:] != [200] * 50:
            statuses.append(conn.request("/", {"x-tenant": "steady"}).status)
            time_passes(0.002)  # the key's pace
        assert statuses[-50:] == [200] * 50, statuses[-60:]
        s.front.wait_stat(leader, 1)
        updated = dict(config, rate_limits=config["rate_limits"] + [
            {"name": "other", "match": {"path_prefix": "/other"}, "bucket": {"rate": 5, "period": "1s"}}])
        s.push(updated)
        assert s.wait_stat("update_success", 2)
        # The held key keeps going through the update, at the same pace:
        # its pool is the unchanged rule's, and the new leader refills it.
        after = []
        for _ in range(400):
            after.append(conn.request("/", {"x-tenant": "steady"}))
            time_passes(0.002)  # the same pace through the update
        bad = [(i, r.status, r.body[:100]) for i, r in enumerate(after) if r.status != 200]
        assert not bad, bad
        conn.close()
        # A new key gets its first tokens from the new configuration's leader.
        got = []

        def admitted():
            got.append(http1.get(s.port, "/", {"x-tenant": "newcomer"}).status)
            return got[-1] == 200

        wait_until(admitted, 3, lambda: f"a new key's first tokens: {got}")
        s.front.wait_stat(leader, 1, timeout=3)  # one leader after the update
        assert rls.stats()["errors"] == 0
