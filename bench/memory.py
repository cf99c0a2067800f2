#!/usr/bin/env python3
"""Memory per sidecar: the front Envoy's resident memory (VmRSS) after it has
answered some requests, side by side for no filter, a minimal Rust
proxy-wasm filter (bench/minimal: adds one response header), and sluice
loaded with `{}` and with the demo rule (envoy/envoy.yaml's), all at the
same --concurrency.

    python bench/memory.py                                  # the built sluice.wasm
    python bench/memory.py a=old.wasm b=new.wasm            # builds side by side
    python bench/memory.py wasm=sluice.wasm native=libsluice_native.so --concurrency 8
    python bench/memory.py --concurrency 4 --rounds 5

A build ending in `.so` is the native build (native/README.md), loaded as
an Envoy dynamic module with the same configuration.

Each round starts a fresh front Envoy per scenario (interleaved), sends
REQUESTS requests over CONNECTIONS keep-alive connections (so every worker
serves some), waits a moment, then reads /proc/<pid>/status (VmRSS, and its
anonymous and file-backed parts) and Envoy's own heap from the admin
`/memory` endpoint; medians over rounds. The minimal filter's .wasm must be
built first (`make bench-memory` does). RSS is far less noisy than time on
a shared machine, but not deterministic: V8 and the allocator grow their
heaps in chunks, so read differences of 1 MB or less as noise. Results go to
bench/results/memory.{json,md}.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (also puts tests/ on the path)
import harness  # noqa: E402
import http1  # noqa: E402
import provenance  # noqa: E402
from harness import Envoy, free_port, front_bootstrap, upstream_bootstrap  # noqa: E402

MINIMAL = bench.ROOT / "bench/minimal/target/wasm32-wasip1/release/minimal.wasm"

# The demo's rule (envoy/envoy.yaml): 10,000 slots of shared data.
DEMO = {
    "rate_limits": [{"name": "per-client", "key": ["client_address"],
                     "bucket": {"rate": 1, "period": "1s", "burst": 10}, "max_keys": 10000}],
    "response": {"retry_after_jitter": "2s", "headers_on_allowed": True},
}


def minimal_filter(wasm=MINIMAL):
    return {
        "name": "minimal",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {"name": "minimal", "root_id": "minimal",
                       "vm_config": {"vm_id": "minimal", "runtime": "envoy.wasm.runtime.v8",
                                     "code": {"local": {"filename": str(wasm)}}}},
        },
    }


def proc_memory(pid):
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def envoy_heap(front):
    """Envoy's own allocator (tcmalloc) figures, in KiB: what Envoy's C++
    objects use, V8's heaps and wasm memories excluded."""
    try:
        m = json.loads(front.admin("/memory"))
        return {"envoy_allocated": int(m.get("allocated", 0)) // 1024,
                "envoy_heap_size": int(m.get("heap_size", 0)) // 1024}
    except (OSError, ValueError):
        return {}


def load(port, requests, connections):
    statuses = []
    lock = threading.Lock()

    def run(n):
        c = http1.Conn(port, timeout=10)
        try:
            got = [c.request(headers=dict([bench.TENANT_HEADER])).status for _ in range(n)]
        finally:
            c.close()
        with lock:
            statuses.extend(got)

    per = [requests // connections + (i < requests % connections) for i in range(connections)]
    threads = [threading.Thread(target=run, args=(n,)) for n in per]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return statuses


def one(filters, upstream_port, args):
    port = free_port()
    with Envoy(front_bootstrap(port, free_port(), upstream_port, filters), concurrency=args.concurrency) as front:
        statuses = load(port, args.requests, args.connections)
        if len(statuses) != args.requests or not all(s in (200, 429) for s in statuses):
            raise RuntimeError(f"{len(statuses)} answers, statuses {sorted(set(statuses))}")
        time.sleep(args.settle)
        return proc_memory(front.proc.pid) | envoy_heap(front)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", metavar="NAME=FILE",
                    help="sluice builds to compare, .wasm or the native .so (default: the built sluice.wasm)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between the last answer and the reading")
    ap.add_argument("--out", default="memory", help="results name under bench/results")
    args = ap.parse_args()
    if not MINIMAL.exists():
        sys.exit(f"{MINIMAL} not found: make bench-memory builds it")
    variants = bench.parse_variants(args.variants or [f"sluice={harness.WASM}"])
    provenance.start(*(path for _, path in variants))
    scenarios = [("none", "no filter", None, []),
                 ("minimal", f"minimal proxy-wasm filter ({MINIMAL.stat().st_size:,} bytes)", None, [minimal_filter()])]
    for vname, wasm in variants:
        size = Path(wasm).stat().st_size
        tag = f"{vname}, {size:,} bytes"
        scenarios.append((f"empty-{vname}", f"sluice, config {{}} ({tag})", vname, [bench.sluice_filter({}, wasm)]))
        scenarios.append((f"demo-{vname}", f"sluice, the demo rule ({tag})", vname, [bench.sluice_filter(DEMO, wasm)]))
    started = time.time()
    results = {sid: [] for sid, *_ in scenarios}
    with tempfile.TemporaryDirectory(prefix="sluice-mem-"):
        up = free_port()
        with Envoy(upstream_bootstrap(up, free_port()), concurrency=1):
            for rnd in range(args.rounds):
                for sid, label, _, filters in scenarios:
                    m = one(filters, up, args)
                    results[sid].append(m)
                    print(f"  round {rnd + 1} {sid:<16} RSS {m['VmRSS'] / 1024:6.1f} MB "
                          f"(anon {m['RssAnon'] / 1024:.1f}, file {m['RssFile'] / 1024:.1f}; "
                          f"Envoy heap {m.get('envoy_allocated', 0) / 1024:.1f} MB)", flush=True)
    rows = []
    for sid, label, vname, _ in scenarios:
        med = {k: statistics.median(r[k] for r in results[sid]) for k in results[sid][0]}
        rows.append({"scenario": sid, "label": label, "variant": vname, "median_kib": med,
                     "rss_mb_rounds": [round(r["VmRSS"] / 1024, 1) for r in results[sid]]})
    base = {r["scenario"]: r["median_kib"]["VmRSS"] for r in rows}
    lines = ["| front Envoy | RSS MB (median) | over no filter | over the minimal filter | anonymous MB | "
             "file-backed MB | Envoy's own heap MB | RSS of each round |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median_kib"]
        r["over_none_mb"] = (m["VmRSS"] - base["none"]) / 1024
        r["over_minimal_mb"] = (m["VmRSS"] - base["minimal"]) / 1024
        lines.append(f"| {r['label']} | {m['VmRSS'] / 1024:.1f} | {r['over_none_mb']:+.1f} | "
                     f"{r['over_minimal_mb']:+.1f} | {m['RssAnon'] / 1024:.1f} | {m['RssFile'] / 1024:.1f} | "
                     + (f"{m['envoy_allocated'] / 1024:.1f}" if "envoy_allocated" in m else "") + " | "
                     + ", ".join(f"{x:.1f}" for x in r["rss_mb_rounds"]) + " |")
    rec = provenance.record(variants=variants)
    md = [f"# sluice: memory per sidecar ({time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())})", "",
          f"- front Envoy `--concurrency {args.concurrency}`, VmRSS after {args.requests} requests over "
          f"{args.connections} keep-alive connections (`direct_response` upstream), {args.rounds} interleaved "
          "rounds, a fresh Envoy each; medians",
          "- Envoy's own heap: `allocated` of the admin `/memory` endpoint (V8's heaps and wasm memories "
          "are outside it)",
          "- Differences of 1 MB or less are noise (V8 and the allocator grow in chunks)",
          provenance.markdown(rec),
          f"- Whole run: {time.time() - started:.0f} s", "", "\n".join(lines), ""]
    bench.RESULTS.mkdir(parents=True, exist_ok=True)
    (bench.RESULTS / f"{args.out}.md").write_text("\n".join(md))
    out = {"rows": rows, "args": vars(args), "variants": variants, **rec}
    (bench.RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n" + "\n".join(lines))
    print(f"wrote bench/results/{args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
