#!/usr/bin/env python3
"""sluice benchmark: the same load against Envoy with no filter, Envoy's native
local_ratelimit, and sluice, in interleaved rounds on localhost; then the
sustained-rate accuracy and concurrent-exactness checks; then a table of
results against the project's goals. The paced (unsaturated) rounds also
take Envoy's own time on each request from its access log, which leaves
out the waits on wrk and the upstream that make wrk's p99 noise here.

    python bench/bench.py               # the default run (about 5 minutes)
    python bench/bench.py --breakdown   # where a sluice request's time goes
    python bench/bench.py --quick       # 1 s rounds, 1 round: a smoke test
    python bench/bench.py --retry-storm # only the retry storm (bench/retry_storm.py)

Real Envoys only (tests/harness.py starts them as children, each with its own
--base-id and ports, and stops them), real wrk, the built sluice.wasm.
Everything is bounded in time and stops by itself. Results go to
bench/results/<name>.json and .md (default name `latest`, `breakdown` for
--breakdown); the default run also writes the retry storm's own
bench/results/retry-storm.{json,md}. Each JSON records the build and machine
it measured (bench/provenance.py).

Figures from a shared 2-core machine are noisy: quote the ratios of one run,
not absolute numbers.
"""

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests/e2e"))

# The venv's `envoy` script exec()s the real binary (same pid); calling the
# binary directly only saves the Python start-up on each launch.
if "ENVOY_BIN" not in os.environ:
    for real in sorted((ROOT / ".venv/lib").glob("python3*/site-packages/envoy/_bin/envoy")):
        os.environ["ENVOY_BIN"] = str(real)

import harness  # noqa: E402
import http1  # noqa: E402
import provenance  # noqa: E402  (bench/, beside this file)
from harness import Envoy, free_port, front_bootstrap, native_filter, upstream_bootstrap, wasm_filter  # noqa: E402

RESULTS = ROOT / "bench/results"
CLK_TCK = os.sysconf("SC_CLK_TCK")

# A bucket so large it never refuses during a benchmark round.
HUGE = 1_000_000_000
# Sent with every request (the breakdown keys a rule on it).
TENANT_HEADER = ("x-tenant", "bench")

# sluice answers admitted requests with the same three X-RateLimit-* headers
# as the native filter with enable_x_ratelimit_headers, so both do the same
# work for the client.
SAME_HEADERS = {"ratelimit_headers": "legacy", "headers_on_allowed": True}


def sluice_filter(cfg, path):
    """sluice with configuration `cfg` from the build at `path`: the wasm
    filter, or the native build's dynamic-module filter."""
    return native_filter(cfg, lib=path) if provenance.is_native_build(path) else wasm_filter(cfg, wasm=path)


def parse_variants(specs):
    """`NAME=FILE` arguments (builds to compare: a .wasm, or the native
    build's .so for bench/instructions.py) as (name, path) pairs."""
    variants = []
    for v in specs:
        name, sep, path = v.partition("=")
        if not sep or not Path(path).is_file():
            sys.exit(f"expected NAME=FILE with an existing file, got {v!r}")
        variants.append((name, path))
    return variants


def huge_rule(name, key=None):
    r = {"name": name, "bucket": {"rate": HUGE, "period": "1s", "burst": HUGE}}
    if key is not None:
        r["key"] = key
    return r


def sluice(rules, response=SAME_HEADERS):
    cfg = {"rate_limits": rules}
    if response is not None:
        cfg["response"] = response
    return [wasm_filter(cfg)]


def native(max_tokens, tokens_per_fill, fill_interval):
    full = {"numerator": 100, "denominator": "HUNDRED"}
    return [{
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "native_rl",
            "token_bucket": {"max_tokens": max_tokens, "tokens_per_fill": tokens_per_fill,
                             "fill_interval": fill_interval},
            "filter_enabled": {"runtime_key": "native_rl_enabled", "default_value": full},
            "filter_enforced": {"runtime_key": "native_rl_enforced", "default_value": full},
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        },
    }]


# The scenarios of the default run. Each is run at every Envoy concurrency of
# CONCURRENCIES, interleaved. Adding the breaker and shedder later is one
# more entry here (kind "sluice", its filters, and the rules whose CAS
# counters to read).
SCENARIOS = [
    {"id": "none", "label": "no filter", "kind": "none", "filters": []},
    {"id": "native", "label": "native local_ratelimit", "kind": "native",
     "filters": native(HUGE, HUGE, "1s")},
    {"id": "floor", "label": "sluice loaded, config {} (the floor)", "kind": "sluice",
     "note": "sluice with an empty configuration: Envoy creates its VM context and enters the VM "
             "4 times per request, and sluice does nothing: what sluice costs before its rules",
     "filters": [wasm_filter({})]},
    {"id": "sluice", "label": "sluice RL (1 global rule)", "kind": "sluice",
     "filters": sluice([huge_rule("global")])},
    {"id": "all", "label": "sluice RL + breaker + shedder", "kind": "sluice",
     "note": "one global rate-limit rule, a circuit breaker keyed by the upstream cluster (healthy "
             "upstream: stays closed) and a shedder with a global concurrency limit that is never "
             "reached (every request takes and releases a slot, from its worker's lease of free slots "
             "except when the lease is empty: see Slot leases in the README), all on the route",
     "filters": [wasm_filter({
         "rate_limits": [huge_rule("global")],
         "response": SAME_HEADERS,
         "circuit_breakers": [{"name": "upstream"}],
         "shedders": [{"name": "route", "concurrency": {"max": 100000}}],
     })]},
]
CONCURRENCIES = [1, 2, 4]

# Refusals under a flood: every measured request refused (a bucket of one
# token refilled after an hour; the first warm-up request takes it), with
# the same headers as the throughput rounds. req/s here is refused req/s.
REFUSALS = [
    {"id": "native_refused", "label": "native local_ratelimit, every request refused", "kind": "native",
     "filters": native(1, 1, "3600s")},
    {"id": "sluice_refused", "label": "sluice, every request refused", "kind": "sluice",
     "filters": sluice([{"name": "global", "bucket": {"rate": 1, "period": "1h", "burst": 1}}])},
]
REFUSAL_CONCURRENCIES = [1, 2]

# Paced latency: the same filters at a fixed, unsaturated request rate, so
# p99 shows the filter's own latency rather than queueing behind throughput.
PACED = {"ids": ["none", "native", "sluice", "all"], "concurrency": 1,
         "connections": 4, "delay_ms": 2}

# --breakdown: one step of the hot path at a time, at --concurrency 1.
BREAKDOWN = [
    {"id": "none", "label": "no filter", "kind": "none", "filters": []},
    {"id": "native", "label": "native local_ratelimit", "kind": "native",
     "filters": native(HUGE, HUGE, "1s")},
    {"id": "empty", "vs": "none",  "label": "(a) sluice, config {} (loaded, no rules)", "kind": "sluice",
     "filters": [wasm_filter({})]},
    {"id": "nomatch", "vs": "empty",  "label": "(a2) 1 rule that never matches (path_prefix)", "kind": "sluice",
     "filters": sluice([dict(huge_rule("nomatch"), match={"path_prefix": "/never"})], None)},
    {"id": "const", "vs": "empty",  "label": "(b) 1 rule, constant key (1 slot)", "kind": "sluice",
     "filters": sluice([huge_rule("const")], None)},
    {"id": "header", "vs": "const",  "label": "(b2) 1 rule keyed by a header (2 slots)", "kind": "sluice",
     "filters": sluice([huge_rule("hdr", [{"header": "x-tenant"}])], None)},
    {"id": "client", "vs": "const",  "label": "(c) 1 rule keyed by client_address (2 slots)", "kind": "sluice",
     "filters": sluice([huge_rule("client", ["client_address"])], None)},
    {"id": "const8", "vs": "const", "per": 7,  "label": "(bx8) 8 rules, constant key", "kind": "sluice",
     "filters": sluice([huge_rule(f"const{i}") for i in range(8)], None)},
    {"id": "client8", "vs": "client", "per": 7,  "label": "(cx8) 8 rules keyed by client_address", "kind": "sluice",
     "filters": sluice([huge_rule(f"client{i}", ["client_address"]) for i in range(8)], None)},
    {"id": "const_hdrs", "vs": "const",  "label": "(d) (b) + headers_on_allowed, legacy (3 headers)", "kind": "sluice",
     "filters": sluice([huge_rule("const")], SAME_HEADERS)},
]


# ---------------------------------------------------------------- wrk

LUA_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'SLUICE_JSON {"requests":%d,"duration_us":%d,"connect_errors":%d,"read_errors":%d,' ..
    '"write_errors":%d,"non2xx":%d,"timeouts":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,' ..
    '"p999_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean))
end
"""


def wrk(port, duration_s, connections, delay_ms=0, tmp=None, phase=None):
    """Runs wrk (one thread) against the port; returns its summary as a dict.
    `phase`: sent as `x-bench-phase`, which the paced rounds' access log
    records, to tell warm-up requests from measured ones."""
    script = Path(tmp) / f"wrk-{delay_ms}.lua"
    text = LUA_DONE
    if delay_ms:
        text = f"delay = function() return {delay_ms} end\n" + text
    script.write_text(text)
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--timeout", "2s",
           "-s", str(script), "-H", f"{TENANT_HEADER[0]}: {TENANT_HEADER[1]}"]
    cmd += ["-H", f"x-bench-phase: {phase}"] if phase else []
    cmd += [f"http://127.0.0.1:{port}/"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 30)
    m = re.search(r"^SLUICE_JSON (\{.*\})$", p.stdout, re.M)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"wrk failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    out = json.loads(m.group(1))
    out["rps"] = out["requests"] / (out["duration_us"] / 1e6)
    return out


def wrk_version():
    p = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    return (p.stdout + p.stderr).strip().splitlines()[0] if (p.stdout + p.stderr).strip() else "wrk"


# ---------------------------------------------------------------- Envoy

def cpu_ticks(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def rss_kb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def sums(stats):
    def total(suffix):
        # Every rule's series (labels are encoded before the metric name).
        return sum(v for k, v in stats.items() if k.startswith("wasmcustom.") and k.endswith(suffix))
    return {
        "cas_retries": total(";.;sluice_rl_cas_retries_total"),
        "allowed": total("result=.=allowed;.;sluice_rl_requests_total"),
        "limited": total("result=.=limited;.;sluice_rl_requests_total"),
        "store_failures": total("result=.=store_failure;.;sluice_rl_requests_total"),
        "reads_skipped": stats.get("wasmcustom.sluice_store_reads_skipped_total", 0),
        "stale_reads": stats.get("wasmcustom.sluice_store_stale_reads_total", 0),
        "native_ok": sum(v for k, v in stats.items() if k.endswith("http_local_rate_limit.ok")),
        "native_limited": sum(v for k, v in stats.items() if k.endswith("http_local_rate_limit.rate_limited")),
        "rq_2xx": stats.get("http.front.downstream_rq_2xx", 0),
        "rq_total": stats.get("http.front.downstream_rq_total", 0),
    }


# Envoy's own time on a request, from its access log: the request path
# (last request byte received to first byte sent upstream: the decoder
# filters, sluice's request work among them, and the router) plus the
# response path (first upstream byte received to last byte sent downstream:
# the encoder filters, sluice's response work among them). It leaves out the
# time spent waiting on the client and the upstream, whose scheduling noise
# on this machine drowns a filter's few µs in wrk's end-to-end latency.
PROXY_TIME_FORMAT = ("%REQ(X-BENCH-PHASE)% %COMMON_DURATION(DS_RX_END:US_TX_BEG:us)% "
                     "%COMMON_DURATION(US_RX_BEG:DS_TX_END:us)%\n")


class Front(Envoy):
    def __init__(self, filters, upstream_port, concurrency, access_log=None):
        """`access_log`: a file for Envoy's own time on each request (see
        PROXY_TIME_FORMAT), read once Envoy has stopped and flushed it."""
        self.port = free_port()
        extra = {"access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log),
            "log_format": {"text_format_source": {"inline_string": PROXY_TIME_FORMAT}}}}]} if access_log else None
        super().__init__(front_bootstrap(self.port, free_port(), upstream_port, filters, hcm_extra=extra),
                         concurrency)


def proxy_times_us(access_log, phase):
    """Envoy's own time (µs) on each request of `phase`, and how many of
    them lack a time point (cut off by wrk's stop, or answered without the
    upstream: a local reply)."""
    times, partial = [], 0
    for line in Path(access_log).read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] != phase:
            continue
        if parts[1].isdigit() and parts[2].isdigit():
            times.append(int(parts[1]) + int(parts[2]))
        else:
            partial += 1
    return times, partial


def percentile(values, q):
    """The nearest-rank percentile (q in 0..100) of a non-empty list."""
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(len(v) * q / 100) - 1))]


def one_round(sc, concurrency, upstream_port, args, tmp, connections=None, delay_ms=0, proxy_time=False):
    """Starts a fresh front Envoy, warms it up, measures one wrk run (and,
    with `proxy_time`, Envoy's own time on each measured request)."""
    access_log = Path(tmp) / f"access-{sc['id']}-{time.time_ns()}.log" if proxy_time else None
    with Front(sc["filters"], upstream_port, concurrency, access_log) as f:
        wrk(f.port, args.warmup, connections or args.connections, delay_ms, tmp, "warm" if proxy_time else None)
        before = sums(f.stats())
        t0 = cpu_ticks(f.proc.pid)
        w = wrk(f.port, args.duration, connections or args.connections, delay_ms, tmp,
                "run" if proxy_time else None)
        cpu = cpu_ticks(f.proc.pid) - t0
        time.sleep(harness.METRICS_LAG_S)  # sluice's counters reach Envoy on a tick
        after = sums(f.stats())
        rss = rss_kb(f.proc.pid)
    d = {k: after[k] - before[k] for k in after}
    served = max(d["rq_total"], 1)
    proxy = {}
    if proxy_time:
        # Envoy writes its log out as it stops; every measured request is in
        # it, and at most one per connection was cut off by wrk's stop.
        times, partial = proxy_times_us(access_log, "run")
        conns = connections or args.connections
        if not times or partial > conns or len(times) + partial < w["requests"]:
            raise RuntimeError(f"the access log has {len(times)} timed and {partial} partial requests; "
                               f"wrk sent {w['requests']} over {conns} connections")
        proxy = {"proxy_p50_us": percentile(times, 50), "proxy_p99_us": percentile(times, 99),
                 "proxy_logged": len(times), "proxy_partial": partial}
    return proxy | {
        "scenario": sc["id"], "concurrency": concurrency,
        "rps": w["rps"], "p50_us": w["p50_us"], "p90_us": w["p90_us"], "p99_us": w["p99_us"],
        "p999_us": w["p999_us"], "requests": w["requests"], "non2xx": w["non2xx"],
        "socket_errors": w["connect_errors"] + w["read_errors"] + w["write_errors"] + w["timeouts"],
        "envoy_requests": d["rq_total"],
        "cas_retries": d["cas_retries"],
        "cas_per_request": d["cas_retries"] / served,
        "skipped_per_request": d["reads_skipped"] / served,
        "stale_per_request": d["stale_reads"] / served,
        "sluice_allowed": d["allowed"], "sluice_store_failures": d["store_failures"],
        "native_ok": d["native_ok"],
        "cpu_us_per_request": cpu / CLK_TCK * 1e6 / served,
        "rss_kb": rss,
    }


def med(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def aggregate(rows, scenarios, concurrencies):
    """Medians over rounds per (scenario, concurrency), with ratios to the no
    filter and native scenarios of the same concurrency."""
    out = []
    for c in concurrencies:
        per = {sc["id"]: [r for r in rows if r["scenario"] == sc["id"] and r["concurrency"] == c]
               for sc in scenarios}
        m = {sid: {k: med(rs, k) for k in ("rps", "p50_us", "p99_us", "cas_per_request",
                                          "skipped_per_request", "stale_per_request",
                                          "cpu_us_per_request", "rss_kb", "proxy_p50_us", "proxy_p99_us")}
             for sid, rs in per.items() if rs}
        for sc in scenarios:
            sid = sc["id"]
            if sid not in m:
                continue
            a = dict(m[sid], cpu_us_per_request_min=min(r["cpu_us_per_request"] for r in per[sid]),
                     scenario=sid, label=sc["label"], concurrency=c, rounds=len(per[sid]),
                     non2xx=sum(r["non2xx"] for r in per[sid]),
                     socket_errors=sum(r["socket_errors"] for r in per[sid]),
                     filter_ran=all(r["sluice_allowed"] >= r["envoy_requests"] > 0 for r in per[sid])
                     if sc["kind"] == "sluice" and sc["id"] not in ("empty", "nomatch", "floor") else None)
            for ref in ("none", "native"):
                if ref not in m:
                    continue
                for k in ("rps", "p50_us", "p99_us", "cpu_us_per_request"):
                    a[f"{k}_vs_{ref}"] = a[k] / m[ref][k] if m[ref][k] else None
                # paired per-round throughput ratios: the spread of the ratio
                paired = [x["rps"] / y["rps"] for x, y in zip(per[sid], per[ref])]
                a[f"rps_vs_{ref}_range"] = [min(paired), max(paired)] if paired else None
                a[f"p99_added_over_{ref}_us"] = a["p99_us"] - m[ref]["p99_us"]
                if a.get("proxy_p99_us") is not None and m[ref].get("proxy_p99_us") is not None:
                    a[f"proxy_p99_added_over_{ref}_us"] = a["proxy_p99_us"] - m[ref]["proxy_p99_us"]
                    a[f"proxy_p50_added_over_{ref}_us"] = a["proxy_p50_us"] - m[ref]["proxy_p50_us"]
            out.append(a)
    return out


def interleaved(scenarios, concurrencies, rounds, upstream_port, args, tmp, **kw):
    rows = []
    plan = [(r, c, sc) for r in range(rounds) for c in concurrencies for sc in scenarios]
    for i, (r, c, sc) in enumerate(plan, 1):
        row = one_round(sc, c, upstream_port, args, tmp, **kw)
        row["round"] = r + 1
        rows.append(row)
        print(f"  [{i:>2}/{len(plan)}] round {r + 1} c{c} {sc['id']:<16} {row['rps']:>8.0f} rps  "
              f"p50 {row['p50_us']:>5} us  p99 {row['p99_us']:>6} us  "
              f"cpu {row['cpu_us_per_request']:>5.1f} us/rq  cas/rq {row['cas_per_request']:.4f}  "
              f"skipped/rq {row['skipped_per_request']:.2f}"
              + (f"  envoy p50/p99 {row['proxy_p50_us']}/{row['proxy_p99_us']} us" if "proxy_p99_us" in row else "")
              + (f"  NON-2XX {row['non2xx']}" if row["non2xx"] else ""), flush=True)
    return rows


# ---------------------------------------------------------------- accuracy

def accuracy(kind, upstream_port, args, tmp):
    """A sustained load at about 5x a rule's rate: are 200s admitted at the
    configured rate? rate 1000/s, burst 100, both filters."""
    rate, burst = args.acc_rate, args.acc_burst
    if kind == "sluice":
        filters = sluice([{"name": "acc", "bucket": {"rate": rate, "period": "1s", "burst": burst}}], None)
    else:
        # Envoy's fill_interval must be >= 50 ms: 1000/s is rate/20 tokens every 50 ms.
        filters = native(burst, rate // 20, "0.05s")
    conns = args.acc_connections
    with Front(filters, upstream_port, args.acc_concurrency) as f:
        before = sums(f.stats())
        w = wrk(f.port, args.acc_duration, conns, args.acc_delay_ms, tmp)
        time.sleep(harness.METRICS_LAG_S)
        after = sums(f.stats())
    secs = w["duration_us"] / 1e6
    admitted = w["requests"] - w["non2xx"]
    envoy_2xx = after["rq_2xx"] - before["rq_2xx"]
    expected = burst + rate * secs
    return {
        "filter": kind, "rate_per_s": rate, "burst": burst, "duration_s": secs,
        "offered_rps": w["requests"] / secs, "offered_x_rate": w["requests"] / secs / rate,
        "admitted_wrk": admitted, "admitted_envoy_2xx": envoy_2xx, "refused": w["non2xx"],
        "expected": expected, "error_pct": (envoy_2xx - expected) / expected * 100,
        "concurrency": args.acc_concurrency, "connections": conns,
    }


def exactness(kind, upstream_port):
    """burst 200, 1,000 requests at once over 20 connections, 4 workers."""
    if kind == "sluice":
        filters = sluice([{"name": "exact", "key": ["client_address"],
                           "bucket": {"rate": 1, "period": "1h", "burst": 200}}], None)
    else:
        filters = native(200, 1, "3600s")
    with Front(filters, upstream_port, 4) as f:
        before = sums(f.stats())
        batches = [[http1.build()] * 50 for _ in range(20)]
        got = [r.status for batch in http1.burst(f.port, batches) for r in batch]
        time.sleep(harness.METRICS_LAG_S)
        after = sums(f.stats())
    return {"filter": kind, "burst": 200, "requests": len(got), "ok": got.count(200),
            "refused": got.count(429), "over_admission": got.count(200) - 200,
            "cas_retries": after["cas_retries"] - before["cas_retries"]}


# ---------------------------------------------------------------- report

def overload(seconds=4, clients=8):
    """Goodput and p99 under 2x overload, with and without a sluice shedder:
    an upstream serving 4 requests at a time (20 ms each) driven by 8
    closed-loop clients (tests/e2e/test_shed.py's stack and load)."""
    import test_shed  # noqa: E402  (tests/e2e/ is on sys.path)

    shedder = {"shedders": [{"name": "api", "concurrency": {"max": 4, "queue": 64, "max_wait": "500ms"},
                             "target": "5ms", "interval": "100ms"}]}
    out = []
    for label, cfg in (("without sluice", None), ("with sluice shedder", shedder)):
        with test_shed.SlowStack(cfg) as st:
            got = test_shed.load(st.port, seconds, clients=clients)
        steady = [r for r in got if r[4] > 0.5]
        ok = [r[1] for r in steady if r[0] == 200]
        out.append({"setup": label, "clients": clients, "capacity": 4, "service_ms": test_shed.SLOW_MS,
                    "goodput_rps": len(ok) / (seconds - 0.5), "shed_rps": (len(steady) - len(ok)) / (seconds - 0.5),
                    "p50_ms": statistics.median(ok) * 1000 if ok else None,
                    "p99_ms": test_shed.p99(ok) * 1000 if ok else None})
        r = out[-1]
        print(f"  {label:<20} goodput {r['goodput_rps']:.0f}/s, shed {r['shed_rps']:.0f}/s, "
              f"admitted p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms", flush=True)
    return out


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}"


def skipped(a):
    """Shared-data reads skipped and remembered values found stale, per request."""
    if a["scenario"] in ("none", "native"):
        return "-"
    return f"{a['skipped_per_request']:.2f} / {a['stale_per_request']:.2f}"


def table(agg, scenarios):
    head = ("| c | scenario | req/s | vs none | vs native (rounds) | p50 µs | vs none | vs native "
            "| p99 µs | vs none | vs native | +p99 vs none µs | CPU µs/req | vs native | CAS retries/req "
            "| reads skipped / stale per req | RSS MB |")
    lines = [head, "|" + "---|" * 17]
    for a in agg:
        rng = a.get("rps_vs_native_range")
        rng = f" ({rng[0]:.2f}–{rng[1]:.2f})" if rng else ""
        cas = "-" if a["scenario"] in ("none", "native") else f"{a['cas_per_request']:.4f}"
        lines.append(
            f"| {a['concurrency']} | {a['label']} | {a['rps']:.0f} | {fmt_ratio(a.get('rps_vs_none'))} "
            f"| {fmt_ratio(a.get('rps_vs_native'))}{rng} | {a['p50_us']:.0f} | {fmt_ratio(a.get('p50_us_vs_none'))} "
            f"| {fmt_ratio(a.get('p50_us_vs_native'))} | {a['p99_us']:.0f} | {fmt_ratio(a.get('p99_us_vs_none'))} "
            f"| {fmt_ratio(a.get('p99_us_vs_native'))} | {a.get('p99_added_over_none_us', 0):+.0f} "
            f"| {a['cpu_us_per_request']:.1f} | {fmt_ratio(a.get('cpu_us_per_request_vs_native'))} "
            f"| {cas} | {skipped(a)} | {a['rss_kb'] / 1024:.1f} |")
    return "\n".join(lines)


def proxy_table(agg):
    lines = ["| scenario | p50 µs | added over none | p99 µs | added over none |", "|---|---|---|---|---|"]
    for a in agg:
        if a.get("proxy_p99_us") is None:
            continue
        lines.append(f"| {a['label']} | {a['proxy_p50_us']:.0f} | {a.get('proxy_p50_added_over_none_us', 0):+.0f} "
                     f"| {a['proxy_p99_us']:.0f} | {a.get('proxy_p99_added_over_none_us', 0):+.0f} |")
    return "\n".join(lines)


def text_table(agg):
    cols = [("c", 2), ("scenario", 34), ("req/s", 7), ("/none", 5), ("/nat", 5), ("p50us", 6),
            ("/none", 5), ("/nat", 5), ("p99us", 6), ("/none", 5), ("/nat", 5), ("cpu/rq", 6), ("/nat", 5),
            ("cas/rq", 7), ("RSS MB", 6)]
    out = ["  ".join(f"{n:>{w}}" if i != 1 else f"{n:<{w}}" for i, (n, w) in enumerate(cols))]
    for a in agg:
        cas = "-" if a["scenario"] in ("none", "native") else f"{a['cas_per_request']:.4f}"
        vals = [a["concurrency"], a["label"][:34], f"{a['rps']:.0f}", fmt_ratio(a.get("rps_vs_none")),
                fmt_ratio(a.get("rps_vs_native")), f"{a['p50_us']:.0f}", fmt_ratio(a.get("p50_us_vs_none")),
                fmt_ratio(a.get("p50_us_vs_native")), f"{a['p99_us']:.0f}", fmt_ratio(a.get("p99_us_vs_none")),
                fmt_ratio(a.get("p99_us_vs_native")), f"{a['cpu_us_per_request']:.1f}",
                fmt_ratio(a.get("cpu_us_per_request_vs_native")), cas,
                f"{a['rss_kb'] / 1024:.1f}"]
        out.append("  ".join(f"{v:>{w}}" if i != 1 else f"{v:<{w}}" for i, ((_, w), v) in enumerate(zip(cols, vals))))
    return "\n".join(out)


def p99_spread(rows, c):
    v = [r["p99_us"] for r in rows if r["scenario"] == "none" and r["concurrency"] == c]
    return (min(v), max(v)) if v else None


def refusals(rows):
    """Refused requests per second and CPU per refusal, sluice vs native, per
    concurrency (medians over rounds; paired per-round ratio)."""
    out = []
    for c in REFUSAL_CONCURRENCIES:
        per = {sc["id"]: [r for r in rows if r["scenario"] == sc["id"] and r["concurrency"] == c]
               for sc in REFUSALS}
        nat, slu = per["native_refused"], per["sluice_refused"]
        if not nat or not slu:
            continue
        paired = [s["rps"] / n["rps"] for s, n in zip(slu, nat)]
        out.append({
            "concurrency": c,
            "native_refused_rps": statistics.median(r["rps"] for r in nat),
            "sluice_refused_rps": statistics.median(r["rps"] for r in slu),
            "sluice_over_native": statistics.median(paired), "range": [min(paired), max(paired)],
            "native_cpu_us": statistics.median(r["cpu_us_per_request"] for r in nat),
            "sluice_cpu_us": statistics.median(r["cpu_us_per_request"] for r in slu),
            "non429_answers": sum(r["requests"] - r["non2xx"] for r in nat + slu),
        })
    return out


def refusals_md(ragg):
    lines = ["| c | native refused/s | sluice refused/s | sluice / native (rounds) | native CPU µs/refusal "
             "| sluice CPU µs/refusal | answers not refused |", "|---|---|---|---|---|---|---|"]
    for a in ragg:
        lines.append(f"| {a['concurrency']} | {a['native_refused_rps']:.0f} | {a['sluice_refused_rps']:.0f} | "
                     f"{a['sluice_over_native']:.2f} ({a['range'][0]:.2f}–{a['range'][1]:.2f}) | "
                     f"{a['native_cpu_us']:.1f} | {a['sluice_cpu_us']:.1f} | {a['non429_answers']} |")
    return "\n".join(lines)


def goals(agg, paced, acc, exact, rows_raw, ragg=()):
    def get(sid, c, rows=agg):
        return next((a for a in rows if a["scenario"] == sid and a["concurrency"] == c), None)

    g = []

    def add(goal, where, value, target, met, note=""):
        g.append({"goal": goal, "where": where, "value": value, "target": target, "met": met, "note": note})

    # Throughput against native: (scenario, goal, minimum ratio or None for context, note).
    for sid, goal, minimum, note in (
            ("sluice", "sluice RL alone throughput vs native", 0.90, ""),
            ("floor", "(context) the floor: sluice loaded, no work, throughput vs native", None,
             "what loading sluice costs here before any rule runs; the goals above are relative to native"),
            ("all", "all mechanisms throughput vs native", 0.85, "")):
        for c in CONCURRENCIES:
            a = get(sid, c)
            if a and a.get("rps_vs_native") is not None:
                add(goal, f"--concurrency {c}", f"{a['rps_vs_native']:.2f}x",
                    "-" if minimum is None else f">= {minimum:.2f}x",
                    None if minimum is None else a["rps_vs_native"] >= minimum, note)
    for c in CONCURRENCIES:
        a = get("sluice", c)
        if a and a.get("cpu_us_per_request_vs_native") is not None:
            add("sluice RL alone, native/sluice CPU per request (inverse cost ratio)", f"--concurrency {c}",
                f"{1 / a['cpu_us_per_request_vs_native']:.2f}x", ">= 0.90x",
                1 / a["cpu_us_per_request_vs_native"] >= 0.90,
                "front Envoy CPU time per request: less noisy than req/s on a shared machine")
    for rows, how in ((paced, "paced"), (agg, "saturated")):
        for sid in ("sluice", "all"):
            c = PACED["concurrency"] if how == "paced" else 1
            a = get(sid, c, rows)
            if a and a.get("p99_added_over_none_us") is not None:
                add("p99 added over no filter", f"{sid}, {how}, --concurrency {c}",
                    f"{a['p99_added_over_none_us']:+.0f} µs", "<= 100 µs",
                    a["p99_added_over_none_us"] <= 100,
                    ("as wrk sees it; paced = fixed unsaturated rate; saturated = wrk flat out "
                     "(includes queueing behind lower throughput)")
                    + (f"; noise floor: no-filter p99 ranged {spread[0]:.0f}–{spread[1]:.0f} µs over the "
                       "rounds" if (spread := p99_spread(rows_raw[how], c)) else ""))
    for sid in ("sluice", "all"):
        c = PACED["concurrency"]
        a = get(sid, c, paced)
        if a and a.get("proxy_p99_added_over_none_us") is not None:
            add("p99 added over no filter, in Envoy's own time per request", f"{sid}, paced, --concurrency {c}",
                f"{a['proxy_p99_added_over_none_us']:+.0f} µs", "<= 100 µs",
                a["proxy_p99_added_over_none_us"] <= 100,
                "from the front Envoy's access log: request path (last byte in to first byte sent upstream) "
                "plus response path (first upstream byte in to last byte out), p99 with sluice minus p99 "
                "without; leaves out the waits on client and upstream, whose noise drowns it in wrk's p99")
    for sid in ("sluice", "all"):
        c = PACED["concurrency"]
        a, none = get(sid, c, paced), get("none", c, paced)
        if a and none:
            add("(context) front Envoy CPU added per request over no filter", f"{sid}, paced, --concurrency {c}",
                f"{a['cpu_us_per_request'] - none['cpu_us_per_request']:+.0f} µs", "-", None,
                "the filter's own work on a request's path, a steadier view of the latency it adds "
                "than a p99 on this machine")
    for sid in ("sluice", "all"):
        a = get(sid, 4)
        if a:
            add("CAS retries per request", f"{sid}, --concurrency 4",
                f"{a['cas_per_request']:.4f}", "< 0.05", a["cas_per_request"] < 0.05)
    for a in ragg:
        add("refused requests per second, sluice / native", f"--concurrency {a['concurrency']}",
            f"{a['sluice_over_native']:.2f}x", ">= 0.77x (a refusal at most 1.3x native's instructions)",
            a["sluice_over_native"] >= 1 / 1.3,
            "the goal is set in instructions (make bench-instructions); this is the throughput view")
    for r in acc:
        add(f"sustained-rate accuracy ({r['offered_x_rate']:.1f}x load, {r['duration_s']:.0f} s)", r["filter"], f"{r['error_pct']:+.2f} %",
            "within ±2 %", abs(r["error_pct"]) <= 2.0,
            "" if r["filter"] == "sluice" else "reference only; the goal is sluice's")
    for r in exact:
        add("over-admission (burst 200, 1,000 concurrent, 4 workers)", r["filter"],
            str(r["over_admission"]), "0", r["over_admission"] == 0,
            "" if r["filter"] == "sluice" else "reference only; the goal is sluice's")
    return g


def goals_md(g):
    lines = ["| goal | where | measured | target | met | note |", "|---|---|---|---|---|---|"]
    for x in g:
        lines.append(f"| {x['goal']} | {x['where']} | {x['value']} | {x['target']} | "
                     f"{'-' if x['met'] is None else 'met' if x['met'] else '**not met**'} | {x['note']} |")
    return "\n".join(lines)


def env_info(args, wasm_size):
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(), "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "load_average_at_start": os.getloadavg(),
        "envoy": harness.ENVOY,
        "envoy_version": subprocess.run([harness.ENVOY, "--version"], capture_output=True, text=True,
                                        timeout=30).stdout.strip().split("version:")[-1].strip(),
        "load_generator": wrk_version(),
        "wasm": str(harness.WASM.relative_to(ROOT)) if harness.WASM.is_relative_to(ROOT) else str(harness.WASM),
        "wasm_bytes": wasm_size,
        "round_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
        "wrk": f"wrk -t1 -c{args.connections} -d{args.duration}s --latency script; header "
               f"'{TENANT_HEADER[0]}: {TENANT_HEADER[1]}' on every request",
        "upstream": "a second Envoy (--concurrency 1) with a direct_response route",
    }


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--breakdown", action="store_true", help="run the hot-path breakdown experiment instead")
    ap.add_argument("--retry-storm", action="store_true",
                    help="run only the retry storm (goodput with and without a retry budget)")
    ap.add_argument("--quick", action="store_true", help="1 s rounds, 1 round, short accuracy: a smoke test")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per scenario (3; 6 with --breakdown)")
    ap.add_argument("--duration", type=int, default=None,
                    help="seconds measured per round (5; 2 with --breakdown)")
    ap.add_argument("--warmup", type=int, default=1, help="seconds of load before each measured round")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--acc-rate", type=int, default=1000)
    ap.add_argument("--acc-burst", type=int, default=100)
    ap.add_argument("--acc-duration", type=int, default=10)
    ap.add_argument("--acc-connections", type=int, default=16)
    ap.add_argument("--acc-delay-ms", type=int, default=2)
    ap.add_argument("--acc-concurrency", type=int, default=2)
    ap.add_argument("--out", default=None, help="results name under bench/results (default latest/breakdown)")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 6 if args.breakdown else 3
    if args.duration is None:
        args.duration = 2 if args.breakdown else 5
    if args.quick:
        args.rounds, args.duration, args.warmup, args.acc_duration = 1, 1, 1, 2
    name = args.out or ("breakdown" if args.breakdown else "latest")
    if args.retry_storm:
        import retry_storm  # noqa: E402  (bench/ is on sys.path)
        retry_storm.main()
        return

    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install -y wrk (make bench does this)")
    if not harness.WASM.exists():
        sys.exit(f"{harness.WASM} not found: make build")
    provenance.start(harness.WASM)
    wasm_size = harness.WASM.stat().st_size
    info = env_info(args, wasm_size)
    started = time.time()
    print(f"sluice bench: Envoy {info['envoy_version']}, load generator {info['load_generator']} "
          f"({info['wrk']}), upstream: {info['upstream']}")
    print(f"sluice.wasm: {wasm_size} bytes; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at start")
    print("Absolute figures are noise on a shared machine: quote the ratios of one run.\n")

    RESULTS.mkdir(parents=True, exist_ok=True)
    up_port = free_port()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp, \
            Envoy(upstream_bootstrap(up_port, free_port()), concurrency=1):
        if args.breakdown:
            print(f"Breakdown: {len(BREAKDOWN)} scenarios x {args.rounds} rounds at --concurrency 1, interleaved")
            rows = interleaved(BREAKDOWN, [1], args.rounds, up_port, args, tmp)
            agg = aggregate(rows, BREAKDOWN, [1])
            result = {"info": info, **provenance.record(harness.WASM), "mode": "breakdown", "rounds": rows,
                      "summary": agg, "elapsed_s": time.time() - started}
            write_breakdown(name, result)
            return

        for sc in SCENARIOS:
            if sc.get("note"):
                print(f"note: {sc['label']}: {sc['note']}")
        print(f"Throughput: {len(SCENARIOS)} scenarios x concurrency {CONCURRENCIES} x {args.rounds} rounds, "
              "interleaved")
        rows = interleaved(SCENARIOS, CONCURRENCIES, args.rounds, up_port, args, tmp)
        agg = aggregate(rows, SCENARIOS, CONCURRENCIES)

        print(f"\nRefusals: every request refused, {len(REFUSALS)} scenarios x concurrency "
              f"{REFUSAL_CONCURRENCIES} x {args.rounds} rounds, interleaved")
        rrows = interleaved(REFUSALS, REFUSAL_CONCURRENCIES, args.rounds, up_port, args, tmp)
        ragg = refusals(rrows)

        paced_sc = [sc for sc in SCENARIOS if sc["id"] in PACED["ids"]]
        print(f"\nPaced latency: {PACED['connections']} connections x 1 request per "
              f"{PACED['delay_ms']} ms (unsaturated), --concurrency {PACED['concurrency']}, interleaved")
        prows = interleaved(paced_sc, [PACED["concurrency"]], args.rounds, up_port, args, tmp,
                            connections=PACED["connections"], delay_ms=PACED["delay_ms"], proxy_time=True)
        pagg = aggregate(prows, paced_sc, [PACED["concurrency"]])

        print(f"\nAccuracy: rate {args.acc_rate}/s, burst {args.acc_burst}, ~5x load for "
              f"{args.acc_duration} s, --concurrency {args.acc_concurrency}")
        acc = []
        for kind in ("sluice", "native"):
            r = accuracy(kind, up_port, args, tmp)
            acc.append(r)
            print(f"  {kind:<7} offered {r['offered_rps']:.0f}/s ({r['offered_x_rate']:.1f}x) for "
                  f"{r['duration_s']:.2f} s: admitted {r['admitted_envoy_2xx']} (wrk saw {r['admitted_wrk']}), "
                  f"expected {r['expected']:.0f}: error {r['error_pct']:+.2f} %", flush=True)
        print("\nExactness: burst 200, 1,000 requests at once over 20 connections, --concurrency 4")
        exact = []
        for kind in ("sluice", "native"):
            r = exactness(kind, up_port)
            exact.append(r)
            print(f"  {kind:<7} 200s: {r['ok']}, 429s: {r['refused']}, over-admission {r['over_admission']}"
                  + (f", CAS retries {r['cas_retries']}" if kind == "sluice" else ""), flush=True)

    print(f"\nOverload: 8 clients on an upstream serving 4 at a time (2x), 4 s, --concurrency 2")
    over = overload()
    import retry_storm  # noqa: E402  (bench/ is on sys.path)
    print()
    storm = retry_storm.run()

    g = goals(agg, pagg, acc, exact, {"paced": prows, "saturated": rows}, ragg)
    result = {"info": info, **provenance.record(harness.WASM), "mode": "default", "overload": over, "retry_storm": storm, "scenarios": [{k: v for k, v in sc.items() if k != "filters"}
                                                            for sc in SCENARIOS],
              "summary": agg, "paced_summary": pagg, "accuracy": acc, "exactness": exact, "goals": g,
              "refusals": ragg, "refusal_rounds": rrows,
              "rounds": rows, "paced_rounds": prows, "elapsed_s": time.time() - started}
    print("\nThroughput and latency (median of rounds; ratios to no filter and to native at the same concurrency)")
    print(text_table(agg))
    print("\nRefusals (every request refused)")
    print(refusals_md(ragg))
    print("\nPaced latency (unsaturated)")
    print(text_table(pagg))
    print("\nGoals")
    for x in g:
        print(f"  {'       ' if x['met'] is None else 'MET    ' if x['met'] else 'NOT MET'}  {x['goal']} [{x['where']}]: {x['value']} "
              f"(target {x['target']})" + (f"  -- {x['note']}" if x["note"] else ""))
    print(f"\nsluice.wasm {wasm_size} bytes; total {result['elapsed_s']:.0f} s")
    write_default(name, result)
    retry_storm.write(storm)


def write_default(name, r):
    (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    i = r["info"]
    md = [f"# sluice benchmark ({i['date']})", "",
          f"- Envoy {i['envoy_version']} (front, and upstream: {i['upstream']})",
          f"- Load generator: {i['load_generator']}: {i['wrk']}",
          f"- {i['rounds']} interleaved rounds of {i['round_s']} s (+{i['warmup_s']} s warm-up) per scenario and "
          f"concurrency, a fresh front Envoy per round; medians shown",
          f"- sluice.wasm: {i['wasm_bytes']} bytes, built by `make build`",
          provenance.markdown(r),
          f"- Machine: {i['cpus']} CPUs, shared; load average {i['load_average_at_start'][0]:.2f} at start. "
          "**Absolute numbers are noise: quote the ratios of one run.**",
          f"- Whole run: {r['elapsed_s']:.0f} s", ""]
    for sc in r["scenarios"]:
        if sc.get("note"):
            md.append(f"**Note:** {sc['label']}: {sc['note']}.")
            md.append("")
    md += ["Every rule has a bucket that never refuses (rate and burst 10^9/s); sluice sends the same three "
           "`X-RateLimit-*` headers on admitted responses as the native filter with "
           "`enable_x_ratelimit_headers: DRAFT_VERSION_03` (`ratelimit_headers: legacy`, "
           "`headers_on_allowed: true`). \"vs native (rounds)\" gives the median ratio and the range of the "
           "per-round paired ratios. CPU µs/req is the front Envoy's user+system CPU time per request "
           "(/proc/<pid>/stat), the least noisy cost figure here. RSS is the front Envoy's VmRSS after the round.",
           "", "## Throughput and latency (saturated: wrk flat out)", "", table(r["summary"], None), "",
           "## Refusals under a flood", "",
           "Every measured request refused (429): a bucket of one token refilled after an hour, the same "
           "headers as above; wrk flat out as in the throughput rounds. Refused requests per second, medians "
           "over rounds; the ratio pairs each round's sluice with its native.", "",
           refusals_md(r["refusals"]), "",
           "## Paced latency (fixed unsaturated rate, --concurrency 1)", "",
           "4 connections, each sending one request 2 ms after the previous answer.", "",
           table(r["paced_summary"], None), "",
           "Envoy's own time per request in the same rounds, from its access log: the request path "
           "(`DS_RX_END` to `US_TX_BEG`: the decoder filters and the router) plus the response path "
           "(`US_RX_BEG` to `DS_TX_END`: the encoder filters), without the waits on client and upstream "
           "(medians over rounds):", "", proxy_table(r["paced_summary"]), "",
           "## Accuracy under sustained overload", "",
           "| filter | rate | burst | offered | duration s | admitted (Envoy 2xx) | expected = burst + rate x duration | error |",
           "|---|---|---|---|---|---|---|---|"]
    for a in r["accuracy"]:
        md.append(f"| {a['filter']} | {a['rate_per_s']}/s | {a['burst']} | {a['offered_rps']:.0f}/s "
                  f"({a['offered_x_rate']:.1f}x) | {a['duration_s']:.2f} | {a['admitted_envoy_2xx']} | "
                  f"{a['expected']:.0f} | {a['error_pct']:+.2f} % |")
    md += ["", "Native parameters: `max_tokens` = burst, `tokens_per_fill` = rate/20 every `fill_interval` 50 ms "
           "(Envoy's minimum); sluice: `bucket: {rate, period: 1s, burst}`. Envoy `--concurrency "
           f"{r['accuracy'][0]['concurrency']}`.", "",
           "## Exactness under concurrency", "",
           "burst 200 (no refill to speak of), 1,000 requests sent at once over 20 keep-alive connections, "
           "Envoy `--concurrency 4` (sluice keyed by client_address: 2 slots).", "",
           "| filter | 200s | 429s | over-admission | CAS retries |", "|---|---|---|---|---|"]
    for e in r["exactness"]:
        md.append(f"| {e['filter']} | {e['ok']} | {e['refused']} | {e['over_admission']} | "
                  f"{e['cas_retries'] if e['filter'] == 'sluice' else '-'} |")
    md += ["", "## Goodput and latency under 2x overload (load shedding)", "",
           "An upstream that serves 4 requests at a time, 20 ms each (about 200/s), driven by 8 closed-loop "
           "clients for 4 s; the first 0.5 s left out. With sluice: a shedder with `concurrency.max` 4, "
           "CoDel target 5 ms, interval 100 ms.", "",
           "| setup | goodput /s | shed /s | admitted p50 ms | admitted p99 ms |", "|---|---|---|---|---|"]
    for o in r.get("overload", []):
        md.append(f"| {o['setup']} | {o['goodput_rps']:.0f} | {o['shed_rps']:.0f} | {o['p50_ms']:.1f} | "
                  f"{o['p99_ms']:.1f} |")
    if r.get("retry_storm"):
        import retry_storm  # noqa: E402  (bench/ is on sys.path)
        md += ["", "## Goodput under a retry storm, with and without a retry budget", "",
               retry_storm.describe(), "", retry_storm.markdown(r["retry_storm"])]
    md += ["", "## Goals", "", goals_md(r["goals"]), ""]
    (RESULTS / f"{name}.md").write_text("\n".join(md))
    print(f"wrote {RESULTS.relative_to(ROOT)}/{name}.json and {name}.md")


def write_breakdown(name, r):
    agg = r["summary"]
    base = {a["scenario"]: a for a in agg}
    print("\nBreakdown (median of rounds, --concurrency 1)")
    print(text_table(agg))
    lines = ["| step | req/s | vs none | vs native | compared with | req/s vs that | CPU µs/req "
             "| CPU added over that µs | per extra rule µs | CPU µs/req, min of rounds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    specs = {sc["id"]: sc for sc in BREAKDOWN}
    for a in agg:
        sc = specs.get(a["scenario"], {})
        ref = base.get(sc.get("vs"))
        if ref:
            delta = a["cpu_us_per_request"] - ref["cpu_us_per_request"]
            a["compared_with"] = ref["scenario"]
            a["rps_vs_compared"] = a["rps"] / ref["rps"]
            a["cpu_added_us"] = delta
            if sc.get("per"):
                a["cpu_per_extra_rule_us"] = delta / sc["per"]
        lines.append(f"| {a['label']} | {a['rps']:.0f} | {fmt_ratio(a.get('rps_vs_none'))} | "
                     f"{fmt_ratio(a.get('rps_vs_native'))} | {ref['label'] if ref else ''} | "
                     f"{fmt_ratio(a.get('rps_vs_compared'))} | {a['cpu_us_per_request']:.1f} | "
                     + (f"{a['cpu_added_us']:+.1f}" if ref else "") + " | "
                     + (f"{a['cpu_per_extra_rule_us']:+.1f}" if "cpu_per_extra_rule_us" in a else "")
                     + f" | {a['cpu_us_per_request_min']:.1f} |")
    i = r["info"]
    md = [f"# sluice hot-path breakdown ({i['date']})", "",
          f"- Envoy {i['envoy_version']} `--concurrency 1`; load generator {i['load_generator']}: {i['wrk']}",
          f"- {i['rounds']} interleaved rounds of {i['round_s']} s (+{i['warmup_s']} s warm-up), medians; "
          f"sluice.wasm {i['wasm_bytes']} bytes",
          provenance.markdown(r),
          "- Buckets never refuse; no response headers except in (d) and (d2). Each step is compared with "
          "the configuration it adds one thing to; the x8 rows add 7 identical rules, so their cost per "
          "extra rule is resolved 7 times better than a single step's. CPU µs/req is the front Envoy's "
          "user+system CPU per request. Shared 2-core machine: read ratios and CPU per request, "
          "not absolute throughput.", "", "\n".join(lines), ""]
    (RESULTS / f"{name}.md").write_text("\n".join(md))
    (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    print("\n" + "\n".join(lines))
    print(f"wrote {RESULTS.relative_to(ROOT)}/{name}.json and {name}.md; total {r['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
