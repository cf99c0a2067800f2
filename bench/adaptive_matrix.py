#!/usr/bin/env python3
"""The adaptive limit's scenario matrix in real Envoys, side by side with
Envoy's native `adaptive_concurrency` (part of `make bench-overload` and
`make bench`): the cells of the simulation's matrix
(src/shed/adaptive_sim/matrix.rs), with shorter phases.

Cells: steady 12 x 20 ms; capacity 4 -> 12 -> 2 slots of 20 ms; noisy
6 x 10-50 ms; 12 x 20 ms becoming 20-45 ms; slow 8 x 100 ms; bimodal
12 x (90% 10 ms, 10% 100 ms); and every one of them again with the CPU
starved (the whole run still fits in about 14 minutes): a busy loop (a
child process, pinned to one core with os.sched_setaffinity, stopped when
the cell ends and by itself if this script goes) competes with the front
Envoy's 2 workers, the upstream and the clients on the 2 cores. The
upstream is tests/capacity_upstream.py; its capacity and service time
change at run time.

Each run: a fresh upstream and front Envoy (2 workers), 32 closed-loop
clients sending again at once (`Load` of tests/e2e/test_adaptive.py), far
over every cell's capacity. The two setups:
- native: `adaptive_concurrency` as bench/overload.py configures it;
- sluice: `concurrency: {max: "auto", adaptive: {max: 200}}`, the
  simulation's settings: every other setting at its default (min 2,
  initial 10, tolerance 1.25, floor_window 30s; a queue of 800 waiters per
  worker, 4 x adaptive.max; max_wait 1s; CoDel target 5ms). overload.py's
  goal setup tunes the queue for priority classes (shares, shed_early,
  max_wait 20ms); this matrix is about the learned limit alone, so no
  classes and the default queue, as an operator who sets only
  `max: "auto"` gets it.

Per run: upstream utilisation (its busy slot-time over capacity x time,
from the upstream's own counter, over the whole cell and per phase),
admitted p99 (200s only), goodput and refused/s over the cell, and every
~0.2 s the limit (sluice: `sluice_shed_limit` of shedder `up`; native:
`gradient_controller.concurrency_limit`) with the upstream's requests in
flight. From those samples, the longest stretch at the minimum with idle
slots: from the first sample whose limit is at `adaptive.min` (sluice's
default, 2; for native its `min_concurrency`, as context) while fewer
requests than the capacity are in flight, to the first sample that is not
(or the cell's end): within one sample interval of the truth. Apart from
the verdict, utilisation and admitted p99 from `WARM_S` after the start
on: what each setup does once past its start.

The verdict rule, fixed before the run (ROUNDS, RULE): per cell, the two
setups alternate which goes first from round to round (and from cell to
cell); medians over the rounds. (a) sluice's utilisation at least native's
minus 5 points; (b) sluice's admitted p99 at most native's; (c) in every
round, sluice's longest stretch at `min` with idle slots under 1 s. (a) and
(b) are "met" if the medians satisfy them; otherwise, from the paired
round-by-round margins (sluice minus native plus 5 points for (a), native
minus sluice for (b)), "within noise" if their signs are mixed or |t| of
their mean is below the 95% bound (T95 of bench/overload.py, rounds - 1
degrees of freedom), else "not met"; one round has no noise to tell, so it
is "met" or "not met". (c) is a guarantee per run: "met" or "not met".

Options: --rounds N, --cells a,b (the names below), --phase-scale F
(multiplies every phase, for a short smoke run). Writes
bench/results/adaptive-matrix.{json,md}.
"""

import argparse
import atexit
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests/e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import provenance  # noqa: E402
from harness import CapacityUpstream, Envoy, free_port, front_bootstrap, wasm_filter  # noqa: E402
from overload import cpu_s, cpu_ticks, limit_reader, native_adaptive, paired_t, pct, steal_pct  # noqa: E402
from test_adaptive import Load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 3
CLIENTS = 32
SAMPLE_S = 0.2
# `adaptive.min`'s default (docs/configuration.md, src/shed/config.rs).
ADAPTIVE_MIN = 2
NATIVE_MIN = native_adaptive()["typed_config"]["gradient_controller_config"]["min_rtt_calc_params"]["min_concurrency"]
UTIL_SLACK_PTS = 5
AT_MIN_MAX_S = 1.0
# Figures after each run's first second too, apart from the verdict: both
# setups start from nothing (native measures its minRTT, sluice's limit
# starts at `adaptive.initial` with CoDel yet to judge its queue), and in
# a cell of 6 s that start weighs on the whole.
WARM_S = 1.0
# A run's start-up and stop (upstream, Envoy compiling the module, clients
# finishing), for the expected duration printed first.
OVERHEAD_S = 2

SETUPS = [
    ("native adaptive_concurrency", native_adaptive()),
    ('sluice, max: "auto"', wasm_filter({"shedders": [{"name": "up", "concurrency": {
        "max": "auto", "adaptive": {"max": 200}}}]})),
]
RULE = (f"Rounds per cell: {{rounds}}, native and sluice alternating which goes first; medians over the rounds. "
        f"(a) sluice's utilisation >= native's - {UTIL_SLACK_PTS} points, (b) sluice's admitted p99 <= native's: "
        "met if the medians satisfy it; else within noise if the paired round-by-round margins have mixed "
        "signs or |t| of their mean is under the 95% bound (rounds - 1 degrees of freedom), else not met. "
        f"(c) sluice's longest stretch at adaptive.min ({ADAPTIVE_MIN}) with idle upstream slots under "
        f"{AT_MIN_MAX_S:.0f} s in every round: met or not met.")


def service(lo, hi=None, slow_pct=0, slow_ms=0):
    """The upstream's service time: uniform lo to hi ms, but slow_ms for
    slow_pct% of requests."""
    return f"/__service?lo={lo}&hi={lo if hi is None else hi}&slow_pct={slow_pct}&slow_ms={slow_ms}"


# (name for --cells, title, phases: (seconds, slots, service time)). The
# simulation's phases are 20 to 60 s; these fit every cell, both setups and
# three rounds into about 14 minutes.
BASE_CELLS = [
    ("steady", "steady 12 x 20 ms", [(6, 12, service(20))]),
    ("capacity", "capacity 4 -> 12 -> 2", [(5, 4, service(20)), (5, 12, service(20)), (5, 2, service(20))]),
    ("noisy", "noisy 6 x 10-50 ms", [(6, 6, service(10, 50))]),
    ("noise-mid", "12 x 20 ms, then 20-45 ms", [(5, 12, service(20)), (10, 12, service(20, 45))]),
    ("slow", "slow 8 x 100 ms", [(8, 8, service(100))]),
    ("bimodal", "bimodal 12 x 10/100 ms", [(6, 12, service(10, 10, 10, 100))]),
]
CELLS = ([(n, t, p, False) for n, t, p in BASE_CELLS]
         + [(f"{n}-starved", f"{t}, starved", p, True) for n, t, p in BASE_CELLS])

BUSY_LOOP = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end, parent = time.monotonic() + float(sys.argv[2]), os.getppid()
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(100000):
        pass
"""


@contextlib.contextmanager
def busy_loop(seconds):
    """A process spinning on one core (the last this script may use) for
    at most `seconds`: stopped on leaving, at this script's exit, and by
    itself once its parent is gone."""
    core = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core), str(seconds)])
    stop = lambda: harness.stop_child(proc, 5)  # noqa: E731
    atexit.register(stop)
    try:
        yield proc
    finally:
        stop()
        atexit.unregister(stop)


def utilisation(before, after, capacity):
    """The busy share of `capacity` slots between two upstream snapshots (%)."""
    span = after["clock_ms"] - before["clock_ms"]
    return 100 * (after["busy_slot_ms"] - before["busy_slot_ms"]) / (capacity * span) if span > 0 else None


def longest_at(samples, floor, end):
    """The longest stretch (s) where the limit is at `floor` or under while
    the upstream has idle slots: from the first sample so to the first
    sample not so (or `end`). `samples`: (t, limit, in flight, capacity)."""
    longest, since = 0.0, None
    for t, limit, busy, cap in samples:
        low = limit is not None and limit <= floor and busy < cap
        if low and since is None:
            since = t
        elif not low and since is not None:
            longest, since = max(longest, t - since), None
    if since is not None:
        longest = max(longest, end - since)
    return longest


def slot_ms(caps, bounds):
    """The capacity's slot-time (ms) over consecutive upstream snapshots:
    `caps[i]` slots from `bounds[i]` to `bounds[i + 1]`."""
    return sum(c * (b["clock_ms"] - a["clock_ms"]) for c, a, b in zip(caps, bounds, bounds[1:]))


def run_phases(up, read, phases):
    """Runs the phases under load: returns when each phase started, the
    upstream's snapshots at each phase change and at the end, the samples
    (t, limit, in flight, capacity), and (time, snapshot, phase) of the
    first sample `WARM_S` after the start."""
    starts, snaps, samples, warm = [], [], [], None
    for secs, cap, svc in phases:
        up.control(svc)
        snaps.append(up.control(f"/__capacity?n={cap}"))
        start = time.time()
        starts.append(start)
        k = 1
        while time.time() < start + secs:
            limit = read() if read else None
            stats = up.stats()
            samples.append((time.time(), limit, stats["busy"], cap))
            if warm is None and time.time() >= starts[0] + WARM_S:
                warm = (time.time(), stats, len(starts) - 1)
            time.sleep(max(0.0, start + k * SAMPLE_S - time.time()))
            k += 1
    snaps.append(up.stats())
    return starts, snaps, samples, warm


def run_one(label, flt, phases, starved):
    """One run of a setup on a cell: its figures."""
    with CapacityUpstream(phases[0][1], 20) as up:
        up.control(phases[0][2])
        port = free_port()
        with Envoy(front_bootstrap(port, free_port(), up.port, [flt]), 2) as front:
            read = limit_reader(front, label)
            spin = busy_loop(sum(p[0] for p in phases) + 30) if starved else contextlib.nullcontext()
            with spin as busy, Load(port, CLIENTS) as cl:
                ticks, spun_before = cpu_ticks(), busy and cpu_s(busy.pid)
                starts, snaps, samples, warm = run_phases(up, read, phases)
                stop, ticks_after, spun_after = time.time(), cpu_ticks(), busy and cpu_s(busy.pid)
    spun = None if None in (spun_before, spun_after) else spun_after - spun_before
    start = starts[0]
    got = [r for r in cl.results if start <= r[0] < stop]
    ok = [r[1] for r in got if r[2] == 200]
    caps = [p[1] for p in phases]
    cap_ms = slot_ms(caps, snaps)
    busy_ms = snaps[-1]["busy_slot_ms"] - snaps[0]["busy_slot_ms"]
    floor = NATIVE_MIN if label.startswith("native") else ADAPTIVE_MIN
    limits = [[v for t, v, _, _ in samples if a <= t < b and v is not None]
              for a, b in zip(starts, starts[1:] + [stop])]
    warm_t, warm_snap, warm_phase = warm if warm else (None, None, None)
    warm_ok, warm_cap_ms, warm_busy = [], 0, 0
    if warm_t is not None:
        warm_ok = [r[1] for r in got if r[2] == 200 and r[0] >= warm_t]
        # The busy slot-time from that sample on, over the capacity from
        # then: the rest of its phase, and the later phases.
        warm_cap_ms = slot_ms(caps[warm_phase:], [warm_snap] + snaps[warm_phase + 1:])
        warm_busy = snaps[-1]["busy_slot_ms"] - warm_snap["busy_slot_ms"]
    return {"utilisation_pct": 100 * busy_ms / cap_ms if cap_ms > 0 else None,
            "after_warm_utilisation_pct": 100 * warm_busy / warm_cap_ms if warm_cap_ms > 0 else None,
            "after_warm_p99_ms": pct(warm_ok, 0.99),
            "phase_utilisation_pct": [utilisation(a, b, c) for c, a, b in zip(caps, snaps, snaps[1:])],
            "p50_ms": pct(ok, 0.5), "p99_ms": pct(ok, 0.99),
            "goodput_rps": len(ok) / (stop - start), "refused_rps": (len(got) - len(ok)) / (stop - start),
            "min": floor, "at_min_s": longest_at(samples, floor, stop) if read else None,
            "median_limit_by_phase": [statistics.median(vs) if vs else None for vs in limits],
            "samples": len(samples), "limits_read": sum(1 for s in samples if s[1] is not None),
            "steal_pct": steal_pct(ticks, ticks_after),
            # The busy loop's share of one core while the cell ran.
            "busy_loop_pct": None if spun is None else 100 * spun / (stop - start)}


def median_of(rows, key):
    vs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vs) if vs else None


def verdict(met, margins):
    """"met" if the medians satisfy the goal; else "within noise" if the
    paired margins (positive: the goal holds that round) have mixed signs
    or a mean whose |t| is under the 95% bound; else "not met"."""
    if met:
        return "met"
    if len(margins) < 2:
        return "not met"
    if any(m >= 0 for m in margins) and any(m < 0 for m in margins):
        return "within noise"
    _, se, t, bound = paired_t(margins)
    if se is None:
        return "not met"
    return "within noise" if abs(t) < bound else "not met"


def judge(rounds):
    """Each setup's medians over the rounds (for `at_min_s`, the longest)
    and the three goals' verdicts."""
    nat, our = [r["native"] for r in rounds], [r["sluice"] for r in rounds]
    side = lambda rows: dict({k: median_of(rows, k) for k in  # noqa: E731
                              ("utilisation_pct", "p99_ms", "goodput_rps", "refused_rps",
                               "after_warm_utilisation_pct", "after_warm_p99_ms")},
                             at_min_s=max((r["at_min_s"] for r in rows if r["at_min_s"] is not None), default=None))
    n, o = side(nat), side(our)
    goals = []
    if None not in (n["utilisation_pct"], o["utilisation_pct"]):
        margins = [b["utilisation_pct"] - a["utilisation_pct"] + UTIL_SLACK_PTS for a, b in zip(nat, our)
                   if None not in (a["utilisation_pct"], b["utilisation_pct"])]
        goals.append(("a", f"utilisation >= native's - {UTIL_SLACK_PTS} points",
                      f"{o['utilisation_pct']:.1f} vs {n['utilisation_pct']:.1f}%",
                      verdict(o["utilisation_pct"] >= n["utilisation_pct"] - UTIL_SLACK_PTS, margins)))
    if None not in (n["p99_ms"], o["p99_ms"]):
        margins = [a["p99_ms"] - b["p99_ms"] for a, b in zip(nat, our) if None not in (a["p99_ms"], b["p99_ms"])]
        goals.append(("b", "admitted p99 <= native's", f"{o['p99_ms']:.0f} vs {n['p99_ms']:.0f} ms",
                      verdict(o["p99_ms"] <= n["p99_ms"], margins)))
    if o["at_min_s"] is not None:
        goals.append(("c", f"no stretch of {AT_MIN_MAX_S:.0f} s at min with idle slots",
                      f"longest {o['at_min_s']:.1f} s", "met" if o["at_min_s"] < AT_MIN_MAX_S else "not met"))
    return n, o, [{"id": i, "goal": g, "measured": m, "verdict": v} for i, g, m, v in goals]


def f0(v, unit=""):
    return "-" if v is None else f"{v:.0f}{unit}"


def f1(v, unit=""):
    return "-" if v is None else f"{v:.1f}{unit}"


def run_line(name, label, row):
    return (f"  {name:<34} {label:<28} use {f1(row['utilisation_pct'], '%')} "
            f"(by phase {', '.join(f0(u) for u in row['phase_utilisation_pct'])}), p99 {f0(row['p99_ms'], ' ms')}, "
            f"goodput {f0(row['goodput_rps'], '/s')}, refused {f0(row['refused_rps'], '/s')}, "
            f"median limit by phase {', '.join(f1(v) for v in row['median_limit_by_phase'])}, "
            f"longest at min {row['min']} with idle slots {f1(row['at_min_s'], ' s')} "
            f"({row['limits_read']} of {row['samples']} samples read)"
            + ("" if row["busy_loop_pct"] is None else f", busy loop {row['busy_loop_pct']:.0f}% of a core"))


def cell_line(c):
    n, o = c["native"], c["sluice"]
    return (f"  {c['name']:<34} use {f1(n['utilisation_pct'])} / {f1(o['utilisation_pct'])}%, "
            f"p99 {f0(n['p99_ms'])} / {f0(o['p99_ms'])} ms (after {WARM_S:.0f} s: use "
            f"{f1(n['after_warm_utilisation_pct'])} / {f1(o['after_warm_utilisation_pct'])}%, p99 "
            f"{f0(n['after_warm_p99_ms'])} / {f0(o['after_warm_p99_ms'])} ms), sluice at min {f1(o['at_min_s'], ' s')}: "
            + "; ".join(f"({g['id']}) {g['goal']}: {g['verdict']}" for g in c["goals"]))


def write(out):
    RESULTS.mkdir(exist_ok=True)
    rec = provenance.record(harness.WASM)
    (RESULTS / "adaptive-matrix.json").write_text(json.dumps(dict(out, **rec), indent=1))
    lines = ["# The adaptive limit's scenario matrix", "",
             "Written by `bench/adaptive_matrix.py` (part of `make bench-overload`). Native "
             f"`adaptive_concurrency` vs sluice `{out['sluice_config']}`, 2 Envoy workers, "
             f"{out['clients']} closed-loop clients, phases x {out['phase_scale']} of the script's.", "",
             provenance.markdown(rec), "", "Verdict rule (fixed before the run): " + out["rule"], "",
             f"The last column, apart from the verdict: the same figures from {WARM_S:.0f} s after each run's "
             "start to its end (both setups start from nothing: native first measures its minRTT; sluice's "
             "limit starts at `adaptive.initial`, its queue filling before CoDel's first verdict).", "",
             "| cell | utilisation native / sluice % | admitted p99 native / sluice ms | goodput native / sluice /s "
             "| refused native / sluice /s | longest at min with idle slots: sluice (native at its min) s "
             "| (a) utilisation | (b) p99 | (c) at min | after the first second: utilisation, p99 native / sluice |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in out["cells"]:
        n, o = c["native"], c["sluice"]
        v = {g["id"]: g["verdict"] for g in c["goals"]}
        lines.append(f"| {c['name']} | {f1(n['utilisation_pct'])} / {f1(o['utilisation_pct'])} "
                     f"| {f0(n['p99_ms'])} / {f0(o['p99_ms'])} | {f0(n['goodput_rps'])} / {f0(o['goodput_rps'])} "
                     f"| {f0(n['refused_rps'])} / {f0(o['refused_rps'])} | {f1(o['at_min_s'])} ({f1(n['at_min_s'])}) "
                     f"| {v.get('a', '-')} | {v.get('b', '-')} | {v.get('c', '-')} "
                     f"| {f1(n.get('after_warm_utilisation_pct'))} / {f1(o.get('after_warm_utilisation_pct'))} %, "
                     f"{f0(n.get('after_warm_p99_ms'))} / {f0(o.get('after_warm_p99_ms'))} ms |")
    lines += ["", "## Round by round", "",
              "| round | cell | first | utilisation by phase native / sluice % | p99 native / sluice ms "
              "| median limit by phase native / sluice | at min native / sluice s | steal native / sluice % |",
              "|---|---|---|---|---|---|---|---|"]
    join = lambda vs, f: ", ".join(f(v) for v in vs)  # noqa: E731
    for c in out["cells"]:
        for i, r in enumerate(c["rounds"], 1):
            a, b = r["native"], r["sluice"]
            lines.append(f"| {i} | {c['name']} | {r['first']} "
                         f"| {join(a['phase_utilisation_pct'], f0)} / {join(b['phase_utilisation_pct'], f0)} "
                         f"| {f0(a['p99_ms'])} / {f0(b['p99_ms'])} "
                         f"| {join(a['median_limit_by_phase'], f1)} / {join(b['median_limit_by_phase'], f1)} "
                         f"| {f1(a['at_min_s'])} / {f1(b['at_min_s'])} | {f1(a['steal_pct'])} / {f1(b['steal_pct'])} |")
    (RESULTS / "adaptive-matrix.md").write_text("\n".join(lines) + "\n")
    print("wrote bench/results/adaptive-matrix.md")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--cells", help="names, comma-separated: " + ", ".join(c[0] for c in CELLS))
    ap.add_argument("--phase-scale", type=float, default=1.0, help="multiplies every phase's length")
    args = ap.parse_args()
    chosen = CELLS
    if args.cells:
        wanted = args.cells.split(",")
        unknown = [w for w in wanted if w not in {c[0] for c in CELLS}]
        if unknown:
            ap.error(f"unknown cells: {', '.join(unknown)}")
        chosen = [c for c in CELLS if c[0] in wanted]
    cells = [(key, name, [(round(secs * args.phase_scale, 2), cap, svc) for secs, cap, svc in phases], starved)
             for key, name, phases, starved in chosen]
    rule = RULE.format(rounds=args.rounds)
    expected = args.rounds * sum(len(SETUPS) * (sum(p[0] for p in c[2]) + OVERHEAD_S) for c in cells)
    print(f"Verdict rule: {rule}", flush=True)
    print(f"{len(cells)} cells x {len(SETUPS)} setups x {args.rounds} rounds: about {expected / 60:.1f} min",
          flush=True)
    provenance.start(harness.WASM)
    rounds = {c[0]: [] for c in cells}
    for i in range(args.rounds):
        print(f"Round {i + 1} of {args.rounds}:", flush=True)
        for j, (key, name, phases, starved) in enumerate(cells):
            order = SETUPS if (i + j) % 2 == 0 else SETUPS[::-1]
            rows = {}
            for label, flt in order:
                rows[label] = run_one(label, flt, phases, starved)
                print(run_line(name, label, rows[label]), flush=True)
            rounds[key].append({"first": "native" if order[0] is SETUPS[0] else "sluice",
                                "native": rows[SETUPS[0][0]], "sluice": rows[SETUPS[1][0]]})
    out_cells = []
    print(f"Verdict rule: {rule}", flush=True)
    print("Per cell, native / sluice (medians), and the goals:", flush=True)
    for key, name, phases, starved in cells:
        n, o, goals = judge(rounds[key])
        c = {"cell": key, "name": name, "starved": starved, "phases": phases, "rounds": rounds[key],
             "native": n, "sluice": o, "goals": goals}
        out_cells.append(c)
        print(cell_line(c), flush=True)
    write({"rounds": args.rounds, "phase_scale": args.phase_scale, "clients": CLIENTS, "rule": rule,
           "sluice_config": 'concurrency: {max: "auto", adaptive: {max: 200}}', "adaptive_min": ADAPTIVE_MIN,
           "cells": out_cells})


if __name__ == "__main__":
    main()
