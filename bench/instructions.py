#!/usr/bin/env python3
"""Instructions per request: the front Envoy run under valgrind's callgrind,
which counts the instructions it executes (on every thread, JIT-compiled wasm
included). Unlike CPU time, the count does not depend on what else the
machine is doing: two runs of the same build agree within about 1%, where
throughput ratios of two `make bench` runs differ by up to 0.15. It is the
figure to compare builds and configurations with on a shared machine.

    python bench/instructions.py                  # every scenario, the built sluice.wasm
    python bench/instructions.py --scenarios none,native,rl
    python bench/instructions.py a=old.wasm b=new.wasm --scenarios rl,all   # builds side by side
    python bench/instructions.py wasm=sluice.wasm native=libsluice_native.so   # the two hosts

A build ending in `.so` is the native build (native/README.md), loaded as
an Envoy dynamic module with the same configuration; it has no JIT code.

For each scenario, a front Envoy (--concurrency 1) starts under callgrind
with instrumentation off, answers WARMUP requests, then counts the
instructions of REQUESTS more (sent one after another on one keep-alive
connection, with the bench's `x-tenant` header), through the same
`direct_response` upstream Envoy as `make bench`. Results go to
bench/results/instructions.{json,md}.

Caveat: under valgrind Envoy answers some 50 times slower, so work done per
unit of time rather than per request (sluice's 100 ms tick, a breaker's
20 ms merge of its counts) is shared by fewer requests and shows here as
more per request than at full speed.
"""

import argparse
import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (also puts tests/ on the path)
import harness  # noqa: E402
import http1  # noqa: E402
import provenance  # noqa: E402
from harness import Envoy, free_port, front_bootstrap, upstream_bootstrap  # noqa: E402
from rls import RlsServer, rls_cluster  # noqa: E402

RL = {"rate_limits": [bench.huge_rule("global")], "response": bench.SAME_HEADERS}
BREAKER = {"circuit_breakers": [{"name": "upstream"}]}
SHEDDER = {"shedders": [{"name": "route", "concurrency": {"max": 100000}}]}
# A bucket that admits the first request and refuses every other one for an
# hour: the refusal scenarios measure only refused requests (429).
REFUSING = {"rate_limits": [{"name": "global", "bucket": {"rate": 1, "period": "1h", "burst": 1}}],
            "response": bench.SAME_HEADERS}

# id, label, kind, sluice configuration (None: no sluice filter), and the
# status every measured request must get.
SCENARIOS = [
    ("none", "no filter", "none", None),
    ("native", "native local_ratelimit (x-ratelimit headers on)", "native", None),
    ("floor", "sluice loaded, config {}", "sluice", {}),
    ("const", "sluice, 1 global rule, no headers", "sluice", {"rate_limits": [bench.huge_rule("global")]}),
    ("rl", "sluice RL (1 global rule, 3 headers as native)", "sluice", RL),
    ("rl_cb", "sluice RL + breaker (keyed by cluster)", "sluice", dict(RL, **BREAKER)),
    ("rl_cb_graded", "sluice RL + breaker (keyed by cluster) with graded breaking", "sluice",
     dict(RL, circuit_breakers=[{"name": "upstream", "error_rate": 1.0, "graded": {"from": 0.05}}])),
    ("rl_cb_hdr", "sluice RL + breaker keyed by a request header", "sluice",
     dict(RL, circuit_breakers=[{"name": "upstream", "key": {"header": bench.TENANT_HEADER[0]}}])),
    ("rl_shed", "sluice RL + shedder", "sluice", dict(RL, **SHEDDER)),
    ("rl_shed_auto", "sluice RL + shedder with an adaptive limit (max: auto)", "sluice",
     dict(RL, shedders=[{"name": "route", "concurrency": {"max": "auto"}}])),
    ("all", "sluice RL + breaker + shedder", "sluice", dict(RL, **BREAKER, **SHEDDER)),
    ("rl_bulkhead", "sluice RL + a concurrency limit per tenant", "sluice",
     dict(RL, concurrency_limits=[{"name": "tenant", "key": [{"header": bench.TENANT_HEADER[0]}], "max": 1000}])),
    ("rl_bulkhead_wait", "sluice RL + a concurrency limit per tenant with max_wait (never full)", "sluice",
     dict(RL, concurrency_limits=[{"name": "tenant", "key": [{"header": bench.TENANT_HEADER[0]}], "max": 1000,
                                   "max_wait": "1s"}])),
    ("rl_retry", "sluice RL + a retry budget (first tries only)", "sluice",
     dict(RL, retry_budgets=[{"name": "api"}])),
    ("rl_deadline", "sluice RL + deadlines read (none sent)", "sluice", dict(RL, deadlines={})),
    ("window", "sluice sliding-window rule (1 global rule, 3 headers as native)", "sluice",
     dict(RL, rate_limits=[{"name": "global", "algorithm": "sliding_window",
                            "window": {"limit": bench.HUGE, "period": "1s"}}])),
    ("rl_shaped", "sluice RL with on_limit: delay (never over the rate)", "sluice",
     dict(RL, rate_limits=[dict(bench.huge_rule("global"), on_limit="delay", max_delay="1s")])),
    ("rl_key", "sluice RL keyed by x-tenant (a local rule)", "sluice",
     dict(RL, rate_limits=[bench.huge_rule("tenant", key=[{"header": bench.TENANT_HEADER[0]}])])),
    ("global", "sluice RL keyed by x-tenant, global (tokens from the reference RLS, one leader per Envoy)",
     "sluice_global",
     dict(RL, rate_limits=[dict(bench.huge_rule("tenant", key=[{"header": bench.TENANT_HEADER[0]}]),
                                **{"global": {"cluster": "rls", "domain": "bench", "instances": 1, "timeout": "5s"}})])),
    ("refused", "sluice, every request refused (1 rule, 3 headers as native)", "sluice", REFUSING, 429),
    ("native_refused", "native local_ratelimit, every request refused (empty bucket)", "native_refused",
     None, 429),
    # One request held open at the upstream fills the only slot: every
    # measured request is shed (503), as in the overload bench's refusals.
    ("shed_refused", "sluice shedder (max 1, no queue, priority header), every request shed", "sluice_hold",
     {"shedders": [{"name": "up", "priority": {"header": "x-priority"}, "concurrency": {"max": 1, "queue": 0}}]},
     503),
]
SCENARIOS = [s if len(s) == 5 else s + (200,) for s in SCENARIOS]
REFUSAL_SCENARIOS = {s[0] for s in SCENARIOS if s[4] != 200}


def filters_for(kind, cfg, wasm):
    if kind == "none":
        return []
    if kind == "native":
        return bench.native(bench.HUGE, bench.HUGE, "1s")
    if kind == "native_refused":
        # One token, refilled after an hour: the first request takes it.
        return bench.native(1, 1, "3600s")
    return [bench.sluice_filter(cfg, wasm)]


# The reference rate-limit service's limits for the `global` scenario: so
# high that it never refuses, per hour (tokens are good until the end of
# the service's window: with windows of a second, each new second starts
# with an empty pool; see docs/global.md).
RLS_LIMITS = {"domain": "bench", "descriptors": [
    {"key": bench.TENANT_HEADER[0], "rate_limit": {"unit": "hour", "requests_per_unit": bench.HUGE}}]}


def count(filters, upstream_port, warmup, requests, tmp, keep=None, expect_jit=False, status=200, rls_port=None,
          hold=False):
    """Instructions the front Envoy executed while answering `requests`,
    each of which must get `status` (warm-up requests: 200 or `status`).
    `rls_port`: the rate-limit service the `rls` cluster leads to. `hold`:
    one request, sent first on a connection of its own, is delayed an hour
    by the upstream's fault filter (it holds a slot the whole run)."""
    port = free_port()
    # A held request outlives the default route's 5 s timeout: none here.
    # It must not outlive the stream idle timeout (5 minutes), kept as in
    # the other scenarios (turning it off saves some 4,000 instructions a
    # request): a run takes seconds, and `check_still_held` fails one
    # whose held request was answered.
    boot = front_bootstrap(port, free_port(), upstream_port, filters, route_timeout="0s" if hold else "5s")
    if rls_port:
        boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    out = Path(tempfile.mkdtemp(dir=tmp)) / "callgrind.out"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--smc-check=all-non-file",
                "--dump-instr=no", f"--callgrind-out-file={out}"]
    # Under valgrind Envoy starts, answers and writes its counts out slowly.
    with Envoy(boot, concurrency=1,
               wrapper=valgrind, ready_s=300, stop_s=120) as front:
        conn = http1.Conn(port, timeout=60)
        headers = dict([bench.TENANT_HEADER])
        held = None
        if hold:
            held = socket.create_connection(("127.0.0.1", port), timeout=60)
            held.sendall(http1.build("/held", {"x-envoy-fault-delay-request": "3600000"}))
            time.sleep(5)  # under valgrind, the held request takes its slot slowly
        # A global rule's key has no tokens until its first batch comes
        # (under valgrind, seconds).
        # and its rate is learned: warm up to 500 admitted in a row first.
        deadline, run = time.time() + 180, 0
        while rls_port and run < 500 and time.time() < deadline:
            run = run + 1 if conn.request(headers=headers).status == 200 else 0
        for i in range(warmup):
            got = conn.request(headers=headers).status
            if got not in (200, status):
                raise RuntimeError(f"warm-up request {i} was answered {got}, neither 200 nor {status}")
        ctl = ["callgrind_control", "--instr=on", str(front.proc.pid)]
        subprocess.run(ctl, check=True, capture_output=True, timeout=60)
        t0 = time.time()
        statuses = [conn.request(headers=headers).status for _ in range(requests)]
        elapsed = time.time() - t0
        ctl[1] = "--instr=off"
        subprocess.run(ctl, check=True, capture_output=True, timeout=60)
        conn.close()
        if held:
            check_still_held(held)
        if statuses.count(status) != requests:
            raise RuntimeError(f"only {statuses.count(status)} of {requests} measured requests were answered "
                               f"{status}")
    # One output file per dump (normally one, at exit): each counts its own
    # stretch, so the files add up. In a file, "summary" and "totals" agree.
    total, jit = 0, 0
    for f in out.parent.glob("callgrind.out*"):
        jit += jit_instructions(f)
        total += max((int(m.group(1)) for m in re.finditer(r"^(?:totals|summary):\s+(\d+)",
                                                           f.read_text(errors="replace"), re.M)), default=0)
    if not total:
        raise RuntimeError(f"no instruction total in {out.parent}")
    if expect_jit and not jit:
        raise RuntimeError("callgrind_annotate showed no instructions in JIT code for a sluice scenario")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for f in out.parent.glob("callgrind.out*"):
            shutil.copy(f, Path(keep) / f.name)
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"instructions_per_request": total / requests, "in_jit_code_per_request": jit / requests,
            "requests": requests,
            "rps_under_valgrind": requests / elapsed}


def check_still_held(held):
    """The held request must still be waiting, unanswered: else the slot
    was free (or the upstream gone) and the measured answers may not be the
    shedder's refusals. Closes its connection."""
    try:
        held.setblocking(False)
        try:
            got = held.recv(1)
        except BlockingIOError:
            return
        raise RuntimeError(f"the held request was answered or its connection closed ({got!r}): "
                           "the measured requests were not all shed by sluice")
    finally:
        held.close()


def jit_instructions(f):
    """Instructions executed in code V8 compiled at run time: sluice's wasm
    and V8's wrappers around its calls to and from Envoy. Envoy's binary is
    stripped, so callgrind names no function there; code outside every
    mapped file and above 4 GiB is V8's code space (none without sluice)."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", str(f)], capture_output=True,
                         text=True, timeout=300).stdout
    jit = 0
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) (?:\(\s*[\d.]+%\)\s+)?\?\?\?:(0x[0-9a-f]+)\S* \[\?\?\?\]$", line)
        if m and int(m.group(2), 16) >= 1 << 32:
            jit += int(m.group(1).replace(",", ""))
    return jit


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", metavar="NAME=FILE",
                    help="sluice builds to compare, .wasm or the native .so (default: the built sluice.wasm)")
    ap.add_argument("--scenarios", default=",".join(s[0] for s in SCENARIOS))
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--out", default="instructions", help="results name under bench/results")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep each count's callgrind output under DIR/SCENARIO-NAME (for callgrind_annotate)")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("valgrind not found: apt-get install -y valgrind (make bench-instructions does this)")
    variants = bench.parse_variants(args.variants or [f"sluice={harness.WASM}"])
    provenance.start(*(path for _, path in variants))
    wanted = args.scenarios.split(",")
    unknown = set(wanted) - {s[0] for s in SCENARIOS}
    if unknown:
        sys.exit(f"unknown scenarios {sorted(unknown)}; known: {[s[0] for s in SCENARIOS]}")
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-instr-") as tmp, contextlib.ExitStack() as stack:
        up = free_port()
        rls = stack.enter_context(RlsServer(RLS_LIMITS)) if "global" in wanted else None
        with Envoy(upstream_bootstrap(up, free_port()), concurrency=1):
            for sid, label, kind, cfg, status in SCENARIOS:
                if sid not in wanted:
                    continue
                sluice = kind.startswith("sluice")
                for vname, wasm in (variants if sluice else [("-", None)]):
                    keep = args.keep and str(Path(args.keep) / f"{sid}-{vname}")
                    r = count(filters_for(kind, cfg, wasm), up, args.warmup, args.requests, tmp, keep,
                              expect_jit=sluice and not provenance.is_native_build(wasm), status=status,
                              rls_port=rls.port if kind == "sluice_global" else None, hold=kind == "sluice_hold")
                    r.update(scenario=sid, label=label, variant=vname)
                    rows.append(r)
                    print(f"  {sid:<8} {vname:<10} {r['instructions_per_request']:>9.0f} instructions/request "
                          f"({r['rps_under_valgrind']:.0f} req/s under valgrind)", flush=True)
    ref = {r["scenario"]: r["instructions_per_request"] for r in rows if r["variant"] in ("-", variants[0][0])}
    first = {r["scenario"]: r["instructions_per_request"] for r in rows if r["variant"] == variants[0][0]}
    for r in rows:
        n = r["instructions_per_request"]
        if len(variants) > 1 and r["variant"] != "-" and r["scenario"] in first:
            r["vs_first_build"] = n - first[r["scenario"]]
        if r["scenario"] in REFUSAL_SCENARIOS:
            # A refusal never reaches the upstream: compared with native's
            # refusal only (the goal: at most 1.3x native's instructions).
            if "native_refused" in ref:
                r["ratio_native_over_this"] = ref["native_refused"] / n
                r["this_over_native_refusal"] = n / ref["native_refused"]
            continue
        if "none" in ref:
            r["added_over_none"] = n - ref["none"]
        if "native" in ref:
            r["ratio_native_over_this"] = ref["native"] / n
        if "none" in ref and "native" in ref and ref["native"] > ref["none"]:
            r["added_vs_native_added"] = (n - ref["none"]) / (ref["native"] - ref["none"])
    for r in rows:
        # The goal for global rules: at most 10% over the same rule kept locally.
        local = [x for x in rows if x["scenario"] == "rl_key" and x["variant"] == r["variant"]]
        if r["scenario"] == "global" and local:
            r["over_local_rule"] = r["instructions_per_request"] / local[0]["instructions_per_request"] - 1
    write(args.out, rows, variants, started, args)


def write(name, rows, variants, started, args):
    vg = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
    lines = ["| scenario | build | instructions / request | added over no filter | of which in code V8 compiled (the wasm and its call wrappers) | "
             "native / this (a throughput ratio if the front Envoy were the only bottleneck; "
             "refusals: native's refusal / this) | "
             "added, in multiples of what native adds | vs the first build | req/s under valgrind |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['variant']} | {r['instructions_per_request']:,.0f} | "
            + (f"{r['added_over_none']:+,.0f}" if "added_over_none" in r else "") + " | "
            + f"{r['in_jit_code_per_request']:,.0f} | "
            + (f"{r['ratio_native_over_this']:.2f}" if "ratio_native_over_this" in r else "") + " | "
            + (f"{r['added_vs_native_added']:.1f}x" if "added_vs_native_added" in r else "") + " | "
            + (f"{r['vs_first_build']:+,.0f}" if "vs_first_build" in r else "") + " | "
            + f"{r['rps_under_valgrind']:.0f} |")
    # The date lets bench/report.py take each scenario from the latest file
    # that counted it (a full run, or a subset written with --out).
    rec = dict(provenance.record(variants=variants), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    md = [f"# sluice: instructions per request ({time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())})", "",
          f"- {vg} (callgrind) counting every instruction of the front Envoy (--concurrency 1), "
          f"{args.requests} requests after {args.warmup} of warm-up, one keep-alive connection, "
          "`direct_response` upstream",
          "- builds: " + ", ".join(f"`{n}` = {Path(p).name} ({Path(p).stat().st_size} bytes)" for n, p in variants),
          provenance.markdown(rec),
          "- Deterministic to about 1% between runs, whatever the machine's load. Work done per unit of "
          "time (the 100 ms tick, a breaker's 20 ms merge) is overstated: Envoy runs some 50x slower "
          "under valgrind, so fewer requests share it.",
          f"- Whole run: {time.time() - started:.0f} s", "", "\n".join(lines), ""]
    for r in rows:
        if "over_local_rule" in r:
            md.append(f"- A global rule ({r['variant']}) costs {r['over_local_rule']:+.1%} per request over the same "
                      "rule kept locally (goal: at most +10%).")
            print(md[-1])
    bench.RESULTS.mkdir(parents=True, exist_ok=True)
    (bench.RESULTS / f"{name}.md").write_text("\n".join(md))
    (bench.RESULTS / f"{name}.json").write_text(json.dumps({"rows": rows, "variants": variants, **rec}, indent=1) + "\n")
    print("\n" + "\n".join(lines))
    print(f"wrote bench/results/{name}.json and {name}.md")


if __name__ == "__main__":
    main()
