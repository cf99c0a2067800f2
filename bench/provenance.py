"""What a benchmark result measured, recorded in every result JSON the
bench scripts write (standard library only, so bench/report.py can use the
same wording):

- `build`: the first 12 hex digits of the sha256 of the sluice.wasm
  measured, its size, and the crate version from Cargo.toml (only when the
  module is the project's own build, target/wasm32-wasip1/release: a
  module given by path may come from other sources);
- `machine`: the CPUs this process may run on (as `nproc` counts them),
  the CPU model from /proc/cpuinfo, and the kernel release.

Figures from different builds or machines do not compare: bench/report.py
prints both next to every result.
"""

import hashlib
import os
import platform
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT_WASM = ROOT / "target/wasm32-wasip1/release/sluice.wasm"


def crate_version():
    """The `version` of Cargo.toml's [package] table, or None."""
    try:
        text = (ROOT / "Cargo.toml").read_text()
    except OSError:
        return None
    m = re.search(r"^\[package\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    v = m and re.search(r'^version\s*=\s*"([^"]+)"', m.group(1), re.M)
    return v.group(1) if v else None


def is_native_build(path):
    """Whether a build measured is the native one (native/README.md: a
    dynamic module, `.so`) rather than a `.wasm`."""
    return str(path).endswith(".so")


_BUILDS = {}


def build(wasm=PROJECT_WASM):
    """The module's identity, read once per path and process: a script calls
    this before its run (see `start`), so that a rebuild during a long run
    does not change what its result says it measured. None if unreadable."""
    key = str(Path(wasm).resolve())
    if key not in _BUILDS:
        try:
            data = Path(wasm).read_bytes()
        except OSError:
            return None
        own = key == str(PROJECT_WASM.resolve())
        _BUILDS[key] = {"sha256": hashlib.sha256(data).hexdigest()[:12], "bytes": len(data),
                        "version": crate_version() if own else None}
    return _BUILDS[key]


def start(*wasms):
    """Reads the modules a run is about to measure (the project's build by
    default), before it starts."""
    for w in wasms or (PROJECT_WASM,):
        build(w)


def machine():
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count()
    return {"nproc": nproc, "cpu": cpu, "kernel": platform.release()}


def record(wasm=PROJECT_WASM, variants=None):
    """The fields to add to a result JSON. `variants`: (name, path) pairs of
    the builds a script compared; each gets its own entry under `builds`,
    and `build` is the first's."""
    out = {"machine": machine()}
    if variants:
        out["builds"] = {name: build(path) for name, path in variants}
        out["build"] = out["builds"][variants[0][0]]
    elif wasm is not None:
        out["build"] = build(wasm)
    return out


def build_text(b):
    if not b:
        return "not recorded"
    return (f"{b['version']}, " if b.get("version") else "") + f"sha256 {b['sha256']}"


def machine_text(m):
    if not m:
        return "not recorded"
    cpu = m.get("cpu")
    if cpu:
        cpu = re.sub(r"\((?:R|TM)\)|\bCPU\b|\bProcessor\b|\b\d+-Core\b|@.*$", "", cpu)
        cpu = " ".join(cpu.split())
    # The kernel's version without its build suffix (the JSON keeps it all).
    kernel = (m.get("kernel") or "").split("-")[0]
    return ", ".join(x for x in (f"{m.get('nproc')} CPUs", cpu or "CPU model not recorded",
                                 kernel and f"Linux {kernel}") if x)


def markdown(rec):
    """One line for a result's .md: the build(s) and the machine."""
    builds = rec.get("builds")
    b = ("; ".join(f"`{n}` {build_text(x)}" for n, x in builds.items()) if builds
         else build_text(rec.get("build")) if "build" in rec else None)
    return (f"- Build: {b}; machine: " if b else "- Machine: ") + machine_text(rec.get("machine"))
