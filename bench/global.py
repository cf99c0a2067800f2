#!/usr/bin/env python3
"""Global rate limiting side by side, in one run (part of `make bench`;
alone: `make bench-global`), against the same reference rate-limit service
(rls/, counters in memory, a limit so high it never refuses):

1. native: Envoy's `envoy.filters.http.ratelimit`, one ShouldRateLimit call
   per request (the route's `remote_address` action);
2. sluice global: the same limit as a sluice rule with a `global` section
   (tokens fetched in batches by one leader per Envoy, ahead of need);
3. sluice local: the same rule without `global` (the floor for 2).

All three front the same upstream Envoy, at --concurrency 2, with the same
three X-RateLimit-* headers on every answer. Each round starts a fresh
front Envoy per arm (arms in a rotating order), warms it up, then measures
wrk flat out (throughput, p50/p99, CPU per request, calls to the service
per request served at steady load) and then wrk at a fixed unsaturated rate
(p50/p99 as wrk sees them, and Envoy's own time per request from its access
log, as bench/bench.py's paced rounds). About 2 minutes; writes
bench/results/global.{json,md}, with the goals next to the results:

- sluice global throughput >= 1.5x native;
- sluice global p99 within 100 us of sluice local p99;
- calls to the service per request < 0.05 at steady load.

    python bench/global.py            # the default run
    python bench/global.py --quick    # 1 round of 1 s phases: a smoke test

The service is its release build (`make rls-release`; SLUICE_RLS_BIN
chooses another binary): a debug build spends several times more CPU per
call, which would slow the native arm, and only it, several fold. It runs
on the same 2 cores as everything else, so the native arm pays for its
calls on this machine twice, in Envoy and in the service (both CPU figures
are reported); rounds during which other processes used the CPU are
flagged. Figures from a shared 2-core machine are noisy:
quote the ratios of one run.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The service's release build (make rls-release) unless SLUICE_RLS_BIN says
# otherwise: the native arm's throughput depends on the service's speed, and
# a debug build spends several times more CPU per call.
os.environ.setdefault("SLUICE_RLS_BIN", str(Path(__file__).resolve().parent.parent
                                            / "rls/target/release/sluice-rls"))
import bench  # noqa: E402  (puts tests/ on sys.path; the real Envoy binary)
import harness  # noqa: E402
import provenance  # noqa: E402
from harness import Envoy, free_port, front_bootstrap, upstream_bootstrap, wasm_filter  # noqa: E402
from rls import RLS_BIN, RlsServer, limited_route, ratelimit_filter, rls_cluster  # noqa: E402

ROOT = bench.ROOT
RESULTS = bench.RESULTS
NAME = "global"

DOMAIN = "sluice-bench"
# Never reached in a run: every request is admitted by all three arms.
LIMIT_PER_HOUR = 100_000_000
LIMITS = [{"domain": DOMAIN, "descriptors": [
    {"key": "remote_address", "rate_limit": {"unit": "hour", "requests_per_unit": LIMIT_PER_HOUR}}]}]
RULE = {"name": "per-client", "key": ["client_address"], "algorithm": "sliding_window",
        "window": {"limit": LIMIT_PER_HOUR, "period": "1h"}}
GLOBAL = {"cluster": "rls", "domain": DOMAIN, "instances": 1, "descriptor_keys": ["remote_address"],
          "timeout": "200ms"}
TIMEOUT = "0.2s"  # the native filter's (a protobuf Duration), the same as the global rule's
CONCURRENCY = 2

# The paced phase: 4 connections, each sending one request 2 ms after the
# previous answer (bench/bench.py's paced rounds).
PACED_CONNECTIONS = 4
PACED_DELAY_MS = 2
PACED_PHASE = "paced"
# A round during which other processes used more CPU than this (in cores)
# is flagged: its figures say more about the machine than about the arm.
BUSY_CORES = 0.2


def sluice_config(rule):
    return {"domain": "bench", "rate_limits": [rule], "response": bench.SAME_HEADERS}


ARMS = [
    {"id": "native", "label": "native envoy.filters.http.ratelimit (1 call per request)",
     "filters": [ratelimit_filter(DOMAIN, timeout=TIMEOUT)],
     "routes": [limited_route([[{"remote_address": {}}]])]},
    {"id": "global", "label": "sluice global rule (batches from the leader)",
     "filters": [wasm_filter(sluice_config(dict(RULE, **{"global": GLOBAL})))], "routes": None},
    {"id": "local", "label": "sluice local rule (same shape, no global)",
     "filters": [wasm_filter(sluice_config(RULE))], "routes": None},
]


def front(arm, upstream_port, rls_port, access_log):
    """A front Envoy for one arm, with the service's cluster (HTTP/2) and an
    access log of Envoy's own time for the paced phase's requests only."""
    log = {"name": "envoy.access_loggers.file",
           "filter": {"header_filter": {"header": {"name": "x-bench-phase",
                                                   "string_match": {"exact": PACED_PHASE}}}},
           "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
               "path": str(access_log),
               "log_format": {"text_format_source": {"inline_string": bench.PROXY_TIME_FORMAT}}}}
    port = free_port()
    boot = front_bootstrap(port, free_port(), upstream_port, arm["filters"], arm["routes"],
                           hcm_extra={"access_log": [log]})
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    e = Envoy(boot, CONCURRENCY)
    e.port = port
    return e


def process_ticks():
    """{pid: user+system CPU clock ticks} of every process now alive."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = bench.cpu_ticks(stat.parent.name)
        except (OSError, ValueError, IndexError):
            pass
    return out


def others_ticks(before, after, ours):
    """CPU ticks spent between two `process_ticks()` by processes other
    than `ours` (those that exited in between are not seen)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items() if pid not in ours)


class Counters:
    """The service's /stats, the front Envoy's request counts and sluice's
    counters, both processes' CPU time, and the CPU time the machine spent
    on anything else, at one moment."""

    def __init__(self, rls, f, upstream, lag=True):
        if lag:
            time.sleep(harness.METRICS_LAG_S)  # sluice's counters reach Envoy on a tick
        self.rls = rls.stats()
        self.envoy = bench.sums(f.stats())
        self.front_cpu = bench.cpu_ticks(f.proc.pid)
        self.rls_cpu = bench.cpu_ticks(rls.proc.pid)
        self.ours = {os.getpid(), f.proc.pid, rls.proc.pid, upstream.proc.pid}
        self.processes = process_ticks()
        self.time = time.monotonic()

    def since(self, before):
        served = max(self.envoy["rq_total"] - before.envoy["rq_total"], 1)
        calls = self.rls["calls"] - before.rls["calls"]
        us = 1e6 / bench.CLK_TCK / served
        return {"served": served, "calls": calls, "calls_per_request": calls / served,
                "hits_per_request": (self.rls["hits"] - before.rls["hits"]) / served,
                "rls_errors": self.rls["errors"] - before.rls["errors"],
                "rls_over_limit": self.rls["over_limit"] - before.rls["over_limit"],
                "sluice_allowed": self.envoy["allowed"] - before.envoy["allowed"],
                "sluice_limited": self.envoy["limited"] - before.envoy["limited"],
                "front_cpu_us_per_request": (self.front_cpu - before.front_cpu) * us,
                "rls_cpu_us_per_request": (self.rls_cpu - before.rls_cpu) * us,
                "other_cores": others_ticks(before.processes, self.processes, self.ours)
                / bench.CLK_TCK / (self.time - before.time)}


def one_round(arm, rnd, upstream, rls, args, tmp):
    access_log = Path(tmp) / f"access-{arm['id']}-{rnd}.log"
    hits_at_start = rls.stats()["hits"]
    with front(arm, upstream.port, rls.port, access_log) as f:
        bench.wrk(f.port, args.warmup, args.connections, 0, tmp, "warm")
        before = Counters(rls, f, upstream)
        sat = bench.wrk(f.port, args.duration, args.connections, 0, tmp, "saturated")
        mid = Counters(rls, f, upstream, lag=False)
        paced = bench.wrk(f.port, args.paced_duration, PACED_CONNECTIONS, PACED_DELAY_MS, tmp, PACED_PHASE)
        after = Counters(rls, f, upstream)
    # Tokens taken from the service over the front Envoy's whole life (those
    # still held when it stops included) per request it served.
    tokens_per_request = (rls.stats()["hits"] - hits_at_start) / max(after.envoy["rq_total"], 1)
    # Envoy writes its access log out as it stops.
    times, partial = bench.proxy_times_us(access_log, PACED_PHASE)
    if not times or partial > PACED_CONNECTIONS or len(times) + partial < paced["requests"]:
        raise RuntimeError(f"the access log has {len(times)} timed and {partial} partial requests; "
                           f"wrk sent {paced['requests']} over {PACED_CONNECTIONS} connections")
    s, p = mid.since(before), after.since(mid)
    return {
        "arm": arm["id"], "round": rnd,
        "rps": sat["rps"], "p50_us": sat["p50_us"], "p99_us": sat["p99_us"], "p999_us": sat["p999_us"],
        "requests": sat["requests"], "non2xx": sat["non2xx"] + paced["non2xx"],
        "socket_errors": sum(w[k] for w in (sat, paced)
                             for k in ("connect_errors", "read_errors", "write_errors", "timeouts")),
        "served": s["served"], "calls_per_request": s["calls_per_request"],
        "hits_per_request": s["hits_per_request"], "tokens_per_request": tokens_per_request,
        "other_cores": s["other_cores"], "rls_errors": s["rls_errors"] + p["rls_errors"],
        "rls_over_limit": s["rls_over_limit"] + p["rls_over_limit"],
        "sluice_allowed": s["sluice_allowed"], "sluice_limited": s["sluice_limited"] + p["sluice_limited"],
        "front_cpu_us_per_request": s["front_cpu_us_per_request"],
        "rls_cpu_us_per_request": s["rls_cpu_us_per_request"],
        "paced_rps": paced["rps"], "paced_p50_us": paced["p50_us"], "paced_p99_us": paced["p99_us"],
        "paced_calls_per_request": p["calls_per_request"],
        "proxy_p50_us": bench.percentile(times, 50), "proxy_p99_us": bench.percentile(times, 99),
        "proxy_logged": len(times),
    }


SUMMARY_KEYS = ("rps", "p50_us", "p99_us", "front_cpu_us_per_request", "rls_cpu_us_per_request",
                "calls_per_request", "hits_per_request", "tokens_per_request", "other_cores", "paced_rps", "paced_p50_us", "paced_p99_us",
                "paced_calls_per_request", "proxy_p50_us", "proxy_p99_us")


def summarize(rows, arms):
    """Medians over rounds per arm; throughput ratios to native (of the
    medians, and the range of each round's paired ratio)."""
    per = {arm["id"]: [r for r in rows if r["arm"] == arm["id"]] for arm in arms}
    out = []
    for arm in arms:
        rs = per[arm["id"]]
        a = {k: statistics.median(r[k] for r in rs) for k in SUMMARY_KEYS}
        a.update(arm=arm["id"], label=arm["label"], rounds=len(rs),
                 non2xx=sum(r["non2xx"] for r in rs), socket_errors=sum(r["socket_errors"] for r in rs),
                 rls_errors=sum(r["rls_errors"] for r in rs),
                 sluice_limited=sum(r["sluice_limited"] for r in rs),
                 busy_rounds=sum(r["other_cores"] > BUSY_CORES for r in rs))
        nat = per.get("native")
        if not nat:
            out.append(a)
            continue
        paired = [x["rps"] / y["rps"] for x, y in zip(sorted(rs, key=lambda r: r["round"]),
                                                      sorted(nat, key=lambda r: r["round"]))]
        a["rps_vs_native"] = a["rps"] / statistics.median(r["rps"] for r in nat)
        a["rps_vs_native_range"] = [min(paired), max(paired)]
        out.append(a)
    return out


def goals(summary, rows):
    by = {a["arm"]: a for a in summary}
    g, glob, loc, nat = [], by.get("global"), by.get("local"), by.get("native")

    def add(goal, where, value, target, met, note=""):
        g.append({"goal": goal, "where": where, "value": value, "target": target, "met": met, "note": note})

    if glob is None:
        add("sluice global: every goal", "-", "not measured", "-", None, "the global arm was left out (--arms)")
        return g + context(summary)

    if nat:
        lo, hi = glob["rps_vs_native_range"]
        add("sluice global throughput vs native", "saturated (wrk flat out)", f"{glob['rps_vs_native']:.2f}x",
            ">= 1.5x", glob["rps_vs_native"] >= 1.5,
            f"ratio of the medians; each round's paired ratio {lo:.2f}-{hi:.2f}x")
    spread = [r["paced_p99_us"] for r in rows if r["arm"] == "local"]
    for key, where, note in () if loc is None else (
            ("proxy_p99_us", "paced, Envoy's own time per request",
             "from the access log: request path plus response path, without the waits on client and "
             "upstream (bench/bench.py's least noisy latency view)"),
            ("paced_p99_us", "paced, as wrk sees it",
             f"sluice local's own p99 ranged {min(spread)}-{max(spread)} µs over the rounds"),
            ("p99_us", "saturated, as wrk sees it",
             "includes queueing behind each arm's throughput")):
        d = glob[key] - loc[key]
        add("sluice global p99 minus sluice local p99", where, f"{d:+.0f} µs ({glob[key]:.0f} vs {loc[key]:.0f})",
            "<= 100 µs", d <= 100, note)
    for key, where in (("calls_per_request", "saturated (steady load, after warm-up)"),
                       ("paced_calls_per_request", "paced")):
        add("calls to the service per request, sluice global", where, f"{glob[key]:.4f}", "< 0.05",
            glob[key] < 0.05, f"native: {nat[key]:.3f}" if nat else "")
    add("(context) tokens taken from the service per request served, sluice global",
        "the front Envoy's whole life (warm-up, flat out, paced)", f"{glob['tokens_per_request']:.3f}", "-", None,
        "hits the service counted / requests the front Envoy served; above 1: tokens fetched ahead and not "
        "spent when it stopped")
    return g + context(summary)


def context(summary):
    return [{"goal": "(context) CPU per request: front Envoy / service", "where": a["arm"],
             "value": f"{a['front_cpu_us_per_request']:.1f} / {a['rls_cpu_us_per_request']:.1f} µs",
             "target": "-", "met": None,
             "note": "the service shares the machine's 2 cores with the front Envoy, the upstream and wrk"}
            for a in summary]


def table(summary):
    lines = ["| arm | req/s | vs native (rounds) | p50 µs | p99 µs | paced p50 / p99 µs "
             "| Envoy's own p50 / p99 µs (paced) | calls/req | calls/req (paced) | front CPU µs/req "
             "| service CPU µs/req | other processes, cores | non-2xx |", "|" + "---|" * 13]
    for a in summary:
        vs = f"{a['rps_vs_native']:.2f} ({a['rps_vs_native_range'][0]:.2f}–{a['rps_vs_native_range'][1]:.2f})" \
            if "rps_vs_native" in a else "-"
        lines.append(
            f"| {a['label']} | {a['rps']:.0f} | {vs} | {a['p50_us']:.0f} "
            f"| {a['p99_us']:.0f} | {a['paced_p50_us']:.0f} / {a['paced_p99_us']:.0f} "
            f"| {a['proxy_p50_us']:.0f} / {a['proxy_p99_us']:.0f} | {a['calls_per_request']:.4f} "
            f"| {a['paced_calls_per_request']:.4f} | {a['front_cpu_us_per_request']:.1f} "
            f"| {a['rls_cpu_us_per_request']:.1f} | {a['other_cores']:.2f} | {a['non2xx']} |")
    return "\n".join(lines)


def print_goals(g):
    for x in g:
        print(f"  {'       ' if x['met'] is None else 'MET    ' if x['met'] else 'NOT MET'}  {x['goal']} "
              f"[{x['where']}]: {x['value']} (target {x['target']})" + (f"  -- {x['note']}" if x["note"] else ""))


def rls_build():
    """`debug` or `release`, from the binary's place under rls/target."""
    parts = Path(RLS_BIN).resolve().parts
    return "release" if "release" in parts else "debug" if "debug" in parts else "unknown"


def write(result):
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    i = result["info"]
    md = [f"# Global rate limiting: native ratelimit filter vs sluice ({i['date']})", "",
          f"- Envoy {i['envoy_version']} front Envoys at `--concurrency {CONCURRENCY}`, upstream: {i['upstream']}",
          f"- Rate-limit service: {i['rls_bin']} ({i['rls_build']} build), counters in memory, one process for "
          f"the whole run, on the same machine; limit {LIMIT_PER_HOUR:,} per hour per `remote_address` "
          "(never reached)",
          f"- Load generator: {i['load_generator']}; {i['rounds']} rounds, a fresh front Envoy per arm and "
          f"round (arms in a rotating order): {i['warmup_s']} s warm-up, {i['round_s']} s flat out "
          f"({i['connections']} connections), then {i['paced_s']} s paced ({PACED_CONNECTIONS} connections, "
          f"each one request {PACED_DELAY_MS} ms after the previous answer); medians shown",
          f"- sluice.wasm: {i['wasm_bytes']} bytes, built by `make build`",
          provenance.markdown(result),
          f"- Machine: {i['cpus']} CPUs, shared; load average {i['load_average_at_start'][0]:.2f} at start. "
          "**Absolute numbers are noise: quote the ratios of one run.**",
          f"- Whole run: {result['elapsed_s']:.0f} s", "",
          "The arms: " + "; ".join(f"**{a['id']}**: {a['label']}" for a in result["arms"]) + ". "
          "The native filter's descriptor is the route's `remote_address` action; sluice's rule is "
          f"`{json.dumps(RULE)}`, with `\"global\": {json.dumps(GLOBAL)}` in the global arm. Every answer "
          "carries the same three `X-RateLimit-*` headers (the native filter's "
          "`enable_x_ratelimit_headers: DRAFT_VERSION_03`, sluice's `ratelimit_headers: legacy, "
          "headers_on_allowed: true`).", "",
          "Calls/req: ShouldRateLimit calls the service received (its `/stats` `calls`) per request the "
          "front Envoy served, in the same phase. CPU µs/req: user+system CPU time of the front Envoy and "
          "of the service per request served, flat out. Other processes: the CPU time of every other "
          "process alive on the machine during the flat-out phase, in cores (/proc/<pid>/stat); above "
          f"{BUSY_CORES} the round says more about the machine than about the arm.", "",
          table(result["summary"]), ""]
    busy = sum(a["busy_rounds"] for a in result["summary"])
    if busy:
        md += [f"**{busy} of {len(result['rounds'])} rounds ran while other processes used more than "
               f"{BUSY_CORES} cores** (the last column): read these figures with care.", ""]
    md += ["## Goals", "", bench.goals_md(result["goals"]), ""]
    (RESULTS / f"{NAME}.md").write_text("\n".join(md))
    print(f"wrote {RESULTS.relative_to(ROOT)}/{NAME}.json and {NAME}.md")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 1 s phases: a smoke test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="seconds flat out before each measured round")
    ap.add_argument("--duration", type=int, default=4, help="seconds measured flat out per round")
    ap.add_argument("--paced-duration", type=int, default=3, help="seconds measured paced per round")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--arms", default=",".join(a["id"] for a in ARMS),
                    help="the arms to run, comma-separated (default: all)")
    args = ap.parse_args()
    arms = [a for a in ARMS if a["id"] in args.arms.split(",")]
    if not arms or len(arms) != len(set(args.arms.split(","))):
        sys.exit(f"--arms: choose among {', '.join(a['id'] for a in ARMS)}")
    if args.quick:
        args.rounds, args.warmup, args.duration, args.paced_duration = 1, 1, 1, 1
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install -y wrk (make bench does this)")
    if not harness.WASM.exists():
        sys.exit(f"{harness.WASM} not found: make build")
    provenance.start(harness.WASM)
    if not RLS_BIN.exists():
        sys.exit(f"{RLS_BIN} not found: make rls-release (or SLUICE_RLS_BIN=<a sluice-rls binary>)")
    info = bench.env_info(args, harness.WASM.stat().st_size)
    info.update(paced_s=args.paced_duration, connections=args.connections, rls_build=rls_build(),
                rls_bin=str(RLS_BIN.relative_to(ROOT)) if RLS_BIN.is_relative_to(ROOT) else str(RLS_BIN))
    started = time.time()
    print(f"sluice global bench: Envoy {info['envoy_version']} at --concurrency {CONCURRENCY}, {info['wrk']}")
    print(f"rate-limit service: {info['rls_bin']} ({info['rls_build']} build, memory store); "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at start")
    print(f"{len(arms)} arms x {args.rounds} rounds, interleaved: {args.warmup} s warm-up, {args.duration} s "
          f"flat out, {args.paced_duration} s paced per round\n")
    rows = []
    up_port = free_port()
    upstream = Envoy(upstream_bootstrap(up_port, free_port()), concurrency=1)
    upstream.port = up_port
    with tempfile.TemporaryDirectory(prefix="sluice-bench-global-") as tmp, \
            upstream as up, \
            RlsServer(LIMITS) as rls:
        plan = [(r, arms[(i + r) % len(arms)]) for r in range(1, args.rounds + 1) for i in range(len(arms))]
        for n, (r, arm) in enumerate(plan, 1):
            row = one_round(arm, r, up, rls, args, tmp)
            rows.append(row)
            print(f"  [{n:>2}/{len(plan)}] round {r} {arm['id']:<7} {row['rps']:>6.0f} rps  p50 {row['p50_us']:>5} us"
                  f"  p99 {row['p99_us']:>6} us  calls/rq {row['calls_per_request']:.4f}"
                  f"  cpu front/rls {row['front_cpu_us_per_request']:.1f}/{row['rls_cpu_us_per_request']:.1f} us"
                  f"  paced p99 {row['paced_p99_us']} us, envoy p50/p99 {row['proxy_p50_us']}/{row['proxy_p99_us']} us"
                  f"  calls/rq {row['paced_calls_per_request']:.4f}"
                  + (f"  BUSY MACHINE: {row['other_cores']:.2f} cores used by other processes"
                     if row["other_cores"] > BUSY_CORES else "")
                  + (f"  NON-2XX {row['non2xx']}" if row["non2xx"] else "")
                  + (f"  SERVICE ERRORS {row['rls_errors']}" if row["rls_errors"] else ""), flush=True)
            if arm["id"] == "global" and row["calls_per_request"] == 0:
                print("  warning: the global arm made no calls to the service while serving requests", flush=True)
    summary = summarize(rows, arms)
    g = goals(summary, rows)
    result = {"info": info, **provenance.record(harness.WASM), "arms": arms, "limits": LIMITS,
              "summary": summary, "goals": g, "rounds": rows, "elapsed_s": time.time() - started}
    print("\n" + table(summary))
    print("\nGoals")
    print_goals(g)
    busy = sum(r["other_cores"] > BUSY_CORES for r in rows)
    if busy:
        print(f"\nwarning: {busy} of {len(rows)} rounds ran while other processes used more than {BUSY_CORES} "
              "cores: run again on a quiet machine")
    print(f"\ntotal {result['elapsed_s']:.0f} s")
    write(result)


if __name__ == "__main__":
    main()
