#!/usr/bin/env python3
"""A fleet of two sluice Envoys sharing one global rate limit, for
`make run-fleet`: Debian's redis-server, the reference rate-limit service
(rls/, `--store redis`) counting in it, a demo upstream, and two front
Envoys (`--concurrency 2` each) running the built sluice.wasm with a global
rule, 20 requests per minute per client address across the fleet. Each
Envoy's leader fetches tokens from the service ahead of need, so requests
never wait on it; with the service down, each Envoy falls back to its
backstop, 20 / 2 instances.

    scripts/run_fleet.py [--port 10000] [--port2 10002] [--admin-port 9901]
                         [--admin-port2 9903] [--upstream-port 10001]
                         [--upstream-admin-port 9902] [--config FILE]

The rate-limit service and Redis take free ports (printed). `--config`: a
plugin configuration (JSON) to run instead of the fleet's rule; the limits
of the service stay the same. Prints what to try once both front Envoys
answer through their listeners, and stops everything on Ctrl-C or SIGTERM
(exit 0). Fails at once, naming the port and its make variable, if a port
is taken; if a process exits, prints its last log lines and exits 1.

Standard library only; the processes are started by tests/harness.py and
tests/rls.py, as in the tests.
"""

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import demo  # noqa: E402
import harness  # noqa: E402
from harness import Envoy, front_bootstrap, upstream_bootstrap, wasm_filter  # noqa: E402
from rls import REDIS_BIN, RLS_BIN, Redis, RlsServer, rls_cluster  # noqa: E402

COMMAND = "make run-fleet"
DOMAIN = "sluice-fleet"
LIMIT_PER_MINUTE = 20
INSTANCES = 2
# The plugin configuration of both front Envoys: one global rule.
PLUGIN = {
    "domain": "fleet-demo",
    "rate_limits": [{
        "name": "per-client",
        "key": ["client_address"],
        "algorithm": "sliding_window",
        "window": {"limit": LIMIT_PER_MINUTE, "period": "1m"},
        "global": {"cluster": "rls", "domain": DOMAIN, "instances": INSTANCES,
                   "descriptor_keys": ["remote_address"], "timeout": "200ms"},
    }],
}
# The same limit in the rate-limit service's limits file.
LIMITS = [{"domain": DOMAIN, "descriptors": [
    {"key": "remote_address", "rate_limit": {"unit": "minute", "requests_per_unit": LIMIT_PER_MINUTE}}]}]

# (make variable, option, default, what it is)
PORTS = [
    ("PORT", "--port", 10000, "the first front Envoy's listener"),
    ("PORT2", "--port2", 10002, "the second front Envoy's listener"),
    ("ADMIN_PORT", "--admin-port", 9901, "the first front Envoy's admin interface"),
    ("ADMIN_PORT2", "--admin-port2", 9903, "the second front Envoy's admin interface"),
    ("UPSTREAM_PORT", "--upstream-port", 10001, "the demo upstream's listener"),
    ("UPSTREAM_ADMIN_PORT", "--upstream-admin-port", 9902, "the demo upstream's admin interface"),
]
READY_S = 30  # the most to wait for a front Envoy to answer through its listener


class Failed(Exception):
    pass


class Stop(BaseException):
    """Ctrl-C or SIGTERM."""


def on_signal(signum, frame):
    raise Stop()


def check_ports(ports):
    """Fails (naming the port and its make variable) if a port is chosen
    twice or cannot be bound on 127.0.0.1 as Envoy binds it."""
    for var, _, _, what in PORTS:
        port = ports[var]
        twice = [v for v, _, _, _ in PORTS if v != var and ports[v] == port]
        if twice:
            raise Failed(f"port {port} is chosen twice ({var} and {', '.join(twice)}): give each its own, "
                         f"e.g. {COMMAND} {var}={demo.free_suggestion(ports)}")
        if not harness.port_free(port):
            who = demo.holder(port)
            raise Failed(f"port {port} ({var}: {what}) is already in use on 127.0.0.1"
                         + (f" by {who}" if who else "") + ".\n"
                         f"Stop what uses it, or choose another port: {COMMAND} {var}={demo.free_suggestion(ports)}")


def front(port, admin_port, upstream_port, rls_port, plugin_config, log_level):
    """A front Envoy with sluice before the router and the service's
    cluster (HTTP/2) named `rls`."""
    boot = front_bootstrap(port, admin_port, upstream_port, [wasm_filter(plugin_config)])
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    e = Envoy(boot, concurrency=2, log_level=log_level)
    e.port = port
    return e


def wait_answers(port, children):
    """Until the front Envoy on `port` answers GET / with the upstream's 200
    through sluice (from 127.0.0.2 where the system allows it, which spends
    none of 127.0.0.1's requests)."""
    deadline = time.time() + READY_S
    while True:
        dead(children)
        ok, seen = demo.probe(port)
        if ok:
            return
        if time.time() > deadline:
            raise Failed(f"the front Envoy did not answer on http://127.0.0.1:{port}/ within {READY_S}s "
                         f"(last try: {seen})")
        time.sleep(0.2)


def tail(text, n=25):
    return "\n".join(text.splitlines()[-n:])


def dead(children):
    """Fails, with its last log lines, if a child has exited."""
    for name, proc, logs in children:
        if proc.poll() is not None:
            rc = proc.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited (status {rc})"
            raise Failed(f"the {name} {how}\n--- last lines of its log:\n{tail(logs())}")


def banner(ports, rls, redis, fronts, rule, rule_is_fleet=True):
    """What runs where, and what to try."""
    p1, p2, admin = ports["PORT"], ports["PORT2"], ports["ADMIN_PORT"]
    tries = [
        (f"curl -si http://127.0.0.1:{p2}/", "a 429 with Retry-After and RateLimit headers"),
        (f"curl -s http://127.0.0.1:{rls.stats_port}/stats", "the service's calls: a few batches, not one per request"),
        (f"redis-cli -p {redis.port} --scan", "the fleet's counters in Redis"),
        (f"curl -s http://127.0.0.1:{admin}/stats/prometheus | grep sluice_", "the first Envoy's sluice metrics"),
        (f"kill -STOP {rls.proc.pid}", "the service stalls: after 3 failed calls each Envoy is on its backstop"),
        (f"kill -CONT {rls.proc.pid}", "the service resumes"),
    ]
    width = max(len(cmd) for cmd, _ in tries)
    return "\n".join([
        "",
        "sluice fleet is running: two Envoys sharing one limit through a rate-limit service",
        f"  front Envoys:        http://127.0.0.1:{p1} (admin: http://127.0.0.1:{admin}), "
        f"http://127.0.0.1:{p2} (admin: http://127.0.0.1:{ports['ADMIN_PORT2']})",
        f"  upstream:            http://127.0.0.1:{ports['UPSTREAM_PORT']}",
        f"  rate-limit service:  127.0.0.1:{rls.port} (gRPC, pid {rls.proc.pid}), "
        f"stats http://127.0.0.1:{rls.stats_port}/stats",
        f"  redis-server:        127.0.0.1:{redis.port}",
        rule,
        "",
    ] + ([
        "Try (30 requests from 127.0.0.1, alternating between the two Envoys; in one minute's window at most",
        f"{LIMIT_PER_MINUTE} of them are answered 200, across both):",
    ] if rule_is_fleet else ["Try (30 requests from 127.0.0.1, alternating between the two Envoys):"]) + [
        f"  for i in $(seq 30); do p=$((i % 2 ? {p1} : {p2})); printf '%s:%s ' $p "
        "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$p/); done; echo",
    ] + [f"  {cmd:<{width}}  # {what}" for cmd, what in tries] + [
        "",
        f"Logs: {fronts[0].log_path}, {fronts[1].log_path}, {rls.log_path}",
        "",
        "Press Ctrl-C to stop.",
    ])


def enter(stack, cm):
    """`stack.enter_context(cm)`; if Ctrl-C or SIGTERM comes while `cm`
    starts, whatever it has started is stopped too."""
    try:
        return stack.enter_context(cm)
    except Stop:
        with contextlib.suppress(Exception):
            cm.__exit__(None, None, None)
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for var, opt, default, what in PORTS:
        ap.add_argument(opt, dest=var, type=int, default=default, help=f"{what} (make: {var}; default {default})")
    ap.add_argument("--config", type=Path, help="a plugin configuration (JSON) instead of the fleet's global rule")
    ap.add_argument("--log-level", default="info", help="the front Envoys' log level (default info)")
    a = ap.parse_args(argv)
    ports = {var: getattr(a, var) for var, _, _, _ in PORTS}
    plugin = PLUGIN
    if a.config:
        try:
            plugin = json.loads(a.config.read_text())
        except (OSError, ValueError) as e:
            print(f"{COMMAND}: --config {a.config}: {e}", file=sys.stderr)
            return 2

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = contextlib.ExitStack()
    try:
        check_ports(ports)
        if not harness.WASM.exists():
            raise Failed(f"{harness.WASM} is missing: run `make build`")
        if not RLS_BIN.exists():
            raise Failed(f"{RLS_BIN} is missing: run `make rls`")
        try:
            redis = enter(stack, Redis())
        except FileNotFoundError:
            raise Failed(f"{REDIS_BIN} not found: run `make redis-deps`") from None
        redis_logs = lambda: redis.log_path.read_text(errors="replace") if redis.log_path.exists() else ""
        rls = enter(stack, RlsServer(LIMITS, store="redis", redis_url=redis.url))
        children = [("redis-server", redis.proc, redis_logs), ("rate-limit service", rls.proc, rls.logs)]
        up = enter(stack, Envoy(upstream_bootstrap(ports["UPSTREAM_PORT"], ports["UPSTREAM_ADMIN_PORT"]),
                                concurrency=1))
        children.append(("upstream Envoy", up.proc, up.logs))
        fronts = []
        for name, port, admin in (("first front Envoy", ports["PORT"], ports["ADMIN_PORT"]),
                                  ("second front Envoy", ports["PORT2"], ports["ADMIN_PORT2"])):
            f = enter(stack, front(port, admin, ports["UPSTREAM_PORT"], rls.port, plugin, a.log_level))
            children.append((name, f.proc, f.logs))
            fronts.append(f)
        for f in fronts:
            wait_answers(f.port, children)

        if plugin is PLUGIN:
            rule = "\n".join([
                f"Rule per-client: {LIMIT_PER_MINUTE} requests per minute per client address across both "
                "Envoys, counted by the",
                f"rate-limit service in Redis (domain {DOMAIN}, fixed minute windows). Each Envoy's leader "
                "fetches tokens ahead",
                "of need, so no request waits on the service; with the service down, each Envoy admits at most",
                f"{LIMIT_PER_MINUTE // INSTANCES} per minute ({LIMIT_PER_MINUTE} / {INSTANCES} instances)."])
        else:
            rule = f"Plugin configuration: {a.config}"
        print(banner(ports, rls, redis, fronts, rule, plugin is PLUGIN), flush=True)
        while True:
            dead(children)
            time.sleep(0.5)
    except Stop:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.close()
        print("\nstopped", flush=True)
        return 0
    except (Failed, RuntimeError) as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"\n{COMMAND}: {e}", file=sys.stderr, flush=True)
        stack.close()
        return 1
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
