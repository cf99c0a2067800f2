"""End to end: the built sluice.wasm in a real Envoy with several workers,
in front of a real upstream Envoy."""

import json
import math
import time

import pytest

import http1
from harness import Stack, metric, time_passes

HOUR = {"rate": 1, "period": "1h"}


def rule(name, burst, key=None, **extra):
    r = {"name": name, "bucket": dict(HOUR, burst=burst)}
    if key is not None:
        r["key"] = key
    r.update(extra)
    return r


def statuses(responses):
    return [r.status for r in responses]


def test_429_after_the_burst_with_body_and_headers():
    cfg = {"rate_limits": [rule("per-key", 3, [{"header": "x-key"}])],
           "response": {"headers_on_allowed": True, "retry_after_jitter": "0s"}}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        got = [c.request("/", {"x-key": "a"}) for _ in range(5)]
        assert statuses(got) == [200, 200, 200, 429, 429]
        assert [r.header("x-ratelimit-remaining") for r in got[:3]] == ["2", "1", "0"]
        assert got[0].header("x-ratelimit-limit") == "3"
        assert got[0].header("ratelimit-policy") == '"per-key";q=3;w=10800'
        assert got[1].header("ratelimit") == '"per-key";r=1;t=7200'
        refused = got[3]
        body = json.loads(refused.body)
        assert body["rule"] == "per-key" and body["error"] == "rate_limited"
        # The next token comes in one hour: the wait is exact, Retry-After is
        # not earlier than it, and the headers agree with Retry-After.
        assert 3_599_000 <= body["retry_after_ms"] <= 3_600_000
        assert refused.header("retry-after") == "3600"
        assert refused.header("x-ratelimit-remaining") == "0"
        assert refused.header("x-ratelimit-reset") == "3600"
        assert refused.header("ratelimit") == '"per-key";r=0;t=3600'
        assert refused.header("content-type") == "application/json"
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="per-key", result="allowed"), 3)
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="per-key", result="limited"), 2)
        prom = s.front.admin("/stats/prometheus")
        assert 'sluice_rl_requests_total{domain="default",rule="per-key",result="limited"} 2' in prom


def test_tokens_refill_over_time():
    cfg = {"rate_limits": [{"name": "fast", "bucket": {"rate": 2, "period": "1s", "burst": 2}}]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request() for _ in range(3)]) == [200, 200, 429]
        time_passes(0.6)  # one token every 500 ms: one is back, the next is 400 ms away
        assert statuses([c.request() for _ in range(2)]) == [200, 429]
        time_passes(1.1)  # two more tokens: the bucket is full again
        assert statuses([c.request() for _ in range(3)]) == [200, 200, 429]


def test_each_key_has_its_own_bucket():
    cfg = {"rate_limits": [rule("tenant", 2, [{"header": "x-tenant"}])]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request("/", {"x-tenant": "a"}) for _ in range(3)]) == [200, 200, 429]
        assert statuses([c.request("/", {"x-tenant": "b"}) for _ in range(3)]) == [200, 200, 429]
        # Without the key part the rule does not apply (on_missing_key: skip).
        assert statuses([c.request("/") for _ in range(5)]) == [200] * 5


def test_missing_key_parts_can_share_one_bucket():
    cfg = {"rate_limits": [rule("tenant", 2, [{"header": "x-tenant"}], on_missing_key="shared")]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request("/") for _ in range(3)]) == [200, 200, 429]
        assert c.request("/", {"x-tenant": ""}).status == 200


def test_layered_rules_spend_no_token_on_rejection():
    cfg = {"rate_limits": [rule("global", 5), rule("tenant", 2, [{"header": "x-tenant"}])]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request("/", {"x-tenant": "a"}) for _ in range(6)]) == [200, 200] + [429] * 4
        # Only 2 of global's 5 tokens were spent: 3 more tenants pass, then global refuses.
        got = [c.request("/", {"x-tenant": f"t{i}"}) for i in range(4)]
        assert statuses(got) == [200, 200, 200, 429]
        assert json.loads(got[3].body)["rule"] == "global"


def test_match_limits_only_matching_requests():
    cfg = {"rate_limits": [rule("login", 1, match={"path": "/login", "methods": ["POST"]})]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert c.request("/login?x=1", method="POST").status == 200
        assert c.request("/login", method="POST").status == 429
        assert c.request("/login").status == 200
        assert c.request("/other", method="POST").status == 200


def test_shadow_mode_counts_but_never_rejects():
    cfg = {"rate_limits": [rule("trial", 2, shadow=True)]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request() for _ in range(6)]) == [200] * 6
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="trial", result="shadow_limited"), 4)
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="trial", result="allowed"), 2)


def test_request_cost_from_a_header():
    cfg = {"rate_limits": [rule("cost", 10, cost={"header": "x-cost", "max": 6})]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert c.request("/", {"x-cost": "6"}).header("x-ratelimit-remaining") is None
        r = c.request("/", {"x-cost": "999"})  # clamped to 6: only 4 left
        assert r.status == 429
        assert c.request("/", {"x-cost": "garbage"}).status == 200  # default cost 1
        assert c.request("/", {"x-cost": "3"}).status == 200
        assert c.request("/").status == 429


def test_retry_after_is_spread_by_jitter_and_never_early():
    cfg = {"rate_limits": [{"name": "r", "bucket": {"rate": 1, "period": "10s", "burst": 1}}],
           "response": {"retry_after_jitter": "5s"}}
    with Stack(cfg, concurrency=2) as s:
        assert http1.get(s.port).status == 200
        batches = [[http1.build()] * 10 for _ in range(10)]
        got = [r for batch in http1.burst(s.port, batches) for r in batch]
        assert statuses(got) == [429] * 100
        values = []
        for r in got:
            wait_s = json.loads(r.body)["retry_after_ms"] / 1000
            ra = int(r.header("retry-after"))
            assert ra >= math.ceil(wait_s) and ra >= 1
            assert ra <= math.ceil(wait_s + 5)
            values.append(ra)
        # 100 clients refused at the same instant are not told the same second.
        assert len(set(values)) >= 4, values


@pytest.mark.parametrize("rule", [
    {"name": "bucket", "bucket": {"rate": 1, "period": "1s", "burst": 1}},
    {"name": "window", "algorithm": "sliding_window", "window": {"limit": 1, "period": "1s"}},
], ids=["token-bucket", "sliding-window"])
def test_clients_refused_together_at_the_default_jitter_come_back_spread_out(rule):
    """100 clients refused within a few milliseconds, default jitter (1 s):
    waits of a whole second or just under are the common case, and the
    jitter still spreads them over whole seconds; none is told to come back
    before it could pass."""
    with Stack({"rate_limits": [rule]}, concurrency=2) as s:
        assert http1.get(s.port).status == 200
        got = [r for batch in http1.burst(s.port, [[http1.build()] for _ in range(100)]) for r in batch]
        assert statuses(got) == [429] * 100
        values = []
        for r in got:
            ra = int(r.header("retry-after"))
            assert ra * 1000 >= json.loads(r.body)["retry_after_ms"], (ra, r.body)
            values.append(ra)
        counts = {v: values.count(v) for v in set(values)}
        assert len(counts) >= 2 and max(counts.values()) <= 90, counts


def test_grpc_requests_get_resource_exhausted():
    cfg = {"rate_limits": [rule("grpc", 1)]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        h = {"content-type": "application/grpc", "te": "trailers"}
        assert c.request("/pkg.Svc/Method", h, method="POST").status == 200
        r = c.request("/pkg.Svc/Method", h, method="POST")
        assert r.status == 200
        assert r.header("grpc-status") == "8"
        assert "rate limited" in r.header("grpc-message")
        assert r.header("content-type") == "application/grpc"


def test_hostile_headers_never_break_the_filter():
    cfg = {"rate_limits": [rule("k", 2, [{"header": "x-key"}, "client_address", "path", "authority"],
                                cost={"header": "x-cost"})]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        raw = [
            b"GET / HTTP/1.1\r\nHost: t\r\nx-key: \xff\xfe\x80\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: t\r\nx-key: a\r\nx-key: b\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: t\r\nx-key: " + b"z" * 50_000 + b"\r\nx-cost: 1e9\r\n\r\n",
            b"GET /%00%ff?q=%ff HTTP/1.1\r\nHost: t\r\nx-cost: -1\r\n\r\n",
        ]
        for req in raw:
            assert c.send_all([req])[0].status in (200, 429), req[:60]
        # The VMs are alive and still limiting: the same odd key runs out.
        odd = b"GET / HTTP/1.1\r\nHost: t\r\nx-key: \xff\xfe\x80\r\n\r\n"
        assert statuses([c.send_all([odd])[0] for _ in range(3)]) == [200, 429, 429]
        assert "panicked" not in s.front.logs()
        assert s.front.stat("wasm.envoy.wasm.runtime.v8.vm_reload", 0) == 0


def test_exact_across_four_workers():
    """burst 200, 1,000 requests at once over 20 connections: exactly 200 pass."""
    cfg = {"rate_limits": [rule("exact", 200, ["client_address"])]}
    with Stack(cfg, concurrency=4) as s:
        batches = [[http1.build()] * 50 for _ in range(20)]
        got = [r.status for batch in http1.burst(s.port, batches) for r in batch]
        assert got.count(200) == 200, (got.count(200), got.count(429))
        assert got.count(429) == 800
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="exact", result="allowed"), 200)
        assert s.front.settled_stat(metric("sluice_rl_requests_total", rule="exact", result="store_failure")) == 0


@pytest.mark.wasm_only("the remembering layer over shared data (the native build's store has none)")
def test_a_worker_skips_reads_of_its_own_writes_and_stays_exact():
    """One keep-alive connection (one worker) spends 150 of 350 tokens: most
    of its shared-data reads are skipped (the worker remembers its writes).
    Then 1,000 requests at once over 20 connections on 4 workers, whose
    memories are now out of date: exactly the 200 tokens left are spent."""
    cfg = {"rate_limits": [rule("skip", 350)]}
    with Stack(cfg, concurrency=4) as s:
        c = http1.Conn(s.port)
        assert statuses([c.request() for _ in range(150)]) == [200] * 150
        s.front.wait_stat("wasmcustom.sluice_store_reads_skipped_total", lambda v: 100 <= v <= 150)
        batches = [[http1.build()] * 50 for _ in range(20)]
        got = [r.status for batch in http1.burst(s.port, batches) for r in batch]
        assert got.count(200) == 200, (got.count(200), got.count(429))
        assert c.request().status == 429
        s.front.wait_stat(metric("sluice_rl_requests_total", rule="skip", result="allowed"), 350)
        assert s.front.settled_stat(metric("sluice_rl_requests_total", rule="skip", result="store_failure")) == 0


@pytest.mark.slow
def test_memory_stays_bounded_with_100k_distinct_keys_and_a_hot_key_stays_limited():
    """A table of 1,000 slots, 100,000 requests each with a new key, and a hot
    key sent all along: shared data never grows past the table, Envoy's heap
    does not grow with the number of keys, and the hot key never gets more
    than its bucket allows."""
    import threading

    cfg = {"rate_limits": [{"name": "keys", "key": [{"header": "x-key"}], "max_keys": 1000,
                            "bucket": {"rate": 20, "period": "1s", "burst": 20}}]}
    with Stack(cfg, concurrency=2) as s:
        def allocated():
            return int(json.loads(s.front.admin("/memory"))["allocated"])

        # Warm up connections and VMs before the baseline.
        http1.burst(s.port, [[http1.build("/", {"x-key": f"warm{i}-{j}"}) for j in range(20)] for i in range(16)])
        before = allocated()
        stop = threading.Event()
        hot = {"ok": 0, "refused": 0, "violations": [], "elapsed": 0.0}

        def hot_key():
            c = http1.Conn(s.port)
            start = time.time()
            while not stop.is_set():
                if c.request("/", {"x-key": "hot"}).status == 200:
                    hot["ok"] += 1
                else:
                    hot["refused"] += 1
                elapsed = time.time() - start
                hot["elapsed"] = elapsed
                if hot["ok"] > 20 + 20 * elapsed + 1:
                    hot["violations"].append((hot["ok"], elapsed))
                time_passes(0.002)  # the hot key's pace
            c.close()

        t = threading.Thread(target=hot_key)
        t.start()
        batches = [[http1.build("/", {"x-key": f"cold-{i}-{j}"}) for j in range(6250)] for i in range(16)]
        results = http1.burst(s.port, batches)
        stop.set()
        t.join()
        assert sum(len(b) for b in results) == 100_000
        assert not hot["violations"], hot["violations"][:3]
        assert hot["refused"] > 0, hot
        # Sharing slots with 100,000 other keys costs the hot key little:
        # it still gets most of its 20 requests per second.
        assert hot["ok"] >= 0.7 * 20 * hot["elapsed"], hot
        s.front.wait_stat(metric("sluice_rl_table_entries", rule="keys"), 1000)
        grown = allocated() - before
        # 100,000 shared-data keys would take well over 10 MB.
        print("heap growth", grown, "hot", hot)
        assert grown < 3_000_000, grown


def test_an_optional_header_names_the_refusing_mechanism_and_rule():
    cfg = {"rate_limits": [rule("login", 1)], "response": {"reason_header": "x-sluice-reason"}}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert c.request().header("x-sluice-reason") is None  # admitted: nothing
        assert c.request().header("x-sluice-reason") == "ratelimit/login"
    with Stack({"rate_limits": [rule("login", 1)]}) as s:  # off by default
        c = http1.Conn(s.port)
        c.request()
        r = c.request()
        assert r.status == 429 and r.header("x-sluice-reason") is None


def test_a_shadow_rule_never_shows_in_an_admitted_requests_headers():
    """A dry run tells clients nothing: the headers are the enforcing
    rule's, whether the shadow rule would admit or refuse."""
    cfg = {"rate_limits": [{"name": "sh", "shadow": True, "bucket": {"rate": 1, "period": "1h", "burst": 2}},
                           {"name": "en", "bucket": {"rate": 1, "period": "1h", "burst": 100}}],
           "response": {"headers_on_allowed": True, "ratelimit_headers": "draft"}}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        got = [c.request("/") for _ in range(4)]
        assert [r.status for r in got] == [200] * 4
        assert [r.header("ratelimit").split(";")[:2] for r in got] == \
            [['"en"', f"r={n}"] for n in (99, 98, 97, 96)], [r.headers for r in got]


def test_a_refusal_is_logged_at_debug_with_what_the_client_is_told():
    cfg = {"rate_limits": [{"name": "r", "bucket": {"rate": 1, "period": "1h", "burst": 1}}]}
    with Stack(cfg, log_level="debug") as s:
        c = http1.Conn(s.port)
        assert [c.request("/").status for _ in range(2)] == [200, 429]
        assert 'sluice: refused: {"error":"rate_limited","rule":"r"' in s.front.logs()
