#!/usr/bin/env python3
"""Retry storm: goodput with and without sluice's retry budget, side by side
in one run (about 45 s).

The upstream (tests/slow_upstream.py, `blind`) serves CAPACITY requests at a
time, DELAY_MS each, and does every request it accepted even after its
caller is gone, as a service that does not notice cancellations: work queued
behind a backlog is done for nobody. The front Envoy (--concurrency 2) gives
each attempt ATTEMPT_TIMEOUT_S (its route timeout, then 504). A scripted
client opens jobs at a fixed rate: a spike at SPIKE_X times the upstream's
capacity for SPIKE_S seconds, then NORMAL_X times for NORMAL_S seconds. A
job makes up to 3 attempts, sending `x-envoy-attempt-count`, and retries at
once whatever the failure (a 5xx, the 504 of the timeout, sluice's 429).

Twice, the same load: sluice with an empty configuration (no budget), and
with a retry budget (10% of first tries, 2 retries per second, 10 s window).
Goodput: jobs (each started by a first attempt) that got a 200 on some
attempt, per second of the phase they started in. Upstream load: requests
the upstream received per second, and its backlog (received, not yet served)
at the end.

    python bench/retry_storm.py     # writes bench/results/retry-storm.{json,md}

`make bench` runs it too, at the end of its default run, and writes the same
files.
"""

import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench/results"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import harness  # noqa: E402
import http1  # noqa: E402
import provenance  # noqa: E402
from harness import Envoy, SlowUpstream, free_port, front_bootstrap, wasm_filter  # noqa: E402

CAPACITY, DELAY_MS = 2, 25  # about 80 requests per second
ATTEMPT_TIMEOUT_S = 0.3
SPIKE_X, SPIKE_S = 1.5, 3
NORMAL_X, NORMAL_S = 0.5, 15
ATTEMPTS = 3
BUDGET = {"retry_budgets": [{"name": "api", "ratio": 0.1, "min_per_second": 2, "window": "10s"}]}
SETUPS = [("no retry budget", {}), ("sluice retry budget", BUDGET)]


def capacity_rps():
    return CAPACITY * 1000 / DELAY_MS


def job(port, started, out, lock):
    """One job: up to ATTEMPTS attempts; records (start, [(status, at)])."""
    tries = []
    for n in range(1, ATTEMPTS + 1):
        try:
            r = http1.get(port, "/", {"x-envoy-attempt-count": str(n)})
            status = r.status
            refused = r.header("x-sluice-retry-budget") is not None
        except OSError:
            status, refused = None, False
        tries.append((status, refused, time.time() - started))
        if status == 200:
            break
    with lock:
        out.append((started, tries))


def sample(up, t0, stop, samples):
    """The upstream's counts every 0.5 s, until `stop` is set."""
    while not stop.wait(0.5):
        s = up.stats()
        samples.append((time.time() - t0, s["received"], s["served"]))


def drive(port, up):
    """The spike then the normal load; returns the jobs and the samples."""
    jobs, lock, threads = [], threading.Lock(), []
    samples, stop = [], threading.Event()
    t0 = time.time()
    sampler = threading.Thread(target=sample, args=(up, t0, stop, samples))
    sampler.start()
    at = 0.0
    for rate, seconds in ((SPIKE_X * capacity_rps(), SPIKE_S), (NORMAL_X * capacity_rps(), NORMAL_S)):
        end = at + seconds
        while at < end:
            time.sleep(max(0.0, t0 + at - time.time()))
            t = threading.Thread(target=job, args=(port, at, jobs, lock), daemon=True)
            t.start()
            threads.append(t)
            at += 1 / rate
    for t in threads:
        t.join(timeout=ATTEMPTS * ATTEMPT_TIMEOUT_S + 5)
    stop.set()
    sampler.join()
    return jobs, samples


def phase(jobs, samples, start, end):
    """Goodput, attempts and upstream load of the jobs started in [start, end)."""
    mine = [tries for s, tries in jobs if start <= s < end]
    secs = end - start
    ok = [tries for tries in mine if tries and tries[-1][0] == 200]
    sent = sum(len(t) for t in mine)
    refused = sum(1 for t in mine for x in t if x[1])
    within = [(t, rec) for t, rec, _ in samples if start <= t <= end + 0.5]
    received = (within[-1][1] - within[0][1]) / (within[-1][0] - within[0][0]) if len(within) > 1 else None
    return {"jobs_per_s": len(mine) / secs, "goodput_per_s": len(ok) / secs,
            "first_try_ok_per_s": sum(1 for t in mine if t[0][0] == 200) / secs,
            "attempts_per_job": sent / len(mine) if mine else 0,
            "refused_by_budget_per_s": refused / secs, "upstream_received_per_s": received}


def one(label, cfg):
    with SlowUpstream(CAPACITY, DELAY_MS, blind=True) as up:
        port = free_port()
        routes = [{"name": "api", "match": {"prefix": "/"},
                   "route": {"cluster": "upstream", "timeout": f"{ATTEMPT_TIMEOUT_S}s"}}]
        boot = front_bootstrap(port, free_port(), up.port, [wasm_filter(cfg)], routes)
        with Envoy(boot, concurrency=2):
            jobs, samples = drive(port, up)
        end = up.stats()
    total = SPIKE_S + NORMAL_S
    row = {"setup": label, "config": cfg,
           "spike": phase(jobs, samples, 0, SPIKE_S),
           "after": phase(jobs, samples, SPIKE_S, total),
           "last_5s": phase(jobs, samples, total - 5, total),
           "upstream_backlog_at_end": end["received"] - end["served"],
           "upstream_received": end["received"], "upstream_served": end["served"]}
    print(f"  {label:<20} goodput spike {row['spike']['goodput_per_s']:.0f}/s, after "
          f"{row['after']['goodput_per_s']:.0f}/s, last 5 s {row['last_5s']['goodput_per_s']:.0f}/s; upstream "
          f"received {row['after']['upstream_received_per_s'] or 0:.0f}/s after the spike, backlog at end "
          f"{row['upstream_backlog_at_end']}", flush=True)
    return row


def run():
    """Both setups, one after the other; the rows."""
    print(f"Retry storm: upstream {CAPACITY} at a time x {DELAY_MS} ms (~{capacity_rps():.0f}/s, blind), "
          f"jobs at {SPIKE_X}x for {SPIKE_S} s then {NORMAL_X}x for {NORMAL_S} s, up to {ATTEMPTS} attempts "
          f"of {ATTEMPT_TIMEOUT_S} s, --concurrency 2")
    return [one(label, cfg) for label, cfg in SETUPS]


def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


def markdown(rows):
    base, budget = rows
    lines = ["| setup | phase | jobs /s | goodput /s | first tries ok /s | attempts per job | "
             "retries refused by the budget /s | upstream received /s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for ph, name in (("spike", f"spike ({SPIKE_S} s)"), ("after", f"after ({NORMAL_S} s)"),
                         ("last_5s", "last 5 s")):
            p = r[ph]
            lines.append(f"| {r['setup']} | {name} | {p['jobs_per_s']:.0f} | {p['goodput_per_s']:.1f} | "
                         f"{p['first_try_ok_per_s']:.1f} | {p['attempts_per_job']:.2f} | "
                         f"{p['refused_by_budget_per_s']:.1f} | {p['upstream_received_per_s'] or 0:.0f} |")
    lines += ["", "| ratio, budget / no budget | goodput after the spike | goodput, last 5 s | "
              "upstream received after the spike | upstream backlog at end |", "|---|---|---|---|---|",
              f"| | {ratio(budget['after']['goodput_per_s'], base['after']['goodput_per_s'])} | "
              f"{ratio(budget['last_5s']['goodput_per_s'], base['last_5s']['goodput_per_s'])} | "
              f"{ratio(budget['after']['upstream_received_per_s'] or 0, base['after']['upstream_received_per_s'] or 0)} | "
              f"{budget['upstream_backlog_at_end']} vs {base['upstream_backlog_at_end']} |"]
    return "\n".join(lines)


def describe():
    return (f"An upstream serving {CAPACITY} requests at a time, {DELAY_MS} ms each (about "
            f"{capacity_rps():.0f}/s), that finishes every request it accepted even when its caller has gone "
            f"(as a service that does not notice cancellations). Front Envoy `--concurrency 2`, route timeout "
            f"{ATTEMPT_TIMEOUT_S} s. Jobs arrive at {SPIKE_X}x capacity for {SPIKE_S} s, then {NORMAL_X}x for "
            f"{NORMAL_S} s; each makes up to {ATTEMPTS} attempts (`x-envoy-attempt-count` 1 to {ATTEMPTS}), "
            "retrying at once on any failure. Without a budget: sluice with `{}`. With: "
            f"`{json.dumps(BUDGET)}`. Goodput: jobs that got a 200 on some attempt, per second of the phase "
            "they started in.")


def write(rows):
    """bench/results/retry-storm.{json,md}, with the build and machine measured."""
    rec = provenance.record(harness.WASM)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "retry-storm.json").write_text(
        json.dumps({"rows": rows, "setup": describe(), **rec}, indent=1) + "\n")
    (RESULTS / "retry-storm.md").write_text(
        f"# Retry storm: goodput with and without a retry budget ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
        f"\n\n{provenance.markdown(rec)}\n\n{describe()}\n\n{markdown(rows)}\n")
    print("wrote bench/results/retry-storm.json and retry-storm.md")


def main():
    provenance.start(harness.WASM)
    rows = run()
    print("\n" + markdown(rows))
    write(rows)


if __name__ == "__main__":
    main()
