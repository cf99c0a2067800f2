"""End to end: the native build (native/, an Envoy dynamic module) in a real
Envoy 1.40 with several workers, in front of a real upstream Envoy. The
module is built by `make build-native` (this file builds it if missing).
Marked `native`: `make test-native` (part of `make test`) runs them, on a
debug build (`SLUICE_NATIVE`)."""

import json
import re
import subprocess

import pytest

import http1
from harness import (ENVOY, METRICS_DUE_S, NATIVE, ROOT, Envoy, SlowUpstream, Stack, free_port, front_bootstrap,
                     native_filter, time_passes, upstream_bootstrap, validate, wait_until)
from test_bulkhead_wait import first_then, h, in_flight_upstream, timed, together

pytestmark = pytest.mark.native

HOUR = {"rate": 1, "period": "1h"}


@pytest.fixture(scope="module", autouse=True)
def native_module():
    if not NATIVE.exists():
        subprocess.run(["cargo", "build", "--release", "--offline"], cwd=ROOT / "native", check=True)
    return NATIVE


def envoy_binary():
    """The real Envoy binary (`.venv/bin/envoy` is a Python wrapper)."""
    out = subprocess.run([str(ROOT / ".venv/bin/python"), "-c",
                          "import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / '_bin' / 'envoy')"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ENVOY


def symbols(path, flag):
    out = subprocess.run(["nm", "-D", flag, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if "envoy_dynamic_module_" in line}


def test_every_callback_the_module_imports_is_in_this_envoy():
    """A callback the binary lacks would fail the load (BIND_NOW)."""
    imported = symbols(NATIVE, "--undefined-only")
    assert imported, "the module imports no callback: not the module?"
    missing = imported - symbols(envoy_binary(), "--defined-only")
    assert not missing, missing


def test_the_module_exports_the_hooks_of_its_main_thread_work():
    """Envoy 1.40 resolves a configuration's scheduler and stream hooks
    only if the module exports them, and a module without them loads: its
    ticks and its calls' answers would never reach it, silently."""
    exported = symbols(NATIVE, "--defined-only")
    hooks = ["scheduled"] + [f"http_stream_{e}" for e in ("headers", "data", "trailers", "complete", "reset")]
    missing = {f"envoy_dynamic_module_on_http_filter_config_{h}" for h in hooks} - exported
    assert not missing, missing


@pytest.mark.parametrize("workers", [2, 4])
def test_a_token_bucket_is_exact_across_workers(workers):
    """burst 40, 200 requests at once over 20 connections on 2 or 4
    workers: exactly 40 pass; the rest are 429 with Retry-After and the
    JSON body."""
    cfg = {"rate_limits": [{"name": "exact", "bucket": dict(HOUR, burst=40)}],
           "response": {"headers_on_allowed": True, "retry_after_jitter": "0s"}}
    with Stack(cfg, concurrency=workers, host="native") as s:
        batches = [[http1.build()] * 10 for _ in range(20)]
        got = [r for batch in http1.burst(s.port, batches) for r in batch]
        ok = [r for r in got if r.status == 200]
        refused = [r for r in got if r.status != 200]
        assert len(ok) == 40, (len(ok), sorted({r.status for r in refused}))
        assert {r.status for r in refused} == {429}
        # Each admitted response says what was left: within the burst,
        # down to 0 for the last token. (Not 40 distinct values: a worker
        # reads its clock before its compare-and-swap, so one that commits
        # after another, with an earlier clock, may say one less than was
        # left; the count above is the exact part.)
        left = [int(r.header("x-ratelimit-remaining")) for r in ok]
        assert all(0 <= n < 40 for n in left) and min(left) == 0, sorted(left)
        r = refused[0]
        assert r.header("retry-after") == "3600"
        assert r.header("x-ratelimit-remaining") == "0"
        assert r.header("content-type") == "application/json"
        body = json.loads(r.body)
        assert body["error"] == "rate_limited" and body["rule"] == "exact"
        assert s.upstream_requests() == 40
        assert "panic" not in s.front.logs()
        # The same series as the wasm build's, in /stats/prometheus.
        want = [r'sluice_rl_requests_total\{domain="default",rule="exact",result="allowed"\} 40$',
                r'sluice_rl_requests_total\{domain="default",rule="exact",result="limited"\} 160$']
        prom = []

        def counted():
            prom.append(s.front.admin("/stats/prometheus"))
            return all(re.search(w, prom[-1], re.M) for w in want)

        wait_until(counted, METRICS_DUE_S, lambda: "\n".join(l for l in prom[-1].splitlines() if "sluice_rl" in l))


def test_a_grpc_request_is_refused_with_an_explicit_grpc_status():
    cfg = {"rate_limits": [{"name": "grpc", "bucket": dict(HOUR, burst=1)}]}
    with Stack(cfg, host="native") as s:
        c = http1.Conn(s.port)
        h = {"content-type": "application/grpc", "te": "trailers"}
        assert c.request("/pkg.Svc/Method", h, method="POST").status == 200
        r = c.request("/pkg.Svc/Method", h, method="POST")
        assert r.status == 200, r.headers
        assert r.header("grpc-status") == "8"
        assert "rate limited" in r.header("grpc-message")


def test_a_per_client_rule_keys_on_the_client_address():
    """Without the address the rule would not apply (on_missing_key: skip)."""
    cfg = {"rate_limits": [{"name": "per-client", "bucket": dict(HOUR, burst=2), "key": ["client_address"]}],
           "response": {"reason_header": "x-sluice-reason"}}
    with Stack(cfg, host="native") as s:
        c = http1.Conn(s.port)
        got = [c.request() for _ in range(3)]
        assert [r.status for r in got] == [200, 200, 429]
        assert got[2].header("x-sluice-reason") == "ratelimit/per-client"


def test_a_bad_configuration_is_refused_naming_the_field():
    bad = '{"rate_limits":[{"name":"a","bucket":{"rate":0,"period":"1s"}}]}'
    ok, out = validate(bad, host="native")
    assert not ok
    assert "rate_limits[0].bucket.rate: must be greater than 0" in out, out[-3000:]
    ok, out = validate({"rate_limits": [{"name": "a", "bucket": {"rate": 1, "period": "1s"}}]}, host="native")
    assert ok, out[-3000:]


def test_waiters_go_as_places_free_on_either_worker_and_time_out():
    """A concurrency limit with a wait line: the ticker ticks a worker while
    its streams wait, so a place freed on the other worker is taken, and a
    waiter whose max_wait passes is answered."""
    limits = [{"name": "wait", "match": {"path_prefix": "/w/"}, "key": [{"header": "x-tenant"}], "max": 3,
               "max_wait": "3s"},
              {"name": "short", "match": {"path_prefix": "/x/"}, "key": [{"header": "x-tenant"}], "max": 2,
               "max_wait": "300ms", "queue": 1}]
    routes = [{"name": "slow", "match": {"prefix": "/"}, "route": {"cluster": "slow", "timeout": "20s"}}]
    with SlowUpstream(10000, 0) as up, \
            Stack({"concurrency_limits": limits}, routes=routes, extra_clusters=[("slow", up.port)], host="native") as s:
        got = together([(timed, (s.port, "/w/", h("a", 300)))] * 9)
        assert [r.status for r, _ in got] == [200] * 9, [(r.status, r.body) for r, _ in got]
        times = sorted(t for _, t in got)
        assert times[2] < 0.55 and times[3] > 0.55 and times[6] > 0.85, times
        a = up.stats()["tenants"]["a"]
        assert a["peak"] == 3 and a["served"] == 9, a

        held, late = first_then([(timed, (s.port, "/x/", h("b", 1500)))] * 2, [(timed, (s.port, "/x/", h("b", 0)))] * 5,
                                in_flight_upstream(up, "b", 2))
        assert [r.status for r, _ in held] == [200, 200]
        assert [r.status for r, _ in late] == [429] * 5, [(r.status, r.body) for r, _ in late]
        waited = [t for _, t in late if t > 0.25]
        assert 1 <= len(waited) <= 2 and max(waited) < 1.2, [t for _, t in late]
        assert json.loads(late[0][0].body)["limit"] == "short"
        assert up.stats()["tenants"]["b"]["peak"] == 2


def test_a_breaker_sees_responses_opens_and_fails_fast_on_both_workers():
    """The response hook feeds the breaker: upstream 503s trip it, and then
    no request reaches the upstream from either worker."""
    b = {"name": "backend", "min_requests": 10, "error_rate": 0.5, "open": {"base": "3s", "max": "4s"},
         "half_open": {"probes": 1}}
    fail = {"x-envoy-fault-abort-request": "503"}
    with Stack({"circuit_breakers": [b]}, host="native") as s:
        c = http1.Conn(s.port)
        assert [c.request("/", fail).status for _ in range(10)] == [503] * 10
        time_passes(0.1)  # every worker re-reads the breakers' shared state within 20 ms
        before = s.upstream_requests()
        got = [http1.get(s.port) for _ in range(20)]  # new connections: both workers
        assert [r.status for r in got] == [503] * 20
        assert s.upstream_requests() == before, "an open breaker let requests reach the upstream"
        assert got[0].header("x-sluice-circuit") == "open"
        assert json.loads(got[0].body)["error"] == "circuit_open"


def test_envoy_gateway_enables_it_on_the_routes_a_policy_targets():
    """What Envoy Gateway makes of an EnvoyExtensionPolicy's `dynamicModule`
    (its translator, internal/xds/translator/dynamicmodule.go): the filter
    on the connection manager, disabled; enabled on each route the policy
    targets by an empty FilterConfig (no per-route configuration);
    sluice's JSON as a StringValue. Its rules apply on those routes only."""
    f = native_filter({"rate_limits": [{"name": "eg", "bucket": dict(HOUR, burst=2)}]})
    f.update(name="envoy.filters.http.dynamic_modules/sluice", disabled=True)
    enable = {f["name"]: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}
    routes = [{"name": "api", "match": {"prefix": "/api"}, "route": {"cluster": "upstream"},
               "typed_per_filter_config": enable},
              {"name": "other", "match": {"prefix": "/"}, "route": {"cluster": "upstream"}}]
    port, up_port = free_port(), free_port()
    with Envoy(upstream_bootstrap(up_port, free_port()), concurrency=1), \
            Envoy(front_bootstrap(port, free_port(), up_port, [f], routes)):
        c = http1.Conn(port)
        assert [c.request("/api").status for _ in range(3)] == [200, 200, 429]
        assert [c.request("/").status for _ in range(3)] == [200] * 3
