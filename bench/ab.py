#!/usr/bin/env python3
"""A/B of sluice builds: the same configuration loaded from two or more
.wasm files, measured side by side in interleaved rounds (with no filter and
the native filter as references), so that a change's cost or saving is read
as a paired difference of front-Envoy CPU per request within one run.

    python bench/ab.py before=/tmp/old.wasm after=target/wasm32-wasip1/release/sluice.wasm
    python bench/ab.py --config all --rounds 8 a=x.wasm b=y.wasm

Configurations: `rl` (the benchmark's global rule with three headers on
admitted responses), `all` (rate limit, breaker and shedder), `const` (one
global rule, no headers). Each round starts a fresh front Envoy per
variant; the first variant is the baseline of the paired differences.
Bounded: rounds x variants x (duration + warm-up + start-up) seconds.
"""

import argparse
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from harness import Envoy, free_port, upstream_bootstrap, wasm_filter  # noqa: E402

RL = {"rate_limits": [bench.huge_rule("global")], "response": bench.SAME_HEADERS}
CONFIGS = {
    "rl": RL,
    "all": dict(RL, circuit_breakers=[{"name": "upstream"}],
                shedders=[{"name": "route", "concurrency": {"max": 100000}}]),
    "const": {"rate_limits": [bench.huge_rule("const")]},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", metavar="NAME=FILE.wasm")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="rl")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=int, default=3, help="seconds per measured round")
    ap.add_argument("--concurrency", type=int, default=1, help="front Envoy workers")
    args = ap.parse_args()
    variants = bench.parse_variants(args.variants)
    cfg = CONFIGS[args.config]
    scenarios = [{"id": "none", "label": "no filter", "kind": "none", "filters": []},
                 {"id": "native", "label": "native", "kind": "native",
                  "filters": bench.native(bench.HUGE, bench.HUGE, "1s")}]
    scenarios += [{"id": name, "label": name, "kind": "sluice", "filters": [wasm_filter(cfg, wasm=path)]}
                  for name, path in variants]
    run = types.SimpleNamespace(warmup=1, duration=args.duration, connections=16)
    with tempfile.TemporaryDirectory() as tmp:
        up = free_port()
        with Envoy(upstream_bootstrap(up, free_port()), concurrency=1):
            rows = bench.interleaved(scenarios, [args.concurrency], args.rounds, up, run, tmp)
    cpu = {sc["id"]: [r["cpu_us_per_request"] for r in rows if r["scenario"] == sc["id"]] for sc in scenarios}
    rps = {sc["id"]: [r["rps"] for r in rows if r["scenario"] == sc["id"]] for sc in scenarios}
    base = variants[0][0]
    print(f"\nconfig {args.config}, --concurrency {args.concurrency}, {args.rounds} rounds; "
          f"paired differences against `{base}`")
    print(f"{'variant':<12} {'req/s':>8} {'vs native':>9} {'CPU us/req':>10} {'paired CPU diff':>16}")
    for sc in scenarios:
        sid = sc["id"]
        diff = statistics.median(x - y for x, y in zip(cpu[sid], cpu[base]))
        print(f"{sid:<12} {statistics.median(rps[sid]):>8.0f} "
              f"{statistics.median(rps[sid]) / statistics.median(rps['native']):>9.2f} "
              f"{statistics.median(cpu[sid]):>10.1f} {diff:>+16.1f}")


if __name__ == "__main__":
    main()
