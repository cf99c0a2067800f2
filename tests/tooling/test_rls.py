"""End to end: the reference rate-limit service (rls/) speaks Envoy's RLS.

Envoy's own ratelimit filter (envoy.filters.http.ratelimit, API V3, over an
HTTP/2 cluster) is pointed at the server, with the in-memory store and with
Redis (Debian's redis-server on a free port): fixed windows of N per minute
per descriptor value, nested descriptors, a count shared across Envoys and
servers through Redis, hits_addend, an injected delay, and a Redis outage.
"""

import time

import pytest

import http1
from harness import Envoy, free_port, front_bootstrap, upstream_bootstrap
from rls import (Redis, RlsServer, header_action, limited_route, ratelimit_filter, rls_cluster,
                 wait_out_window_edge)

DOMAIN = "rls-test"
LIMITS = {
    "domain": DOMAIN,
    "descriptors": [
        {"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 3}},
        {"key": "tenant", "value": "gold",
         "descriptors": [{"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 5}}]},
        {"key": "tenant",
         "descriptors": [{"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 2}}]},
    ],
}
# /t: one descriptor (tenant, user); anything else: (user).
ROUTES = [
    limited_route([[header_action("x-tenant", "tenant"), header_action("x-user", "user")]], name="tenant")
    | {"match": {"prefix": "/t"}},
    limited_route([[header_action("x-user", "user")]]),
]


class Upstream(Envoy):
    def __init__(self):
        self.port = free_port()
        super().__init__(upstream_bootstrap(self.port, free_port()), concurrency=1)


def front(upstream, rls_port, routes=ROUTES, filters_before=(), **filter_fields):
    """A front Envoy with the native ratelimit filter (after
    `filters_before`), calling the RLS server on rls_port."""
    port = free_port()
    filters = list(filters_before) + [ratelimit_filter(DOMAIN, **filter_fields)]
    boot = front_bootstrap(port, free_port(), upstream.port, filters, routes)
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    e = Envoy(boot, concurrency=1)
    e.port = port
    return e


def get(port, path="/", **headers):
    return http1.get(port, path, headers)


def codes(port, n, path="/", **headers):
    return [get(port, path, **headers).status for _ in range(n)]


def test_memory_store_admits_exactly_n_per_minute_per_value():
    with RlsServer(LIMITS) as rls, Upstream() as up, front(up, rls.port) as fe:
        wait_out_window_edge()
        got = [get(fe.port, **{"x-user": "a"}) for _ in range(5)]
        assert [r.status for r in got] == [200, 200, 200, 429, 429]
        # The statuses' limit, remaining count and reset reach the client
        # through Envoy's draft-03 RateLimit headers.
        assert [r.header("x-ratelimit-remaining") for r in got] == ["2", "1", "0", "0", "0"]
        assert got[0].header("x-ratelimit-limit").startswith("3, 3;w=60"), got[0].headers
        assert 1 <= int(got[3].header("x-ratelimit-reset")) <= 60, got[3].headers
        assert got[3].header("x-envoy-ratelimited") == "true", got[3].headers
        # Another value has its own count.
        assert codes(fe.port, 4, **{"x-user": "b"}) == [200, 200, 200, 429]
        # Nested descriptors: a tenant's value first, then the key alone.
        assert codes(fe.port, 6, "/t", **{"x-tenant": "gold", "x-user": "a"}) == [200] * 5 + [429]
        assert codes(fe.port, 3, "/t", **{"x-tenant": "tin", "x-user": "a"}) == [200, 200, 429]
        # No x-user: Envoy builds no descriptor and makes no call.
        before = rls.stats()
        assert codes(fe.port, 5) == [200] * 5
        after = rls.stats()
        assert after["calls"] == before["calls"] == 5 + 4 + 6 + 3, after
        assert after["over_limit"] == 2 + 1 + 1 + 1 and after["errors"] == 0, after
        # Refused requests' hits are counted, as envoyproxy/ratelimit does.
        assert after["hits"] == 18, after
        # Envoy counts the answers under the route's cluster.
        assert fe.stat("cluster.upstream.ratelimit.over_limit") == 5
        assert fe.stat("cluster.upstream.ratelimit.ok") == 13


def test_unknown_descriptor_is_ok_without_limit():
    routes = [limited_route([[header_action("x-user", "nobody-limits-this")]])]
    with RlsServer(LIMITS) as rls, Upstream() as up, front(up, rls.port, routes) as fe:
        got = [get(fe.port, **{"x-user": "a"}) for _ in range(5)]
        assert [r.status for r in got] == [200] * 5
        assert got[0].header("x-ratelimit-limit") is None, got[0].headers
        assert rls.stats()["calls"] == 5 and rls.stats()["hits"] == 0


def test_redis_store_is_one_count_across_envoys_and_servers():
    """Two front Envoys on one server and a third on a second server, all
    counting in one Redis: 3 per minute for user a in total."""
    with Redis() as redis, \
            RlsServer(LIMITS, store="redis", redis_url=redis.url) as rls1, \
            RlsServer(LIMITS, store="redis", redis_url=redis.url) as rls2, \
            Upstream() as up, \
            front(up, rls1.port) as a, front(up, rls1.port) as b, front(up, rls2.port) as c:
        wait_out_window_edge()
        ports = [a.port, b.port, c.port] * 3
        got = [get(p, **{"x-user": "a"}).status for p in ports]
        assert got == [200, 200, 200] + [429] * 6, got
        assert codes(c.port, 4, **{"x-user": "b"}) == [200, 200, 200, 429]
        # The counter is envoyproxy/ratelimit's key, expiring with its
        # window; it holds the refused hits too.
        window = int(time.time()) // 60 * 60
        key = f"{DOMAIN}_user_a_{window}"
        assert redis.command("GET", key) == "9", redis.command("KEYS", "*")
        assert 0 < redis.command("TTL", key) <= 60
        assert rls1.stats()["calls"] == 6 and rls2.stats()["calls"] == 3 + 4


# Two ways Envoy 1.40 sends hits from a request header: a descriptor's own
# hits_addend (filter-level rate_limits with a format string), or the
# request's hits_addend from the `envoy.ratelimit.hits_addend` filter state.
BY_DESCRIPTOR = {"rate_limits": [{"actions": [header_action("x-user", "user")],
                                  "hits_addend": {"format": "%REQ(x-hits)%"}}]}
BY_REQUEST = {"filters_before": [{
    "name": "envoy.filters.http.set_filter_state",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
        "on_request_headers": [{"object_key": "envoy.ratelimit.hits_addend",
                                "format_string": {"text_format_source": {"inline_string": "%REQ(x-hits)%"}}}],
    },
}]}


@pytest.mark.parametrize("how", [BY_DESCRIPTOR, BY_REQUEST], ids=["descriptor", "request"])
def test_hits_addend_from_a_request_header(how):
    limits = {"domain": DOMAIN, "descriptors": [{"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 10}}]}
    routes = [limited_route([[header_action("x-user", "user")]])]
    with RlsServer(limits) as rls, Upstream() as up, front(up, rls.port, routes, **how) as fe:
        wait_out_window_edge()
        got = [get(fe.port, **{"x-user": "a", "x-hits": "4"}) for _ in range(3)]
        assert [r.status for r in got] == [200, 200, 429]
        assert [r.header("x-ratelimit-remaining") for r in got] == ["6", "2", "0"]
        # 12 of 10 counted: the refused hits stay, one more hit is over.
        assert get(fe.port, **{"x-user": "a", "x-hits": "1"}).status == 429
        assert get(fe.port, **{"x-user": "b", "x-hits": "10"}).status == 200
        assert get(fe.port, **{"x-user": "b", "x-hits": "1"}).status == 429
        assert rls.stats()["hits"] == 4 * 3 + 1 + 10 + 1


def timed(port, **headers):
    t0 = time.monotonic()
    r = get(port, **headers)
    return r.status, time.monotonic() - t0


def test_injected_delay_holds_each_request():
    with RlsServer(LIMITS, delay_ms=50) as rls, Upstream() as up, \
            front(up, rls.port) as fe, front(up, rls.port, timeout="0.02s") as short:
        wait_out_window_edge()
        got = [timed(fe.port, **{"x-user": "a"}) for _ in range(4)]
        assert [s for s, _ in got] == [200, 200, 200, 429], got
        assert min(t for _, t in got) >= 0.05, got
        # Envoy's default RLS timeout (20 ms) is shorter than the delay: the
        # call is an error, the request is let through after the timeout
        # (Envoy's timer was seen firing up to 2 ms early).
        got = [timed(short.port, **{"x-user": "z"}) for _ in range(5)]
        assert [s for s, _ in got] == [200] * 5, got
        assert all(0.015 <= t < 0.05 + 0.5 for _, t in got), got
        assert short.stat("cluster.upstream.ratelimit.error") == 5
        assert short.stat("cluster.upstream.ratelimit.failure_mode_allowed") == 5


def test_redis_down_fails_open_by_default_and_recovers():
    with Redis() as redis, RlsServer(LIMITS, store="redis", redis_url=redis.url) as rls, Upstream() as up, \
            front(up, rls.port) as open_, front(up, rls.port, failure_mode_deny=True) as closed:
        wait_out_window_edge()
        assert codes(open_.port, 4, **{"x-user": "a"}) == [200, 200, 200, 429]
        redis.stop()
        # The server answers gRPC errors; Envoy lets requests through
        # (failure_mode_deny: false, the default) or refuses them with 500.
        t0 = time.monotonic()
        assert codes(open_.port, 5, **{"x-user": "a"}) == [200] * 5
        assert codes(closed.port, 3, **{"x-user": "a"}) == [500] * 3
        assert time.monotonic() - t0 < 5
        stats = rls.stats()
        assert stats["errors"] == 8 and stats["calls"] == 4 + 8, stats
        assert open_.stat("cluster.upstream.ratelimit.error") == 5
        assert open_.stat("cluster.upstream.ratelimit.failure_mode_allowed") == 5
        assert closed.stat("cluster.upstream.ratelimit.error") == 3
        assert "counter store (redis)" in rls.logs(), rls.logs()
        # Redis back (empty) on the same port: the server reconnects and counts again.
        redis.start()
        assert codes(open_.port, 4, **{"x-user": "a"}) == [200, 200, 200, 429]
        assert rls.stats()["errors"] == 8
