"""Start real Envoys for end-to-end tests: a direct-response upstream and a
front Envoy running the built sluice.wasm with a given plugin configuration.

Every Envoy gets free ports and its own --base-id, runs as a child of the
test process, and is stopped when the `with` block ends.
"""

import json
import re
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import http1

ROOT = Path(__file__).resolve().parent.parent
WASM = Path(os.environ.get("SLUICE_WASM", ROOT / "target/wasm32-wasip1/release/sluice.wasm"))
ENVOY = os.environ.get("ENVOY_BIN", str(ROOT / ".venv/bin/envoy"))
# sluice hands its metric changes to Envoy on every worker's 100 ms tick:
# three ticks cover a tick that runs late on a busy machine.
METRICS_LAG_S = 0.3
# sluice's labels, as Istio's extraStatTags extract them (and as
# envoy/envoy.yaml ships them): `NAME=.=value;.;` in a stat name.
LABELS = ["domain", "rule", "result", "breaker", "transition", "shedder", "priority", "budget", "limit"]
STATS_TAGS = [{"tag_name": n, "regex": rf"({n}=\.=(.*?);\.;)"} for n in LABELS]


def metric(name, domain="default", **labels):
    """The /stats name of a sluice metric with these labels, in the order
    sluice writes them (domain, then rule/breaker/shedder, then the variant)."""
    order = ["rule", "breaker", "shedder", "budget", "limit", "result", "transition", "priority"]
    tags = [("domain", domain)] + [(k, labels[k]) for k in order if k in labels]
    if set(labels) - set(order):
        raise ValueError(labels)
    return "wasmcustom." + "".join(f"{k}=.={v};.;" for k, v in tags) + name

_base_ids = iter(range(1000 + os.getpid() % 1000 * 50, 10**6))
_lock = threading.Lock()


def wait_ready(proc, url, seconds, what, logs):
    """Polls `url` until it answers 200 (True), `proc` exits (raises, with
    the end of its log) or `seconds` pass (False)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{logs()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def stop_child(proc, seconds):
    """Terminates a child process (if it runs), killing it after `seconds`."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ephemeral_range():
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_EPHEMERAL = _ephemeral_range()
_HANDED_OUT = set()
_PORTS = random.Random(os.getpid())


def free_port():
    """A free port for a server a test starts, below the kernel's ephemeral
    range when there is room: a port the kernel picked for `bind(0)` can
    be taken as the source port of an outgoing connection (a client's, or
    Envoy's to its upstream) before the server binds it ("Address already
    in use"); one outside that range never is. Not handed out twice in a
    process."""
    low, high = 20000, _EPHEMERAL[0] - 1
    if high - low > 1000:
        for _ in range(200):
            port = _PORTS.randint(low, high)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def next_base_id():
    with _lock:
        return next(_base_ids)


def hcm(stat_prefix, routes, http_filters, extra=None):
    cfg = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": http_filters
        + [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    cfg.update(extra or {})
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": cfg}


def listener(name, port, filters):
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [filters]}],
    }


def upstream_bootstrap(port, admin_port):
    fault = {
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "abort": {"header_abort": {}, "percentage": {"numerator": 100}},
            "delay": {"header_delay": {}, "percentage": {"numerator": 100}},
        },
    }
    routes = [{"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [listener("upstream", port, hcm("upstream", routes, [fault]))]},
    }


def wasm_filter(plugin_config, wasm=WASM, vm_id="sluice"):
    return {
        "name": "sluice",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "sluice",
                "root_id": "sluice",
                "vm_config": {
                    "vm_id": vm_id,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(wasm)}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config),
                },
            },
        },
    }


def cluster(name, port):
    return {
        "name": name,
        "connect_timeout": "1s",
        "type": "STATIC",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}],
        },
    }


def front_bootstrap(port, admin_port, upstream_port, http_filters, routes=None, extra_clusters=(), hcm_extra=None,
                    route_timeout="5s"):
    """`hcm_extra`: more HttpConnectionManager fields (an access log, say).
    `route_timeout`: the default route's ("0s": none)."""
    routes = routes or [{"name": "default", "match": {"prefix": "/"},
                         "route": {"cluster": "upstream", "timeout": route_timeout}}]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "stats_config": {"stats_tags": STATS_TAGS},
        "static_resources": {
            "listeners": [listener("front", port, hcm("front", routes, http_filters, hcm_extra))],
            "clusters": [cluster("upstream", upstream_port)] + [cluster(n, p) for n, p in extra_clusters],
        },
    }


class Envoy:
    """A running Envoy; use as a context manager."""

    def __init__(self, bootstrap, concurrency=2, log_level="warn", wrapper=(), ready_s=20, stop_s=10):
        """`wrapper`: a command that runs Envoy (valgrind, say), with the
        seconds it may take to become ready and to stop."""
        self.bootstrap = bootstrap
        self.concurrency = concurrency
        self.log_level = log_level
        self.wrapper = list(wrapper)
        self.ready_s = ready_s
        self.stop_s = stop_s
        self.admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
        self.proc = None
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-envoy-")
        self.log_path = Path(self.dir.name) / "envoy.log"

    def __enter__(self):
        cfg = Path(self.dir.name) / "envoy.json"
        cfg.write_text(json.dumps(self.bootstrap))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.wrapper + [ENVOY, "-c", str(cfg), "--concurrency", str(self.concurrency), "--base-id", str(next_base_id()),
             "-l", self.log_level, "--disable-hot-restart"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        if wait_ready(self.proc, f"http://127.0.0.1:{self.admin_port}/ready", self.ready_s, "envoy", self.logs):
            return self
        self.__exit__()
        raise RuntimeError("envoy did not become ready")

    def __exit__(self, *exc):
        stop_child(self.proc, self.stop_s)
        self.log.close()
        self.dir.cleanup()

    def logs(self):
        return self.log_path.read_text(errors="replace")

    def admin(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:
            return r.read().decode()

    def stats(self):
        out = {}
        for line in self.admin("/stats").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stat(self, name, default=0):
        """One stat. sluice's own (`wasmcustom.`) metrics reach Envoy on each
        worker's 100 ms tick, so reading one first waits out a tick. They are
        defined when the configuration loads: one missing is a wrong name,
        an error rather than a 0 that a test could not tell apart."""
        if name.startswith("wasmcustom."):
            time.sleep(METRICS_LAG_S)
            stats = self.stats()
            if name not in stats:
                raise KeyError(f"no stat {name}; sluice's: {sorted(k for k in stats if 'sluice' in k)[:20]}")
            return stats[name]
        return self.stats().get(name, default)


class Pair:
    """Starts `self.upstream` then `self.front` (both `Envoy`; the upstream
    may be None when the caller runs its own) and stops them in reverse
    order; `cleanup()` runs after both are stopped, or if the front fails to
    start."""

    def cleanup(self):
        pass

    def _stop_upstream(self):
        if self.upstream is not None:
            self.upstream.__exit__()

    def __enter__(self):
        if self.upstream is not None:
            self.upstream.__enter__()
        try:
            self.front.__enter__()
        except Exception:
            self._stop_upstream()
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.front.__exit__()
        self._stop_upstream()
        self.cleanup()


class Stack(Pair):
    """An upstream Envoy and a front Envoy with sluice, started together."""

    def __init__(self, plugin_config, concurrency=2, extra_filters=None, log_level="warn", routes=None, extra_clusters=(),
                 filters_before=None):
        self.port = free_port()
        self.upstream_port = free_port()
        self.upstream = Envoy(upstream_bootstrap(self.upstream_port, free_port()), concurrency=1)
        filters = (filters_before or []) + [wasm_filter(plugin_config)] + (extra_filters or [])
        clusters = [(n, p or self.upstream_port) for n, p in extra_clusters]
        boot = front_bootstrap(self.port, free_port(), self.upstream_port, filters, routes, clusters)
        self.front = Envoy(boot, concurrency, log_level)

    def upstream_requests(self):
        """Requests the upstream Envoy has received."""
        return self.upstream.stat("http.upstream.downstream_rq_total")


def validate(plugin_config):
    """Runs `envoy --mode validate` on a front config; returns (ok, output)."""
    boot = front_bootstrap(free_port(), free_port(), free_port(), [wasm_filter(plugin_config)])
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "envoy.json"
        cfg.write_text(json.dumps(boot))
        p = subprocess.run(
            [ENVOY, "--mode", "validate", "-c", str(cfg), "--base-id", str(next_base_id()), "-l", "info"],
            capture_output=True, text=True, timeout=60,
        )
    return p.returncode == 0, p.stdout + p.stderr


class ChildUpstream:
    """A test upstream script (tests/<script>) as a child process on a free
    port, started with `args` after the port; `control(path)` GETs one of
    its JSON control paths."""

    script = None

    def __init__(self, *args):
        self.port = free_port()
        self.args = [str(self.port)] + [str(a) for a in args]
        self.proc = None

    def __enter__(self):
        script = Path(__file__).with_name(self.script)
        self.proc = subprocess.Popen([sys.executable, str(script), *self.args], stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"{self.script} did not start")

    def __exit__(self, *exc):
        stop_child(self.proc, 5)

    def control(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return json.loads(r.read())

    def stats(self):
        return self.control("/__stats")


class SlowUpstream(ChildUpstream):
    """tests/slow_upstream.py: at most `capacity` requests served at once,
    each taking `delay_ms` (served in full even when the proxy resets them,
    if `blind`); GET /__stats tells the most it ever had in flight and when
    each request arrived (`stats()`)."""

    script = "slow_upstream.py"

    def __init__(self, capacity, delay_ms, blind=False):
        super().__init__(capacity, delay_ms, *(["blind"] if blind else []))

    def reset_peaks(self):
        """Each tenant's peak starts again from its requests in flight now."""
        urllib.request.urlopen(f"http://127.0.0.1:{self.port}/__reset", timeout=5).close()


class CapacityUpstream(ChildUpstream):
    """tests/capacity_upstream.py: an upstream whose capacity and error rate
    change at run time (`set_capacity`, `control("/__errors?pct=P")`)."""

    script = "capacity_upstream.py"

    def __init__(self, capacity, delay_ms):
        super().__init__(capacity, delay_ms)

    def set_capacity(self, n):
        self.control(f"/__capacity?n={n}")

    def stats(self, reset=False):
        return self.control("/__stats?reset=1" if reset else "/__stats")


class FrontOf:
    """A child upstream (a `ChildUpstream`) and a front Envoy with sluice
    (or no filter, for `plugin_config` None) in front of it, started
    together."""

    def __init__(self, upstream, plugin_config, concurrency=2):
        self.up = upstream
        self.port = free_port()
        filters = [wasm_filter(plugin_config)] if plugin_config is not None else []
        self.front = Envoy(front_bootstrap(self.port, free_port(), self.up.port, filters), concurrency)

    def __enter__(self):
        self.up.__enter__()
        try:
            self.front.__enter__()
        except Exception:
            self.up.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self.front.__exit__()
        self.up.__exit__()

    def upstream_stats(self):
        return self.up.stats()


def assert_burst_within_limit(port, limit, n=100, workers=2):
    """n requests at once on n connections: never more than `limit` admitted,
    and at most the 2 slots a worker may hold in a lease left unused."""
    got = [b[0].status for b in http1.burst(port, [[http1.build("/")] for _ in range(n)])]
    ok = got.count(200)
    assert limit - 2 * workers <= ok <= limit, got
    assert got.count(503) == n - ok


def port_free(port):
    """Whether nothing listens on 127.0.0.1:port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def get_status(port):
    """One GET / with urllib: (status, lower-cased headers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def assert_demo_limit(port, admin_port):
    """The demo rule of envoy/envoy.yaml seen from outside: 10 at once per
    client address (a readiness probe from another address spent none),
    then 429s with Retry-After, beyond the burst only what refilled
    meanwhile (1 per second), and the refusals in the admin's metrics."""
    t0 = time.time()
    got = [get_status(port) for _ in range(20)]
    elapsed = time.time() - t0
    codes = [c for c, _ in got]
    assert codes[:10] == [200] * 10 and codes[-1] == 429 and set(codes) == {200, 429}, codes
    assert codes.count(200) <= 10 + int(elapsed) + 1, (codes, elapsed)
    assert "retry-after" in got[-1][1], got[-1][1]
    time.sleep(METRICS_LAG_S)
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats/prometheus", timeout=5) as r:
        prom = r.read().decode()
    assert re.search(r'^sluice_rl_requests_total\{domain="default",rule="per-client",result="limited"\} [1-9]', prom, re.M), prom[-2000:]
