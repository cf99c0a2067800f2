#!/usr/bin/env python3
"""Soak: a real Envoy with every mechanism on, for a long time, under mixed
traffic, configuration updates and faults (`make soak`; a benchmark, not a
test: it reports, it does not pass or fail a build).

One front Envoy (--concurrency 2) runs sluice delivered through ECDS, with
every mechanism on at once (CONFIG below): a token bucket keyed by user
with far more users than `max_keys` (key churn), a sliding window per
tenant, shaping, a global rule through the reference rate-limit service
(rls/), a circuit breaker per dependency, a queue-mode shedder with
priorities and shares, an adaptive shedder, a concurrency limit per tenant
that queues, a retry budget and deadlines. Behind it: an upstream Envoy
that answers 200, or an error or late when the request asks for it (its
fault filter), and a server that resets every connection.

For SECONDS (default 600; `make soak SOAK_SECONDS=120` for a short one):
- CLIENTS threads send a mix of requests (MIX) on keep-alive connections;
- every ECDS_EVERY_S the configuration is replaced (two variants in turn:
  other limits, the same names, so state and metrics carry over);
- every RLS_EVERY_S the rate-limit service is killed, and started again on
  its port RLS_DOWN_S later;
- every RSS_EVERY_S the front Envoy's resident memory is sampled.

Then the clients stop and it reports, side by side:
- RSS: the slope per minute after warm-up (the first WARMUP_FRACTION of
  the run) by least squares, with its 95% interval. The verdict rule, fixed
  before any run: "flat" when the interval contains 0, else "growing" or
  "shrinking";
- every 5xx the clients saw, explained or not: sluice's own refusals (the
  `x-sluice-reason` header), errors the upstream was asked to inject
  (Envoy's fault filter body), resets on the path that resets; anything
  else (and any connection error) is unexplained. Goal: 0 unexplained;
- counters against what the clients saw: each mechanism's refusals (by
  the reason header) against the counters that count them; the decisions
  of the rules every request meets against the requests that reached the
  rate limits; the requests the upstream received against those the
  clients saw admitted. Goal: each equal (a rule's refusals named in
  answers at most its `limited` count: several rules may refuse one
  request, its answer names one);
- gauges of requests held, in flight or queued once the traffic stopped.
  Goal: all 0;
- log lines of the front Envoy at error or critical level. Goal: 0.

Writes bench/results/soak.{json,md}.
"""

import argparse
import json
import math
import os
import random
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench/results"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import bench  # noqa: E402
import harness  # noqa: E402
import http1  # noqa: E402
import provenance  # noqa: E402
from ecds import discovery_response, ecds_filter, plugin_config, write_atomically  # noqa: E402
from harness import Envoy, free_port, front_bootstrap, settle, upstream_bootstrap, wait_until  # noqa: E402
from rls import RlsServer, rls_cluster  # noqa: E402

CLIENTS = 8
ECDS_EVERY_S = 5
RLS_EVERY_S = 45
RLS_DOWN_S = 10
RSS_EVERY_S = 5
WARMUP_FRACTION = 0.2
USERS = 1_000_000          # far beyond the per-user rule's max_keys
TENANTS = 8
HOT_USERS = 20             # and a few users busy enough to be limited
DOMAIN = "soak"
REASON = "x-sluice-reason"
GLOBAL_PER_MINUTE = 600

RLS_LIMITS = {"domain": "fleet", "descriptors": [
    {"key": "x-tenant", "rate_limit": {"unit": "minute", "requests_per_unit": GLOBAL_PER_MINUTE}}]}


def config(variant):
    """The plugin configuration; variant 0 or 1 differ in limits only."""
    v = variant
    return {
        "domain": DOMAIN,
        "response": {"reason_header": REASON, "headers_on_allowed": True},
        "deadlines": {"headers": ["grpc-timeout", "x-deadline-ms"], "min_remaining": "5ms"},
        "rate_limits": [
            {"name": "per-user", "key": [{"header": "x-user"}], "bucket": {"rate": 2 + v, "period": "1s", "burst": 3},
             "max_keys": 500},
            {"name": "per-tenant", "key": [{"header": "x-tenant"}], "algorithm": "sliding_window",
             "window": {"limit": 50 + 10 * v, "period": "1s"}, "max_keys": 64},
            {"name": "pace", "match": {"path_prefix": "/pace"}, "bucket": {"rate": 20 + 10 * v, "period": "1s", "burst": 5},
             "on_limit": "delay", "max_delay": "200ms", "max_delayed": 20},
            {"name": "fleet", "match": {"path_prefix": "/g"}, "key": [{"header": "x-tenant"}],
             "algorithm": "sliding_window", "window": {"limit": GLOBAL_PER_MINUTE, "period": "1m"},
             "global": {"cluster": "rls", "domain": "fleet", "instances": 1}, "max_keys": 64},
        ],
        "circuit_breakers": [
            {"name": "deps", "match": {"path_prefix": "/pay"}, "key": {"header": "x-dep"}, "error_rate": 0.5,
             "window": "5s", "min_requests": 10, "open": {"base": "1s", "max": "4s"}, "max_keys": 16}],
        "shedders": [
            {"name": "api", "match": {"path_prefix": "/api"},
             "priority": {"header": "x-priority", "shares": {"critical": 50, "default": 35, "sheddable": 15}},
             "concurrency": {"max": 4 + 2 * v, "queue": 8, "max_wait": "150ms"}},
            {"name": "auto", "match": {"path_prefix": "/auto"}, "concurrency": {"max": "auto", "adaptive": {}}},
        ],
        "concurrency_limits": [
            {"name": "tenant", "match": {"path_prefix": "/api"}, "key": [{"header": "x-tenant"}], "max": 2 + v,
             "max_wait": "100ms", "queue": 4, "max_keys": 64}],
        "retry_budgets": [{"name": "retries", "match": {"path_prefix": "/api"}, "ratio": 0.1, "min_per_second": 2}],
    }


# (weight, path kind)
MIX = [(40, "api"), (15, "pay"), (10, "pace"), (10, "global"), (10, "auto"), (5, "reset"), (10, "plain")]


def request(rng):
    """(kind, path, headers) of one request of the mix."""
    kind = rng.choices([k for _, k in MIX], [w for w, _ in MIX])[0]
    user = rng.randrange(HOT_USERS) if rng.random() < 0.3 else rng.randrange(HOT_USERS, USERS)
    h = {"x-user": f"u{user}", "x-tenant": f"t{rng.randrange(TENANTS)}"}
    if kind == "api":
        path = f"/api/{rng.randrange(100)}"
        h["x-priority"] = rng.choice(["critical", "default", "sheddable", "bogus"])
        if rng.random() < 0.3:
            h["x-deadline-ms"] = str(rng.randrange(1, 400))
        if rng.random() < 0.2:
            h["x-envoy-attempt-count"] = str(rng.randrange(2, 4))
        if rng.random() < 0.03:
            h["x-envoy-fault-abort-request"] = "503"
        elif rng.random() < 0.3:
            h["x-envoy-fault-delay-request"] = str(rng.randrange(20, 200))
    elif kind == "pay":
        path = "/pay"
        dep = rng.choice(["a", "b", "c", "bad"])
        h["x-dep"] = dep
        if dep == "bad" or rng.random() < 0.02:
            h["x-envoy-fault-abort-request"] = "503"
    elif kind == "pace":
        path = "/pace"
    elif kind == "global":
        path = "/g"
    elif kind == "auto":
        path = "/auto"
        h["x-envoy-fault-delay-request"] = str(rng.randrange(15, 40))
    elif kind == "reset":
        path = "/reset"
    else:
        path = "/plain"
        if rng.random() < 0.05:
            h["grpc-timeout"] = rng.choice(["1m", "3m", "10S", "x", "99999999999H"])
    return kind, path, h


class Tally:
    """What the clients saw, summed under a lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by = Counter()             # (kind, status)
        self.reasons = Counter()        # (status, reason header)
        self.unexplained = []           # first few: (kind, status, body)
        self.unexplained_n = 0
        self.errors = Counter()         # connection errors by text
        self.admitted = 0               # reached the upstream Envoy, as far as a client can tell
        self.injected = 0               # 5xx the upstream was asked to inject
        self.resets = 0                 # 5xx on the path that resets
        self.sent = 0

    def add(self, kind, r):
        reason = r.header(REASON)
        body = r.body[:120].decode("latin-1")
        with self.lock:
            self.sent += 1
            self.by[(kind, r.status)] += 1
            if reason:
                self.reasons[(r.status, reason)] += 1
            elif kind == "reset":
                if r.status >= 500 and "upstream connect error or disconnect/reset" in body:
                    self.resets += 1
                else:
                    self._unexplained(kind, r.status, body)
            elif r.status >= 500 and "fault filter abort" in body:
                self.injected += 1
                self.admitted += 1
            elif r.status >= 500:
                self._unexplained(kind, r.status, body)
            else:
                self.admitted += 1

    def _unexplained(self, kind, status, body):
        self.unexplained_n += 1
        if len(self.unexplained) < 10:
            self.unexplained.append((kind, status, body))

    def error(self, e):
        with self.lock:
            self.sent += 1
            self.errors[f"{type(e).__name__}: {e}"[:100]] += 1


def client(port, seed, stop, tally):
    rng = random.Random(seed)
    conn, used = None, 0
    while not stop.is_set():
        kind, path, headers = request(rng)
        try:
            if conn is not None and used >= 50:
                conn.close()
                conn = None
            if conn is None:
                conn, used = http1.Conn(port, timeout=15), 0
            used += 1
            r = conn.request(path, headers)
            tally.add(kind, r)
            if r.header("connection") == "close":
                conn.close()
                conn = None
        except Exception as e:  # counted: every error is unexplained
            tally.error(e)
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(0.002)
    if conn is not None:
        conn.close()


class ResetServer:
    """Accepts connections and resets each once it has read from it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            try:
                c.settimeout(1)
                c.recv(65536)
            except OSError:
                pass
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


def slope(points):
    """Least-squares slope of (x, y) and its standard error."""
    n = len(points)
    if n < 3:
        return 0.0, float("inf")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0, float("inf")
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in points)
    return b, math.sqrt(resid / (n - 2) / sxx)


def metric(name, **labels):
    return harness.metric(name, domain=DOMAIN, **labels)


def counter_checks(stats, tally):
    """[(what, clients saw, counters say, relation)] where relation is "="
    (must be equal) or "<=" (clients' figure at most the counters')."""

    def s(name, **labels):
        return stats.get(metric(name, **labels), 0)

    seen = tally.reasons

    def named(reason, statuses=None):
        return sum(n for (st, rs), n in seen.items() if rs == reason and (statuses is None or st in statuses))

    def results(rule):
        return sum(s("sluice_rl_requests_total", rule=rule, result=r)
                   for r in ("allowed", "limited", "shadow_limited", "store_failure"))

    rows = []
    # Every request meets per-user and per-tenant (they match all) unless a
    # mechanism before rate limits refused it (configuration.md, "Order of
    # mechanisms"): each rule decides each of them once, allowed or not.
    before = sum(n for (_, rs), n in seen.items()
                 if rs == "deadline" or rs.split("/")[0] in ("breaker", "retry_budget", "bulkhead"))
    reached = tally.sent - sum(tally.errors.values()) - before
    for rule in ("per-user", "per-tenant"):
        rows.append((f"rate-limit decisions of {rule} (every result)", reached, results(rule), "="))
    # Several rules may refuse one request; its answer names one of them.
    for r in config(0)["rate_limits"]:
        rows.append((f"429 ratelimit/{r['name']}", named(f"ratelimit/{r['name']}"),
                     s("sluice_rl_requests_total", rule=r["name"], result="limited"), "<="))
    rows.append(("503 breaker/deps", named("breaker/deps"),
                 s("sluice_cb_fast_failed_total", breaker="deps") + s("sluice_cb_throttled_total", breaker="deps"), "="))
    for sh in config(0)["shedders"]:
        rows.append((f"503 shed/{sh['name']}", named(f"shed/{sh['name']}", {503}),
                     sum(s("sluice_shed_total", shedder=sh["name"], priority=p)
                         for p in ("critical", "default", "sheddable")), "="))
    rows.append(("429 and 504 bulkhead/tenant", named("bulkhead/tenant"),
                 s("sluice_bulkhead_requests_total", limit="tenant", result="limited")
                 + s("sluice_bulkhead_requests_total", limit="tenant", result="timed_out"), "="))
    rows.append(("429 retry_budget/retries", named("retry_budget/retries"),
                 s("sluice_retry_requests_total", budget="retries", result="retry_refused"), "="))
    rows.append(("504, on arrival or while waiting", sum(n for (st, _), n in seen.items() if st == 504),
                 stats.get(harness.metric("sluice_deadline_refused_total", domain=DOMAIN), 0), "="))
    known = {"deadline", "breaker/deps", "bulkhead/tenant", "retry_budget/retries"}
    known |= {f"ratelimit/{r['name']}" for r in config(0)["rate_limits"]}
    known |= {f"shed/{sh['name']}" for sh in config(0)["shedders"]}
    for (status, reason), n in seen.items():
        if reason not in known:
            rows.append((f"{status} {reason} (no counter known)", n, 0, "="))
    return rows


def holds(clients, counters, relation):
    return clients == counters if relation == "=" else clients <= counters


def held_gauges(stats):
    pat = re.compile(r"sluice_(rl_held|shed_in_flight|shed_queued|bulkhead_in_flight|bulkhead_queued)$")
    return {k: v for k, v in stats.items() if pat.search(k)}


def baseline_config(variant):
    """For `--baseline`: sluice with no mechanism (the same updates, the
    same traffic), to tell sluice's memory from Envoy's own."""
    return {"domain": f"{DOMAIN}-{variant}", "response": {"reason_header": REASON}}


def run(seconds, ecds_every_s=ECDS_EVERY_S, baseline=False):
    rng = random.Random(1)
    tmp = tempfile.TemporaryDirectory(prefix="sluice-soak-")
    ecds_path = Path(tmp.name) / "ecds.json"
    version = [0]

    def push(variant):
        version[0] += 1
        write_atomically(ecds_path, json.dumps(
            discovery_response("sluice", plugin_config((baseline_config if baseline else config)(variant)),
                               version[0])))

    push(0)
    rls = RlsServer(RLS_LIMITS).__enter__()
    rls_port = rls.port
    upstream_port = free_port()
    upstream = Envoy(upstream_bootstrap(upstream_port, free_port()), concurrency=1)
    resets = ResetServer().__enter__()
    port = free_port()
    routes = [{"name": "reset", "match": {"prefix": "/reset"}, "route": {"cluster": "reset", "timeout": "2s"}},
              {"name": "default", "match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "2s"}}]
    boot = front_bootstrap(port, free_port(), upstream_port, [ecds_filter("sluice", ecds_path)], routes,
                           [("reset", resets.port)])
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    boot["node"] = {"id": "sluice-soak", "cluster": "sluice-soak"}
    front = Envoy(boot, concurrency=2, log_level="warn")
    tally, stop = Tally(), threading.Event()
    rss, events = [], Counter()
    try:
        upstream.__enter__()
        front.__enter__()
        threads = [threading.Thread(target=client, args=(port, i, stop, tally), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        start = time.monotonic()
        next_ecds, next_rls, next_rss, rls_back_at = ecds_every_s, RLS_EVERY_S, 0.0, None
        variant, next_progress = 0, 0.0
        while (now := time.monotonic() - start) < seconds:
            if now >= next_rss:
                rss.append((now / 60, bench.rss_kb(front.proc.pid) / 1024))
                next_rss += RSS_EVERY_S
            if ecds_every_s and now >= next_ecds:
                variant ^= 1
                push(variant)
                events["configuration updates"] += 1
                next_ecds += ecds_every_s
            if rls is not None and now >= next_rls:
                rls.__exit__()
                rls, rls_back_at = None, now + RLS_DOWN_S
                events["rate-limit service killed"] += 1
            if rls is None and rls_back_at is not None and now >= rls_back_at:
                rls = RlsServer(RLS_LIMITS, port=rls_port).__enter__()
                next_rls = now + RLS_EVERY_S
                events["rate-limit service restarted"] += 1
            if now >= next_progress:
                print(f"{now:5.0f}/{seconds} s  requests {tally.sent}  rss {rss[-1][1]:.1f} MB", flush=True)
                next_progress += 30
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(20)
        # Held and queued requests end within max_delay / max_wait; then
        # every worker's tick hands its last metric changes to Envoy.
        time.sleep(1)
        settle()
        gauges = {}

        def drained():
            gauges.update(held_gauges(front.stats("sluice_")))
            return all(v == 0 for v in gauges.values())

        try:
            wait_until(drained, 10, "gauges at 0")
        except AssertionError:
            pass
        checks = []

        def reconciled():
            stats = front.stats("sluice_")
            checks[:] = [] if baseline else counter_checks(stats, tally)
            checks.append(("requests the upstream received", tally.admitted,
                           upstream.stat("http.upstream.downstream_rq_total"), "="))
            return all(holds(*c[1:]) for c in checks)

        try:
            wait_until(reconciled, 10, "counters that agree with what the clients saw")
        except AssertionError:
            pass
        logs = front.logs().splitlines()
        bad_logs = [ln for ln in logs if "][error]" in ln or "][critical]" in ln]
        warnings = Counter(re.sub(r"^\[[^]]*\]\[\d+\]", "", ln)[:140] for ln in logs if "][warning]" in ln)
        return summarize(seconds, rss, tally, gauges, checks, bad_logs, warnings, events)
    finally:
        stop.set()
        front.__exit__()
        upstream.__exit__()
        resets.__exit__()
        if rls is not None:
            rls.__exit__()
        tmp.cleanup()


def summarize(seconds, rss, tally, gauges, checks, bad_logs, warnings, events):
    after = [p for p in rss if p[0] >= seconds / 60 * WARMUP_FRACTION]
    b, se = slope(after)
    lo, hi = b - 2 * se, b + 2 * se
    verdict = "flat" if lo <= 0 <= hi else "growing" if lo > 0 else "shrinking"
    sluice_5xx = {f"{st} {rs}": n for (st, rs), n in sorted(tally.reasons.items()) if st >= 500}
    sluice_4xx = {f"{st} {rs}": n for (st, rs), n in sorted(tally.reasons.items()) if st < 500}
    return {
        "seconds": seconds,
        "requests": tally.sent,
        "events": dict(events),
        "rss": {"samples": len(rss), "first_mb": rss[0][1] if rss else None, "last_mb": rss[-1][1] if rss else None,
                "max_mb": max((y for _, y in rss), default=None),
                "slope_mb_per_min": b, "interval_95": [lo, hi], "verdict": verdict,
                "warmup_s": seconds * WARMUP_FRACTION,
                "series": [[round(m * 60), round(mb, 2)] for m, mb in rss]},
        "statuses": {f"{k} {s}": n for (k, s), n in sorted(tally.by.items())},
        "sluice_5xx": sluice_5xx,
        "sluice_4xx": sluice_4xx,
        "injected_5xx": tally.injected,
        "reset_5xx": tally.resets,
        "unexplained_5xx": tally.unexplained_n,
        "unexplained_samples": tally.unexplained,
        "connection_errors": dict(tally.errors),
        "counters": [{"what": w, "clients": a, "counters": c, "relation": r, "holds": holds(a, c, r)}
                     for w, a, c, r in checks],
        "gauges_at_end": gauges,
        "error_logs": len(bad_logs),
        "error_log_samples": bad_logs[:10],
        "warning_logs": dict(warnings.most_common(10)),
    }


def goals(d):
    return {
        "rss flat after warm-up": d["rss"]["verdict"] == "flat",
        "0 unexplained 5xx or connection errors": d["unexplained_5xx"] == 0 and not d["connection_errors"],
        "counters agree with what clients saw": all(c["holds"] for c in d["counters"]),
        "gauges back to 0": all(v == 0 for v in d["gauges_at_end"].values()),
        "0 error logs": d["error_logs"] == 0,
    }


def describe(seconds, ecds_every_s):
    return (f"A front Envoy (`--concurrency 2`) with sluice delivered by ECDS, every mechanism on "
            f"(bench/soak.py, `config`), {CLIENTS} keep-alive clients sending a mix ({', '.join(f'{k} {w}%' for w, k in MIX)}) "
            f"with 30% of requests from {HOT_USERS} busy users and the rest from {USERS:,} (the per-user rule holds 500 keys), {TENANTS} tenants, for {seconds} s; the configuration "
            f"replaced every {ecds_every_s:g} s (two variants in turn; never if 0), the rate-limit service killed every "
            f"{RLS_EVERY_S} s and started again {RLS_DOWN_S} s later; upstream errors (3% of /api, every request of "
            f"dependency `bad` and 2% of the others on /pay), slowness (20-200 ms on 30% of /api, 15-40 ms on /auto) "
            f"and resets (/reset). RSS verdict, fixed before running: the least-squares slope after the first "
            f"{WARMUP_FRACTION:.0%} of the run is flat when its 95% interval (±2 standard errors) contains 0.")


def markdown(d):
    r = d["rss"]
    g = goals(d)
    nonzero = ", ".join(f"{k}={v}" for k, v in d["gauges_at_end"].items() if v)
    lines = ["| goal | result | met |", "|---|---|---|",
             f"| RSS flat after warm-up | {r['first_mb']:.1f} MB at start, {r['last_mb']:.1f} MB at end, slope "
             f"{r['slope_mb_per_min']:+.3f} MB/min (95%: {r['interval_95'][0]:+.3f} to {r['interval_95'][1]:+.3f}): "
             f"{r['verdict']} | {'yes' if g['rss flat after warm-up'] else '**no**'} |",
             f"| 0 unexplained 5xx | {d['unexplained_5xx']} unexplained, {sum(d['connection_errors'].values())} "
             f"connection errors; explained: {sum(d['sluice_5xx'].values())} by sluice, {d['injected_5xx']} injected, "
             f"{d['reset_5xx']} resets | {'yes' if g['0 unexplained 5xx or connection errors'] else '**no**'} |",
             f"| counters agree with clients | {sum(c['holds'] for c in d['counters'])} of {len(d['counters'])} "
             f"hold | {'yes' if g['counters agree with what clients saw'] else '**no**'} |",
             f"| gauges back to 0 | {nonzero or 'all 0'} "
             f"({len(d['gauges_at_end'])} gauges) | {'yes' if g['gauges back to 0'] else '**no**'} |",
             f"| 0 error logs | {d['error_logs']} | {'yes' if g['0 error logs'] else '**no**'} |",
             "", f"{d['requests']:,} requests in {d['seconds']} s; "
             + ", ".join(f"{v} {k}" for k, v in d["events"].items()) + ".", "",
             "| what | clients saw | | counters say |", "|---|---|---|---|"]
    lines += [f"| {c['what']} | {c['clients']:,} | {'=' if c['relation'] == '=' else '≤'} | "
              f"{c['counters']:,}{'' if c['holds'] else ' **does not hold**'} |" for c in d["counters"]]
    lines += ["", "sluice's 5xx: " + (", ".join(f"{k}: {v:,}" for k, v in d["sluice_5xx"].items()) or "none") + ".",
              "sluice's 4xx: " + (", ".join(f"{k}: {v:,}" for k, v in d["sluice_4xx"].items()) or "none") + "."]
    if d["unexplained_samples"]:
        lines += ["", "Unexplained: " + "; ".join(f"{k} {s} `{b.strip()[:60]}`" for k, s, b in d["unexplained_samples"])]
    if d["connection_errors"]:
        lines += ["", "Connection errors: " + "; ".join(f"{k} ({v})" for k, v in d["connection_errors"].items())]
    if d["error_log_samples"]:
        lines += ["", "Error logs:", ""] + [f"    {ln[:200]}" for ln in d["error_log_samples"]]
    if d["warning_logs"]:
        lines += ["", "Most frequent warnings:", ""] + [f"    {n} x {ln}" for ln, n in d["warning_logs"].items()]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=int(os.environ.get("SOAK_SECONDS", "600")))
    ap.add_argument("--ecds-every", type=float, default=ECDS_EVERY_S,
                    help="seconds between configuration updates (0: none, to tell their effect apart)")
    ap.add_argument("--baseline", action="store_true",
                    help="sluice with no mechanism, the rest the same: Envoy's own memory, to compare")
    ap.add_argument("--out", default="soak", help="bench/results/OUT.{json,md}")
    a = ap.parse_args()
    provenance.start(harness.WASM)
    d = run(a.seconds, a.ecds_every, a.baseline)
    d["goals"] = goals(d)
    md = markdown(d)
    print("\n" + md)
    rec = provenance.record(harness.WASM)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps({**d, "setup": describe(a.seconds, a.ecds_every), **rec}, indent=1) + "\n")
    (RESULTS / f"{a.out}.md").write_text(
        f"# Soak ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n{provenance.markdown(rec)}\n\n"
        f"{describe(a.seconds, a.ecds_every)}\n\n{md}\n")
    print(f"wrote bench/results/{a.out}.json and {a.out}.md")


if __name__ == "__main__":
    main()
