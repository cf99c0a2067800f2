"""End to end: path spellings an upstream reads as /api/x cannot slip past a
rule on /api, whatever the connection manager's settings (here Envoy's
defaults: no normalize_path, no merge_slashes), for every mechanism that
matches on paths, and they share one bucket when the path is a key part."""

import threading

import http1
from harness import TRAFFIC_SEEN_S, Stack, wait_until

SPELLINGS = ["/%61pi/x", "/ap%69/x", "//api/x", "/./api/x", "/x/../api/x", "/api//x", "/%2e/api/x"]


def test_path_spellings_cannot_slip_past_rate_limits_breakers_or_shedders():
    cfg = {
        "rate_limits": [{"name": "rl", "match": {"path_prefix": "/api", "headers": [{"name": "x-m", "exact": "rl"}]},
                         "bucket": {"rate": 1, "period": "1h", "burst": 1}},
                        {"name": "keyed", "match": {"headers": [{"name": "x-m", "exact": "key"}]},
                         "key": ["path"], "bucket": {"rate": 1, "period": "1h", "burst": 1}},
                        {"name": "nocase", "match": {"path_prefix": "/api", "ignore_case": True,
                                                     "headers": [{"name": "x-m", "exact": "case"}]},
                         "bucket": {"rate": 1, "period": "1h", "burst": 1}}],
        "circuit_breakers": [{"name": "cb", "match": {"path_prefix": "/api", "headers": [{"name": "x-m", "exact": "cb"}]},
                              "min_requests": 2, "error_rate": 0.5, "open": {"base": "60s", "max": "60s"}}],
        "shedders": [{"name": "sh", "match": {"path_prefix": "/api", "headers": [{"name": "x-m", "exact": "sh"}]},
                      "concurrency": {"max": 1, "queue": 0}}],
    }
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        # Spend the bucket, trip the breaker, fill the shedder's one slot.
        assert c.request("/api/x", {"x-m": "rl"}).status == 200
        assert c.request("/api/x", {"x-m": "key"}).status == 200
        assert c.request("/API/x", {"x-m": "case"}).status == 200
        for _ in range(3):
            c.request("/api/x", {"x-m": "cb", "x-envoy-fault-abort-request": "503"})
        before = s.upstream_requests()
        slow = threading.Thread(target=http1.get, args=(s.port, "/api/slow"),
                                kwargs={"headers": {"x-m": "sh", "x-envoy-fault-delay-request": "3000"}})
        slow.start()
        wait_until(lambda: s.upstream_requests() > before, TRAFFIC_SEEN_S, "the slow request at the upstream")
        try:
            for p in SPELLINGS + ["/api/x"]:
                assert c.request(p, {"x-m": "rl"}).status == 429, p
                assert c.request(p, {"x-m": "key"}).status == 429, f"{p} got a bucket of its own"
                assert c.request(p, {"x-m": "cb"}).header("x-sluice-circuit") == "open", p
                assert c.request(p, {"x-m": "sh"}).header("x-sluice-shed") is not None, p
            for p in ["/api/x", "/Api/x", "/%41PI/x"]:
                assert c.request(p, {"x-m": "case"}).status == 429, p
        finally:
            slow.join(timeout=10)
