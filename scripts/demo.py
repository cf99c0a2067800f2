#!/usr/bin/env python3
"""The demo's two Envoy configurations (envoy/envoy.yaml in front,
envoy/upstream.yaml as the upstream) on ports of your choice, for
`make run` (scripts/run.sh) and `make run-container` (scripts/container.py).

The checked-in files keep their fixed ports (examples and tests use them as
they are); this renders copies in which each `port_value:` is replaced by
the chosen port, and refuses a file whose ports it does not know, so the
two cannot drift apart silently.

    scripts/demo.py render --out DIR [--port 10000] [--admin-port 9901]
                           [--upstream-port 10001] [--upstream-admin-port 9902]
                           [--host wasm|native] [--native FILE]
        checks that the four ports are free on 127.0.0.1 (exit 2 naming the
        port and its make variable if not), then writes DIR/envoy.yaml and
        DIR/upstream.yaml; with --host native the front Envoy loads the
        native build (FILE, default native/target/release/) instead of the
        wasm one, with the same plugin configuration.
    scripts/demo.py probe --port 10000
        exit 0 if Envoy answers GET / on 127.0.0.1:PORT with the upstream's
        200 (through sluice), 1 otherwise.

Standard library only.
"""

import argparse
import errno
import http.client
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"

# (make variable, default, what it is). The defaults are the ports written
# in envoy/*.yaml.
PORTS = [
    ("PORT", 10000, "the front Envoy's listener, where sluice runs"),
    ("ADMIN_PORT", 9901, "the front Envoy's admin interface"),
    ("UPSTREAM_PORT", 10001, "the demo upstream's listener"),
    ("UPSTREAM_ADMIN_PORT", 9902, "the demo upstream's admin interface"),
]
DEFAULTS = {name: port for name, port, _ in PORTS}
# Which port in which file is which.
FILES = {
    "envoy.yaml": ["PORT", "ADMIN_PORT", "UPSTREAM_PORT"],
    "upstream.yaml": ["UPSTREAM_PORT", "UPSTREAM_ADMIN_PORT"],
}
PORT_VALUE = re.compile(r"(port_value:\s*)(\d+)")
# The native build (native/, `make build-native`), for `--host native`.
NATIVE = ROOT / "native/target/release/libsluice_native.so"
# envoy.yaml's wasm filter up to its plugin configuration's text.
WASM_FILTER = re.compile(
    r'^(?P<i> +)"@type": type\.googleapis\.com/envoy\.extensions\.filters\.http\.wasm\.v3\.Wasm\n'
    r'.*?^(?P=i)  configuration:\n'
    r'(?P=i)    "@type": type\.googleapis\.com/google\.protobuf\.StringValue\n'
    r'(?P=i)    value: \|\n', re.M | re.S)


class PortInUse(Exception):
    pass


def render_text(name, text, ports):
    """`text` of envoy/`name` with its ports replaced by `ports` ({var: port})."""
    by_default = {DEFAULTS[var]: ports[var] for var in FILES[name]}
    seen = set()

    def sub(m):
        default = int(m.group(2))
        if default not in by_default:
            raise SystemExit(f"envoy/{name}: port_value {default} is not one of "
                             f"{sorted(by_default)}: update scripts/demo.py")
        seen.add(default)
        return m.group(1) + str(by_default[default])

    out = PORT_VALUE.sub(sub, text)
    missing = set(by_default) - seen
    if missing:
        raise SystemExit(f"envoy/{name}: no port_value {sorted(missing)}: update scripts/demo.py")
    return out


def native_text(text, lib):
    """envoy.yaml's text with the same plugin configuration in the native
    build (native/README.md) instead of the wasm one, and the runtime flag
    that gives its metrics the wasm build's names."""
    def sub(m):
        i = m.group("i")
        return "".join(f"{i}{line}\n" for line in [
            '"@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter',
            "dynamic_module_config:",
            f"  module: {{local: {{filename: {lib}}}}}",
            "  do_not_close: true",
            "filter_name: sluice",
            "filter_config:",
            '  "@type": type.googleapis.com/google.protobuf.StringValue',
            "  value: |"])

    out, n = WASM_FILTER.subn(sub, text)
    if n != 1 or "\nstatic_resources:\n" not in out:
        raise SystemExit("envoy/envoy.yaml: no wasm filter or static_resources where expected: update scripts/demo.py")
    runtime = ("layered_runtime:\n  layers:\n  - name: static\n    static_layer:\n"
               "      envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix: true\n")
    return out.replace("\nstatic_resources:\n", "\n" + runtime + "static_resources:\n", 1)


def render(out, ports, host="wasm", lib=NATIVE):
    """Writes out/envoy.yaml and out/upstream.yaml with `ports`; with host
    "native", the front Envoy loads the native build `lib`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        text = render_text(name, (ENVOY_DIR / name).read_text(), ports)
        if name == "envoy.yaml" and host == "native":
            text = native_text(text, Path(lib).resolve())
        (out / name).write_text(text)
    return out


def holder(port):
    """Who listens on the port, if `ss` can tell (best effort)."""
    if not shutil.which("ss"):
        return ""
    try:
        p = subprocess.run(["ss", "-Htlnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    users = sorted(set(re.findall(r'\(\("([^"]+)",pid=(\d+)', p.stdout)))
    return ", ".join(f"{cmd} (pid {pid})" for cmd, pid in users)


def check_free(ports, command="make run"):
    """Raises PortInUse naming the first port that cannot be bound on
    127.0.0.1 as Envoy binds it (SO_REUSEADDR, so a port in TIME_WAIT counts
    as free; a port another process listens on, even with SO_REUSEPORT, does
    not)."""
    values = [ports[var] for var, _, _ in PORTS]
    for var, _, what in PORTS:
        port = ports[var]
        if values.count(port) > 1:
            others = [v for v, _, _ in PORTS if ports[v] == port and v != var]
            raise PortInUse(f"port {port} is chosen twice ({var} and {', '.join(others)}): "
                            f"give each its own, e.g. {command} {var}={free_suggestion(ports)}")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen(1)
            except OSError as e:
                who = holder(port)
                raise PortInUse(
                    f"port {port} ({var}: {what}) is already in use on 127.0.0.1"
                    + (f" by {who}" if who else "") + f" ({e.strerror}).\n"
                    f"Stop what uses it, or choose another port: {command} {var}={free_suggestion(ports)}"
                ) from None


def free_suggestion(ports):
    """A port that is free now and not among `ports`."""
    taken = set(ports.values())
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
    return "<another port>"


def probe(port, timeout=1.0):
    """(ok, what was seen): GET / through the front Envoy on 127.0.0.1:port
    answered 200 by Envoy (`server: envoy`). The request comes from
    127.0.0.2 where the system allows it, so the probe does not spend the
    demo's per-client-address tokens of 127.0.0.1."""
    try:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=("127.0.0.2", 0))
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.sock = sock
        conn.request("GET", "/", headers={"user-agent": "sluice-demo-probe"})
        r = conn.getresponse()
        r.read()
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return False, f"{type(e).__name__}: {e}"
    server = r.getheader("server", "")
    return r.status == 200 and server == "envoy", f"HTTP {r.status}, server: {server!r}"


def port_args(ap):
    for var, default, what in PORTS:
        ap.add_argument("--" + var.lower().replace("_", "-"), dest=var, type=int, default=default, help=what)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--command", default="make run", help="the command to suggest in messages")
    r.add_argument("--host", choices=["wasm", "native"], default="wasm",
                   help="the build of sluice the front Envoy loads")
    r.add_argument("--native", type=Path, default=NATIVE, help="the native build's file, for --host native")
    port_args(r)
    p = sub.add_parser("probe")
    p.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "probe":
        ok, seen = probe(a.port)
        if not ok:
            print(seen, file=sys.stderr)
        return 0 if ok else 1
    ports = {var: getattr(a, var) for var, _, _ in PORTS}
    try:
        check_free(ports, a.command)
    except PortInUse as e:
        print(f"{a.command}: {e}", file=sys.stderr)
        return 2
    if a.host == "native" and not a.native.exists():
        print(f"{a.command}: {a.native} is missing: make build-native", file=sys.stderr)
        return 1
    render(a.out, ports, a.host, a.native)
    return 0


if __name__ == "__main__":
    sys.exit(main())
