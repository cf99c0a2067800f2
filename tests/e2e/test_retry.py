"""End to end: a retry budget in a real Envoy with 2 workers holds its ratio
under a retry storm from many connections (both workers), refuses retries
over budget at once with a distinct answer, and recovers when the storm
ends."""

import json
import threading
import time

import http1
from harness import Envoy, Stack, free_port, front_bootstrap, metric, settle, time_passes

RETRY = {"x-envoy-attempt-count": "2"}
CFG = {"retry_budgets": [{"name": "api", "ratio": 0.1, "min_per_second": 1, "window": "2s"}]}


def storm(port, first_tries, retries, threads=4):
    """Each thread sends its share of first tries and retries, interleaved,
    on new connections now and then (so both workers see traffic)."""
    out = []
    lock = threading.Lock()

    def run(i):
        c = http1.Conn(port)
        for n in range(first_tries // threads + retries // threads):
            if n % 10 == 0:
                c.close()
                c = http1.Conn(port)
            retry = n % ((first_tries + retries) // retries) == 0
            t = time.time()
            r = c.request("/", RETRY if retry else {})
            with lock:
                out.append((retry, r.status, time.time() - t, r))
        c.close()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_a_retry_storm_stays_within_the_budget_and_the_budget_recovers():
    with Stack(CFG) as s:
        got = storm(s.port, 400, 400)
        tries = sum(1 for r in got if not r[0])
        admitted = [r for r in got if r[0] and r[1] == 200]
        refused = [r for r in got if r[0] and r[1] != 200]
        assert all(r[1] == 200 for r in got if not r[0]), "a first try was refused"
        # 10% of the first tries plus 1 per second over the 2 s window (and
        # the window before); first tries merge on the 100 ms tick, so the
        # budget can only lag behind, never run ahead.
        assert 1 <= len(admitted) <= tries // 10 + 4, (len(admitted), tries)
        assert refused, "no retry was refused during the storm"
        r = refused[0][3]
        assert r.status == 429 and r.header("x-sluice-retry-budget") == "exhausted"
        assert json.loads(r.body)["error"] == "retry_budget_exhausted"
        assert int(r.header("retry-after")) >= 1
        assert max(x[2] for x in refused) < 0.5, "a refused retry was held"
        s.front.wait_stat(metric("sluice_retry_requests_total", budget="api", result="retry_refused"), len(refused))
        s.front.wait_stat(metric("sluice_retry_requests_total", budget="api", result="retry_admitted"), len(admitted))
        # The storm ends: after two windows of first tries only, retries fit.
        c = http1.Conn(s.port)
        deadline = time.time() + 4.5
        while time.time() < deadline:
            assert c.request("/").status == 200
            time_passes(0.02)  # first tries only, for two windows
        assert c.request("/", RETRY).status == 200


def test_a_budget_in_the_next_envoy_refuses_the_retries_of_the_envoy_before_it():
    """The retries an Envoy's own router makes never pass through its
    filters; the next Envoy on the path sees them, marked with
    `x-envoy-attempt-count` when the first one's virtual host sets
    `include_request_attempt_count` (docs/configuration.md, "Where it sees
    retries")."""
    cfg = {"retry_budgets": [{"name": "none", "ratio": 0, "min_per_second": 0}]}
    with Stack(cfg) as s:
        port = free_port()
        routes = [{"match": {"prefix": "/"}, "route": {
            "cluster": "upstream", "timeout": "5s", "retry_policy": {"retry_on": "5xx", "num_retries": 4}}}]
        boot = front_bootstrap(port, free_port(), s.port, [], routes)
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["route_config"]["virtual_hosts"][0]["include_request_attempt_count"] = True
        with Envoy(boot, 1) as caller:
            # The upstream fails it: the caller's Envoy retries; sluice in
            # the next Envoy refuses the retry, which is not retried (429).
            r = http1.get(port, "/", {"x-envoy-fault-abort-request": "503"})
            assert r.status == 429 and r.header("x-sluice-retry-budget") == "exhausted", (r.status, r.headers)
            assert caller.stat("cluster.upstream.upstream_rq_retry") == 1
        s.front.wait_stat(metric("sluice_retry_requests_total", budget="none", result="retry_refused"), 1)
        settle()  # and nothing else counted
        got = {k: s.front.stat(metric("sluice_retry_requests_total", budget="none", result=k))
               for k in ("first_try", "retry_admitted", "retry_refused")}
        assert got == {"first_try": 1, "retry_admitted": 0, "retry_refused": 1}, got
        assert s.upstream_requests() == 1


def test_a_retry_a_later_budget_refuses_is_not_charged_to_an_earlier_one():
    """A retry must fit every budget it matches; refused by the second, it
    never goes out, and the first gets its allowance back."""
    cfg = {"retry_budgets": [
        {"name": "p1", "match": {"path_prefix": "/d"}, "ratio": 1, "min_per_second": 0, "window": "10s"},
        {"name": "p2", "match": {"path_prefix": "/d/x"}, "ratio": 0, "min_per_second": 0}]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert c.request("/d").status == 200  # one first try: p1 allows one retry
        s.front.wait_stat(metric("sluice_retry_requests_total", budget="p1", result="first_try"), 1)
        settle()  # past every worker's tick: the first try is in p1's shared count
        assert c.request("/d/x", RETRY).status == 429  # p2 refuses it
        assert c.request("/d", RETRY).status == 200, "p1's one retry was spent on a refused one"
        assert c.request("/d", RETRY).status == 429  # and now it is spent
        assert s.front.settled_stat(metric("sluice_retry_requests_total", budget="p1", result="retry_admitted")) == 1
