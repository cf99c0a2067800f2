#!/usr/bin/env python3
"""The results table of docs/performance.md, generated from the current
result of each benchmark in bench/results/*.json (standard library only).

    python3 bench/report.py           # rewrite the table in docs/performance.md
    python3 bench/report.py --check   # exit 1 if the table differs from the JSONs

The table sits between the marker comments BEGIN and END below. Each row
names the result file it comes from (bench/results/<name>.json), the
scenario or metric, sluice's figure, what it is compared with (Envoy's
native filter, no filter, another sluice configuration), the ratio and goal,
whether the goal is met, and the build and machine measured (as the bench
scripts record them, bench/provenance.py; "-" where the result does not
record it). A row whose file or fields are missing is left out.

The goals of the instruction counts and of memory are the project's
(docs/performance.md, "Goals"); those of the other benchmarks are the
verdicts the bench scripts wrote into their JSON.
"""

import argparse
import difflib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench/results"
DOC = ROOT / "docs/performance.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

# The project's goals for what bench/instructions.py and bench/memory.py
# measure (their JSONs carry the figures, not the goals).
RL_MIN, ALL_MIN = 0.90, 0.85          # native / sluice instructions per request
REFUSAL_MAX = 1.3                      # sluice's refusal / native's refusal
GLOBAL_OVER_LOCAL_MAX = 0.10           # a global rule over the same rule local
WINDOW_OVER_BUCKET_MAX = 0.10          # a sliding window over a token bucket
MEMORY_OVER_MINIMAL_MAX_MB = 5.0       # RSS over a minimal Rust proxy-wasm filter

KNOWN = ("latest", "breakdown", "instructions", "refusal-shed", "instructions-global", "algorithms",
         "mechanisms", "instructions-native", "memory", "memory-native-c2", "memory-native-c8", "code-shape",
         "global", "overload", "adaptive-matrix", "retry-storm", "soak")


def load(name):
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def yes(met):
    return "-" if met is None else "yes" if met else "**no**"


def n(x):
    return f"{x:,.0f}"


def pct(x):
    return f"{x * 100:+.1f}%" if abs(x) >= 0.001 else f"{x * 100:+.2f}%"


class Table:
    def __init__(self):
        self.rows = []

    def add(self, src, what, sluice, compared, ratio, met, data, variant=None):
        builds = data.get("builds") or {}
        b = builds.get(variant) if variant in builds else data.get("build")
        if src == "code-shape":
            b_text = "no sluice"
        else:
            b_text = provenance.build_text(b)
        m_text = provenance.machine_text(data.get("machine"))
        self.rows.append((f"`{src}`", what, sluice, compared, ratio, met,
                          *("-" if x == "not recorded" else x for x in (b_text, m_text))))

    def markdown(self):
        head = ("| result | scenario / metric | sluice | compared with | ratio; goal | met | build | machine |\n"
                "|---|---|---|---|---|---|---|---|")
        return "\n".join([head] + ["| " + " | ".join(r) + " |" for r in self.rows])


def bench_rows(t):
    d = load("latest")
    if not d:
        return
    s = {(a["scenario"], a["concurrency"]): a for a in d.get("summary", [])}
    conc = sorted({c for _, c in s})
    goals = d.get("goals", [])

    def met_of(goal, where):
        return next((g["met"] for g in goals if g["goal"] == goal and g["where"] == where), None)

    for sid, what, goal, target in (
            ("sluice", "req/s, one rule, c" + "/".join(map(str, conc)),
             "sluice RL alone throughput vs native", RL_MIN),
            ("all", "req/s, rule, breaker, shedder", "all mechanisms throughput vs native", ALL_MIN)):
        rows = [s[(sid, c)] for c in conc if (sid, c) in s]
        nat = [s[("native", c)] for c in conc if ("native", c) in s]
        if not rows or len(rows) != len(nat):
            continue
        t.add("latest", what, " / ".join(n(a["rps"]) for a in rows), "native " + " / ".join(n(a["rps"]) for a in nat),
              " / ".join(f"{a['rps_vs_native']:.2f}x" for a in rows) + f"; ≥ {target:.2f}x",
              " / ".join(yes(met_of(goal, f"--concurrency {a['concurrency']}")) for a in rows), d)
    paced = {a["scenario"]: a for a in d.get("paced_summary", [])}
    if all(k in paced for k in ("sluice", "all", "native")):
        w = "sluice, paced, --concurrency 1"
        t.add("latest", "p99 over no filter, Envoy's own time, paced c1: rule / rule, breaker, shedder",
              f"{paced['sluice']['proxy_p99_added_over_none_us']:+.0f} / {paced['all']['proxy_p99_added_over_none_us']:+.0f} µs",
              f"native {paced['native']['proxy_p99_added_over_none_us']:+.0f} µs", "≤ +100 µs",
              " / ".join(yes(met_of("p99 added over no filter, in Envoy's own time per request", w.replace("sluice", x)))
                         for x in ("sluice", "all")), d)
    if ("sluice", 4) in s and ("all", 4) in s:
        t.add("latest", "CAS retries per request, c4: the same two",
              f"{s[('sluice', 4)]['cas_per_request']:.4f} / {s[('all', 4)]['cas_per_request']:.4f}", "-", "< 0.05",
              " / ".join(yes(met_of("CAS retries per request", f"{x}, --concurrency 4")) for x in ("sluice", "all")), d)
    for a in d.get("refusals", []):
        t.add("latest", f"refused req/s, every request refused (c{a['concurrency']})", n(a["sluice_refused_rps"]),
              f"native {n(a['native_refused_rps'])}", f"{a['sluice_over_native']:.2f}x; ≥ {1 / REFUSAL_MAX:.2f}x",
              yes(a["sluice_over_native"] >= 1 / REFUSAL_MAX), d)
    acc = {a["filter"]: a for a in d.get("accuracy", [])}
    if "sluice" in acc and "native" in acc:
        t.add("latest", f"sustained-rate accuracy at {acc['sluice']['offered_x_rate']:.1f}x the rate",
              f"{acc['sluice']['error_pct']:+.2f}%", f"native {acc['native']['error_pct']:+.2f}%", "within ±2%",
              yes(abs(acc["sluice"]["error_pct"]) <= 2), d)
    ex = {a["filter"]: a for a in d.get("exactness", [])}
    if "sluice" in ex and "native" in ex:
        t.add("latest", "over-admission: burst 200, 1,000 at once, c4",
              str(ex["sluice"]["over_admission"]), f"native {ex['native']['over_admission']}", "0",
              yes(ex["sluice"]["over_admission"] == 0), d)


def breakdown_rows(t):
    d = load("breakdown")
    if not d:
        return
    s = {a["scenario"]: a for a in d.get("summary", [])}
    if "const8" in s and "client8" in s:
        t.add("breakdown", "CPU per extra rule, c1: constant key / per client",
              f"{s['const8']['cpu_per_extra_rule_us']:+.1f} / {s['client8']['cpu_per_extra_rule_us']:+.1f} µs",
              "-", "-", "-", d)


def by_scenario(d):
    """An instruction count's rows by scenario, of its first build only (a
    run with NAME=FILE.wasm arguments counts several side by side)."""
    first = d["variants"][0][0] if d.get("variants") else None
    return {x["scenario"]: x for x in d.get("rows", []) if x.get("variant") in ("-", first)}


def counted(name, scenarios):
    """The instruction counts of `scenarios`: from the file `name` (a subset
    written with --out) or from `instructions` (every scenario), whichever
    has them all and is dated later (an undated file counts as older; on a
    tie, `name`). Returns (file name, JSON) or (None, None)."""
    best = (None, None)
    for f in (name, "instructions"):
        d = load(f)
        if d and set(scenarios) <= set(by_scenario(d)):
            if best[1] is None or d.get("date", "") > best[1].get("date", ""):
                best = (f, d)
    return best


def instruction_rows(t):
    d = load("instructions")
    if d:
        r = by_scenario(d)
        v = d["variants"][0][0] if d.get("variants") else None
        if "native" in r and "none" in r:
            nat, none = r["native"]["instructions_per_request"], r["none"]["instructions_per_request"]

            def cell(sid):
                return f"{n(r[sid]['instructions_per_request'])} ({n(r[sid]['in_jit_code_per_request'])})"

            first = True
            for sid, what, target in (("floor", "instructions / request (of which in the wasm): sluice `{}`", None),
                                      ("rl", "the same: one rule, native's 3 headers", RL_MIN),
                                      ("rl_cb", "the same: rule, breaker", None),
                                      ("all", "the same: rule, breaker, shedder", ALL_MIN)):
                if sid not in r:
                    continue
                ratio = nat / r[sid]["instructions_per_request"]
                t.add("instructions", what, cell(sid), f"native {n(nat)}" + (f"; no filter {n(none)}" if first else ""),
                      ("native / sluice " if first else "") + f"{ratio:.2f}x" + (f"; ≥ {target:.2f}x" if target else ""),
                      yes(ratio >= target) if target else "-", d, v)
                first = False
    src, d = counted("refusal-shed", ("native_refused", "refused"))
    if d:
        r = by_scenario(d)
        if "native_refused" in r:
            nat = r["native_refused"]["instructions_per_request"]
            for sid, what in (("refused", "instructions / refused request: rule"),
                              ("shed_refused", "the same: shedder (503)")):
                if sid in r:
                    x = r[sid]["instructions_per_request"] / nat
                    t.add(src, what, n(r[sid]["instructions_per_request"]), f"native's refusal {n(nat)}",
                          f"{x:.2f}x; ≤ {REFUSAL_MAX}x", yes(x <= REFUSAL_MAX), d, r[sid]["variant"])
    src, d = counted("instructions-global", ("rl_key", "global"))
    if d:
        r = by_scenario(d)
        if "global" in r and "rl_key" in r:
            x = r["global"]["instructions_per_request"] / r["rl_key"]["instructions_per_request"] - 1
            t.add(src, "instructions / request: global rule",
                  n(r["global"]["instructions_per_request"]),
                  f"the rule local {n(r['rl_key']['instructions_per_request'])}",
                  f"{pct(x)}; ≤ +{GLOBAL_OVER_LOCAL_MAX:.0%}", yes(x <= GLOBAL_OVER_LOCAL_MAX), d,
                  r["global"]["variant"])
    src, d = counted("algorithms", ("rl", "window", "rl_shaped"))
    if d:
        r = by_scenario(d)
        if all(k in r for k in ("rl", "window", "rl_shaped")):
            b = r["rl"]["instructions_per_request"]
            x, y = (r[k]["instructions_per_request"] / b - 1 for k in ("window", "rl_shaped"))
            t.add(src, "the same: sliding window / `on_limit: delay`",
                  f"{n(r['window']['instructions_per_request'])} / {n(r['rl_shaped']['instructions_per_request'])}",
                  f"token bucket {n(b)}", f"{pct(x)} / {pct(y)}; window ≤ +{WINDOW_OVER_BUCKET_MAX:.0%}",
                  yes(x <= WINDOW_OVER_BUCKET_MAX), d, r["window"]["variant"])
    src, d = counted("mechanisms", ("rl", "rl_bulkhead", "rl_retry", "rl_deadline"))
    if d:
        r = by_scenario(d)
        ks = ("rl_bulkhead", "rl_retry", "rl_deadline")
        if "rl" in r and all(k in r for k in ks):
            b = r["rl"]["instructions_per_request"]
            t.add(src, "the same: rule, plus bulkhead / retry budget / deadlines",
                  " / ".join(n(r[k]["instructions_per_request"]) for k in ks), f"the rule alone {n(b)}",
                  " / ".join(f"{r[k]['instructions_per_request'] - b:+,.0f}" for k in ks), "-", d,
                  r["rl"]["variant"])


def memory_rows(t):
    d = load("memory")
    if d:
        r = {x["scenario"]: x for x in d["rows"]}
        # sluice's two rows, of the first build measured.
        v = next((x["variant"] for x in d["rows"] if x["scenario"].startswith("empty-")), None)
        sl = [r.get(f"empty-{v}"), r.get(f"demo-{v}")]
        sl = [x for x in sl if x]
        if "minimal" in r and "none" in r and len(sl) == 2:
            mb = lambda x: x["median_kib"]["VmRSS"] / 1024  # noqa: E731
            worst = max(x["over_minimal_mb"] for x in sl)
            t.add("memory", "RSS, c2: sluice `{}` / demo rule",
                  " / ".join(f"{mb(x):.1f}" for x in sl) + " MB",
                  f"minimal filter {mb(r['minimal']):.1f}; no filter {mb(r['none']):.1f} MB",
                  " / ".join(f"{x['over_minimal_mb']:+.1f}" for x in sl) + f" MB; ≤ +{MEMORY_OVER_MINIMAL_MAX_MB:.0f} MB",
                  yes(worst <= MEMORY_OVER_MINIMAL_MAX_MB), d, sl[0].get("variant"))
    d = load("code-shape")
    if d and "minimal" in d.get("median_kib", {}):
        m = d["median_kib"]
        base = m["minimal"]["VmRSS"]
        shapes = [k for k in m if k != "minimal"]
        t.add("code-shape", "RSS of code added, functions x lines (c: each called)",
              ", ".join(f"{k} {(m[k]['VmRSS'] - base) / 1024:+.1f}" for k in shapes) + " MB",
              f"minimal filter {base / 1024:.1f} MB", "-", "-", d)


# The native build's memory goal: RSS over no filter at --concurrency 2 and 8.
NATIVE_RSS_OVER_NONE_MAX_MB = 3.0


def native_memory_rows(t):
    """bench/memory.py with the wasm and the native build side by side at
    --concurrency 2 and 8 (`memory-native-c2`, `memory-native-c8`): the
    native build's RSS over no filter with `{}` and with the demo rule
    (10,000 slots), the wasm build's beside it."""
    runs = [d for d in (load("memory-native-c2"), load("memory-native-c8")) if d]
    if len(runs) != 2:
        return
    cells = {}  # (build kind, scenario kind) -> [c2, c8]
    for d in runs:
        over = {x["scenario"]: x["over_none_mb"] for x in d["rows"]}
        for name, path in d.get("variants", []):
            kind = "native" if provenance.is_native_build(path) else "wasm"
            for sc in ("empty", "demo"):
                cells.setdefault((kind, sc), []).append(over.get(f"{sc}-{name}"))
    mine = [cells.get(("native", sc)) for sc in ("empty", "demo")]
    wasm = [cells.get(("wasm", sc)) for sc in ("empty", "demo")]
    if any(v is None or None in v or len(v) != 2 for v in mine):
        return
    fmt = lambda vs: " / ".join(f"{x:+.1f}" for x in vs)  # noqa: E731
    beside = ("wasm build " + "; ".join(fmt(v) for v in wasm) + " MB"
              if all(v and None not in v and len(v) == 2 for v in wasm) else "-")
    native = next((v[0] for v in runs[-1].get("variants", []) if provenance.is_native_build(v[1])), None)
    t.add("memory-native-c8", "native build: RSS over no filter, c2 / c8: `{}`; demo rule",
          "; ".join(fmt(v) for v in mine) + " MB", beside, f"≤ +{NATIVE_RSS_OVER_NONE_MAX_MB:.0f} MB",
          "; ".join(yes(max(v) <= NATIVE_RSS_OVER_NONE_MAX_MB) for v in mine), runs[-1], native)


def global_rows(t):
    d = load("global")
    if not d:
        return
    s = {a["arm"]: a for a in d.get("summary", [])}
    goals = d.get("goals", [])

    def met_of(goal, where):
        return next((g["met"] for g in goals if g["goal"] == goal and g["where"] == where), None)

    if "global" in s and "native" in s:
        t.add("global", "req/s (c2), a global rule", n(s["global"]["rps"]),
              f"native ratelimit + RLS {n(s['native']['rps'])}", f"{s['global']['rps_vs_native']:.2f}x; ≥ 1.5x",
              yes(met_of("sluice global throughput vs native", "saturated (wrk flat out)")), d)
    if "global" in s and "local" in s:
        t.add("global", "Envoy's own p99 (paced), a global rule", f"{s['global']['proxy_p99_us']:.0f} µs",
              f"the rule local {s['local']['proxy_p99_us']:.0f} µs",
              f"{s['global']['proxy_p99_us'] - s['local']['proxy_p99_us']:+.0f} µs; ≤ +100 µs",
              yes(met_of("sluice global p99 minus sluice local p99", "paced, Envoy's own time per request")), d)
    if "global" in s:
        t.add("global", "calls to the service per request", f"{s['global']['calls_per_request']:.4f}",
              f"native {s['native']['calls_per_request']:.3f}" if "native" in s else "-", "< 0.05",
              yes(met_of("calls to the service per request, sluice global", "saturated (steady load, after warm-up)")),
              d)


def overload_rows(t):
    d = load("overload")
    if not d:
        return
    for g in d.get("goals") or []:
        gs = {k: next((x for x in g["goals"] if x["goal"].startswith(k)), None)
              for k in ("admitted p99", "goodput at least", "no class below its share")}
        rounds = len(g["rounds"])
        pause = f", clients pause {g['pause_ms']:.0f} ms on refusal" if g["pause_ms"] else ""
        nat, ours = g["native"], g["sluice"]
        p99 = gs.get("admitted p99")
        if p99 and not pause:
            t.add("overload", f"`auto` limit: worst-class p99, {rounds} rounds",
                  f"{ours['worst_p99_ms']:.0f} ms", f"adaptive_concurrency {nat['worst_p99_ms']:.0f} ms",
                  "≤ native's", yes(p99["met"]), d)
        gp = gs.get("goodput at least")
        if gp:
            t.add("overload", f"`auto` limit: goodput{pause}", f"{ours['goodput_rps']:.1f}/s",
                  f"adaptive_concurrency {nat['goodput_rps']:.1f}/s", "≥ native's", yes(gp["met"]), d)
        sh = gs.get("no class below its share")
        if sh and not pause:
            t.add("overload", "`auto` limit: shares 50 / 35 / 15",
                  " / ".join(f"{v:.0f}%" for v in ours["share_pct"].values()), "-", "each within 2 points",
                  yes(sh["met"]), d)
    b = {x["setup"]: x for x in d.get("breakers", [])}
    keys = ("sluice breaker, graded", "sluice breaker, open/closed", "native admission_control")
    if all(k in b for k in keys):
        gr, oc, ac = (b[k] for k in keys)
        t.add("overload", "50% errors: successes, graded / open-closed",
              f"{n(gr['served_ok_while_failing'])} / {n(oc['served_ok_while_failing'])}",
              f"admission_control {n(ac['served_ok_while_failing'])}", "graded > open-closed",
              yes(gr["served_ok_while_failing"] > oc["served_ok_while_failing"]), d)
        if gr["recovery_s"] is not None and ac["recovery_s"] is not None:
            t.add("overload", "the same: recovery, graded", f"{gr['recovery_s']:.2f} s",
                  f"admission_control {ac['recovery_s']:.2f} s", "≤ native's",
                  yes(gr["recovery_s"] <= ac["recovery_s"]), d)


# The native build's goals (issue: the same engine at native cost): what it
# adds over no filter, in multiples of what native local_ratelimit adds, and
# its refusal over native's.
NATIVE_RL_ADDED_MAX = 1.5
NATIVE_ALL_ADDED_MAX = 2.0
NATIVE_REFUSAL_MAX = 1.05


def native_build_rows(t):
    """bench/instructions.py with the wasm build and the native build side
    by side (`instructions-native`): the native build's rows, the wasm
    build's figure beside each."""
    d = load("instructions-native")
    if not d:
        return
    builds = {v[0]: v[1] for v in d.get("variants", [])}
    native = next((k for k, path in builds.items() if provenance.is_native_build(path)), None)
    wasm = next((k for k, path in builds.items() if not provenance.is_native_build(path)), None)
    r = {(x["scenario"], x["variant"]): x["instructions_per_request"] for x in d.get("rows", [])}
    none, nat = r.get(("none", "-")), r.get(("native", "-"))
    if native is None or none is None or nat is None or nat <= none:
        return
    sids = [(sid, goal) for sid, goal in (("rl", NATIVE_RL_ADDED_MAX), ("all", NATIVE_ALL_ADDED_MAX))
            if (sid, native) in r]
    if sids:
        added = [r[(sid, native)] - none for sid, _ in sids]
        x = [a / (nat - none) for a in added]
        beside = ("; wasm build " + " / ".join(f"+{n(r[(sid, wasm)] - none)}" for sid, _ in sids)
                  if all((sid, wasm) in r for sid, _ in sids) else "")
        t.add("instructions-native", "native build: added over no filter, "
              + " / ".join({"rl": "one rule", "all": "rule, breaker, shedder"}[sid] for sid, _ in sids),
              " / ".join(f"+{n(a)}" for a in added), f"local_ratelimit +{n(nat - none)}{beside}",
              " / ".join(f"{v:.1f}x" for v in x) + "; ≤ " + " / ".join(f"{g}x" for _, g in sids),
              " / ".join(yes(v <= g) for v, (_, g) in zip(x, sids)), d, native)
    refused, nat_refused = r.get(("refused", native)), r.get(("native_refused", "-"))
    if refused and nat_refused:
        x = refused / nat_refused
        beside = f"; wasm build {n(r[('refused', wasm)])}" if ("refused", wasm) in r else ""
        t.add("instructions-native", "the same: a refused request", n(refused),
              f"local_ratelimit's refusal {n(nat_refused)}{beside}", f"{x:.2f}x; ≤ {NATIVE_REFUSAL_MAX}x",
              yes(x <= NATIVE_REFUSAL_MAX), d, native)


def matrix_rows(t):
    """bench/adaptive_matrix.py, one row per goal: in how many cells it
    holds, is level within the run's noise or fails (naming those), with
    the median over the cells of both filters' figure (the full table:
    bench/results/adaptive-matrix.md)."""
    d = load("adaptive-matrix")
    if not d or not d.get("cells"):
        return
    cells = d["cells"]
    med = lambda side, k: statistics.median(  # noqa: E731
        [c[side][k] for c in cells if c[side].get(k) is not None] or [0])
    for gid, what, ours, theirs, goal in (
            ("a", "upstream utilisation", f"{med('sluice', 'utilisation_pct'):.0f}%",
             f"adaptive_concurrency {med('native', 'utilisation_pct'):.0f}%", "≥ native's − 5 points"),
            ("b", "admitted p99", f"{med('sluice', 'p99_ms'):.0f} ms",
             f"adaptive_concurrency {med('native', 'p99_ms'):.0f} ms", "≤ native's"),
            ("c", "longest at `min` with idle slots", f"{max(c['sluice']['at_min_s'] or 0 for c in cells):.1f} s",
             "-", "< 1 s")):
        verdicts = {c["name"]: next((g["verdict"] for g in c["goals"] if g["id"] == gid), "-") for c in cells}
        count = lambda v: sum(x == v for x in verdicts.values())  # noqa: E731
        failed = [k for k, v in verdicts.items() if v == "not met"]
        level = count("within noise")
        met = (f"{count('met')} of {len(cells)}" + (f"; level {level}" if level else "")
               + ("; **no**: " + ", ".join(failed) if failed else ""))
        head = f"`auto`, {len(cells)} upstreams, {d['rounds']} rounds" if gid == "a" else "the same"
        cell_med = " (worst cell)" if gid == "c" else " (median of cells)"
        t.add("adaptive-matrix", f"{head}: {what}{cell_med}", ours, theirs, goal, met, d)


def retry_rows(t):
    d = load("retry-storm")
    if not d:
        return
    r = {x["setup"]: x for x in d.get("rows", [])}
    if "sluice retry budget" in r and "no retry budget" in r:
        a, b = r["sluice retry budget"]["after"], r["no retry budget"]["after"]
        t.add("retry-storm", "after a spike: goodput / upstream load",
              f"{a['goodput_per_s']:.1f} / {a['upstream_received_per_s']:.0f} per s",
              f"no budget {b['goodput_per_s']:.1f} / {b['upstream_received_per_s']:.0f}",
              f"{a['goodput_per_s'] / b['goodput_per_s']:.1f}x / {a['upstream_received_per_s'] / b['upstream_received_per_s']:.2f}x",
              "-", d)


def soak_rows(t):
    d = load("soak")
    if not d:
        return
    g, r = d.get("goals") or {}, d["rss"]
    minutes = f"{d['seconds'] / 60:.0f} min"
    t.add("soak", f"{minutes}, every mechanism: RSS after warm-up", f"{r['slope_mb_per_min']:+.2f} MB/min",
          f"95% interval {r['interval_95'][0]:+.2f} to {r['interval_95'][1]:+.2f}", "flat (interval holds 0)",
          yes(g.get("rss flat after warm-up")), d)
    t.add("soak", f"{minutes}: unexplained 5xx, connection errors", f"{d['unexplained_5xx']}, "
          f"{sum(d['connection_errors'].values())}", f"{d['requests']:,} requests", "0",
          yes(g.get("0 unexplained 5xx or connection errors")), d)
    held = sum(c["holds"] for c in d["counters"])
    t.add("soak", f"{minutes}: counters against what clients saw", f"{held} of {len(d['counters'])} hold", "-",
          "all", yes(g.get("counters agree with what clients saw")), d)
    t.add("soak", f"{minutes}: gauges at the end; error logs",
          f"{sum(1 for v in d['gauges_at_end'].values() if v)} not 0; {d['error_logs']}", "-", "0; 0",
          yes(g.get("gauges back to 0") and g.get("0 error logs")), d)


def table():
    t = Table()
    for f in (bench_rows, breakdown_rows, instruction_rows, native_build_rows, memory_rows, native_memory_rows,
              global_rows, overload_rows, matrix_rows, retry_rows, soak_rows):
        f(t)
    return t.markdown()


def splice(doc, tbl):
    """The doc with `tbl` between the markers, or None without them."""
    i, j = doc.find(BEGIN), doc.find(END)
    if i < 0 or j < i:
        return None
    return doc[:i + len(BEGIN)] + "\n" + tbl + "\n" + doc[j:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/performance.md's table differs from bench/results/*.json")
    args = ap.parse_args()
    unknown = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in KNOWN)
    if unknown:
        print(f"bench/report.py: not in the table (not a current result?): "
              f"{', '.join(f'bench/results/{u}.json' for u in unknown)}", file=sys.stderr)
    doc = DOC.read_text()
    tbl = table()
    new = splice(doc, tbl)
    if new is None:
        print(f"{DOC.relative_to(ROOT)}: no {BEGIN} ... {END} markers for the results table", file=sys.stderr)
        return 1
    if args.check:
        if new != doc:
            i, j = doc.find(BEGIN), doc.find(END)
            old_tbl = doc[i + len(BEGIN):j].strip("\n")
            print(f"{DOC.relative_to(ROOT)}: the results table differs from bench/results/*.json "
                  "(make bench-report rewrites it):", file=sys.stderr)
            sys.stderr.writelines(difflib.unified_diff((old_tbl + "\n").splitlines(True), (tbl + "\n").splitlines(True),
                                                       "docs/performance.md", "bench/results/*.json"))
            return 1
        return 0
    if new != doc:
        DOC.write_text(new)
        print(f"wrote the results table in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
