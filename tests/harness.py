"""Start real Envoys for end-to-end tests: a direct-response upstream and a
front Envoy running a build of sluice with a given plugin configuration.

The build is the suite's host: `SLUICE_HOST=wasm` (the default: the built
sluice.wasm) or `SLUICE_HOST=native` (the native build, an Envoy dynamic
module); `Stack`, `validate`, `sluice_filter`, `metric` and the ECDS
helpers take it unless told otherwise. A test that cannot apply to a host
is marked `wasm_only(reason)` (tests/conftest.py skips it on the other).

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
import urllib.parse
import urllib.request
from pathlib import Path

import http1

ROOT = Path(__file__).resolve().parent.parent
WASM = Path(os.environ.get("SLUICE_WASM", ROOT / "target/wasm32-wasip1/release/sluice.wasm"))
# The native build (native/, an Envoy dynamic module): `make build-native`.
NATIVE = Path(os.environ.get("SLUICE_NATIVE", ROOT / "native/target/release/libsluice_native.so"))
ENVOY = os.environ.get("ENVOY_BIN", str(ROOT / ".venv/bin/envoy"))
# The build of sluice the suite runs (see the module's comment).
HOST = os.environ.get("SLUICE_HOST", "wasm")
if HOST not in ("wasm", "native"):
    raise SystemExit(f"SLUICE_HOST must be wasm or native, not {HOST!r}")
# The prefix of sluice's metrics in /stats, by host.
STAT_PREFIX = {"wasm": "wasmcustom.", "native": "dynamicmodulescustom."}

# How long a test waits for something that must happen (`wait_until`).
# Generous: a wait ends as soon as its condition holds, so these cost time
# only when a test fails (on a loaded 2-core machine things are slower).
#
# A sluice metric is due: sluice hands its metric changes to Envoy on every
# worker's 100 ms tick; a late tick on a busy machine takes longer.
METRICS_DUE_S = 10
# An Envoy (or Prometheus, a child upstream, the rate-limit service) is up
# and answering.
ENVOY_READY_S = 20
# A configuration update (ECDS) is applied on every worker.
CONFIG_APPLIED_S = 20
# An upstream or a client thread has seen the requests sent (or answered).
TRAFFIC_SEEN_S = 20

# The one fixed pause: to see that something does NOT happen (a counter stays
# at 0, a gauge stays back at 0, no more requests reach the upstream) there
# is no condition to wait for; `settle()` waits out three of sluice's 100 ms
# ticks (a tick may run late on a busy machine), after which every worker
# has handed Envoy whatever it had.
SETTLE_S = 0.3
# The same pause under the name bench/ reads it by.
METRICS_LAG_S = SETTLE_S

# sluice's labels, as Istio's extraStatTags extract them (and as
# envoy/envoy.yaml ships them): `NAME=.=value;.;` in a stat name.
LABELS = ["domain", "rule", "result", "breaker", "transition", "shedder", "priority", "budget", "limit"]
STATS_TAGS = [{"tag_name": n, "regex": rf"({n}=\.=(.*?);\.;)"} for n in LABELS]


def metric(name, domain="default", host=None, **labels):
    """The /stats name of a sluice metric with these labels, in the order
    sluice writes them (domain, then rule/breaker/shedder, then the variant),
    as `host` (the suite's by default) names it."""
    order = ["rule", "breaker", "shedder", "budget", "limit", "result", "transition", "priority"]
    tags = [("domain", domain)] + [(k, labels[k]) for k in order if k in labels]
    if set(labels) - set(order):
        raise ValueError(labels)
    return STAT_PREFIX[host or HOST] + "".join(f"{k}=.={v};.;" for k, v in tags) + name


def wait_until(condition, timeout, what, interval=0.02):
    """Polls `condition()` every `interval` seconds until it returns a truthy
    value, and returns that value. After `timeout` seconds, raises
    AssertionError naming `what` (a string, or a function returning one,
    called only then: e.g. the end of a log) and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"not within {timeout} s: {text} (last seen: {last!r})")
        time.sleep(interval)


def settle(seconds=SETTLE_S):
    """A fixed pause before checking that something did NOT happen (see
    SETTLE_S): no condition can say that nothing more will come."""
    time.sleep(seconds)


def time_passes(seconds):
    """A pause that is the scenario itself: a bucket refilling, a window
    sliding, a breaker's open interval elapsing, requests held for a while.
    Say why at the call."""
    time.sleep(seconds)


def matches(want):
    """A predicate from `want`: itself if callable, else equality."""
    return want if callable(want) else (lambda v: v == want)


_base_ids = iter(range(1000 + os.getpid() % 1000 * 50, 10**6))
_lock = threading.Lock()


def wait_ready(proc, url, seconds, what, logs):
    """Polls `url` until it answers 200 (True), `proc` exits (raises, with
    the end of its log) or `seconds` pass (False)."""

    def answers():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{logs()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        return wait_until(answers, seconds, f"{what} ready at {url}", interval=0.05)
    except AssertionError:
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


def native_filter(plugin_config, lib=NATIVE):
    """The same configuration for the native build (native/README.md)."""
    return {
        "name": "sluice",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"module": {"local": {"filename": str(lib)}}, "do_not_close": True},
            "filter_name": "sluice",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config),
            },
        },
    }


HOSTS = {"wasm": wasm_filter, "native": native_filter}


def sluice_filter(plugin_config, host=None):
    """The sluice HTTP filter of `host` (the suite's by default)."""
    return HOSTS[host or HOST](plugin_config)

# Envoy 1.40 names a dynamic module's metrics `envoy_dynamicmodulescustom_*`
# in /stats/prometheus unless this runtime flag is on; with it, the native
# build's series are the wasm build's (`sluice_*`).
NATIVE_RUNTIME = {"layers": [{"name": "static", "static_layer": {
    "envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix": True}}]}


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
    `route_timeout`: the default route's ("0s": none). The runtime flag
    NATIVE_RUNTIME is on (the native build's Prometheus names; nothing
    else reads it)."""
    routes = routes or [{"name": "default", "match": {"prefix": "/"},
                         "route": {"cluster": "upstream", "timeout": route_timeout}}]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "layered_runtime": NATIVE_RUNTIME,
        "stats_config": {"stats_tags": STATS_TAGS},
        "static_resources": {
            "listeners": [listener("front", port, hcm("front", routes, http_filters, hcm_extra))],
            "clusters": [cluster("upstream", upstream_port)] + [cluster(n, p) for n, p in extra_clusters],
        },
    }


class Envoy:
    """A running Envoy; use as a context manager."""

    def __init__(self, bootstrap, concurrency=2, log_level="warn", wrapper=(), ready_s=ENVOY_READY_S, stop_s=10):
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
        self.log = None
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-envoy-")
        self.log_path = Path(self.dir.name) / "envoy.log"

    def __enter__(self):
        self.start()
        return self.ready()

    def start(self):
        """Starts the process without waiting for it (see `ready`)."""
        cfg = Path(self.dir.name) / "envoy.json"
        cfg.write_text(json.dumps(self.bootstrap))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.wrapper + [ENVOY, "-c", str(cfg), "--concurrency", str(self.concurrency), "--base-id", str(next_base_id()),
             "-l", self.log_level, "--disable-hot-restart"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def ready(self):
        """Waits until the started Envoy is ready; stops it and raises if it
        is not within `ready_s`."""
        if wait_ready(self.proc, f"http://127.0.0.1:{self.admin_port}/ready", self.ready_s, "envoy", self.logs):
            return self
        self.__exit__()
        raise RuntimeError("envoy did not become ready")

    def terminate(self):
        """Asks the process to stop without waiting (see `__exit__`)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()

    def __exit__(self, *exc):
        stop_child(self.proc, self.stop_s)
        if self.log is not None:
            self.log.close()
        self.dir.cleanup()

    def logs(self):
        return self.log_path.read_text(errors="replace")

    def admin(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:
            return r.read().decode()

    def stats(self, regex=None):
        """Envoy's stats with a number for a value (those whose name matches
        `regex`, if given)."""
        out = {}
        query = "?filter=" + urllib.parse.quote(regex) if regex else ""
        for line in self.admin("/stats" + query).splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stat(self, name, default=0):
        """One stat as it is now. sluice's own (`wasmcustom.`, the native
        build's `dynamicmodulescustom.`) metrics are
        defined when the configuration loads: one missing is a wrong name,
        an error rather than a 0 that a test could not tell apart. They reach
        Envoy on each worker's 100 ms tick: read one when it is due, with
        `wait_stat` (for a value the test's traffic must bring about) or
        `settled_stat` (for a value that must not change)."""
        stats = self.stats(f"^{re.escape(name)}$")
        if name in stats:
            return stats[name]
        if name.startswith(tuple(STAT_PREFIX.values())):
            stats = self.stats()
            raise KeyError(f"no stat {name}; sluice's: {sorted(k for k in stats if 'sluice' in k)[:20]}")
        return default

    def wait_stat(self, name, want, timeout=METRICS_DUE_S):
        """Waits until stat `name` is `want` (a value, or a predicate on the
        value) and returns it; fails naming the stat and its last value.
        Only for a value that differs from the one before the traffic that
        brings it about (else a stale read would pass: use settled_stat)."""
        ok = matches(want)
        got = []

        def due():
            got.append(self.stat(name))
            return ok(got[-1])

        wanted = f"{name} == {want!r}" if not callable(want) else f"{name} as wanted"
        wait_until(due, timeout, lambda: f"{wanted}; last value {got[-1]}", interval=0.05)
        return got[-1]

    def settled_stat(self, name, default=0):
        """Stat `name` once every worker has handed its metric changes over
        (`settle()`): for checking that a value did not change."""
        settle()
        return self.stat(name, default)


class Pair:
    """Starts `self.upstream` and `self.front` (both `Envoy`; the upstream
    may be None when the caller runs its own) side by side, returns once both
    are ready, and stops them together; `cleanup()` runs after both are
    stopped, or if either fails to start."""

    def cleanup(self):
        pass

    def _envoys(self):
        return [e for e in (self.front, self.upstream) if e is not None]

    def _stop(self):
        for e in self._envoys():
            e.terminate()
        for e in self._envoys():
            e.__exit__()
        self.cleanup()

    def __enter__(self):
        try:
            for e in reversed(self._envoys()):
                e.start()
            for e in reversed(self._envoys()):
                e.ready()
        except Exception:
            self._stop()
            raise
        return self

    def __exit__(self, *exc):
        self._stop()


class Stack(Pair):
    """An upstream Envoy and a front Envoy with sluice, started together."""

    def __init__(self, plugin_config, concurrency=2, extra_filters=None, log_level="warn", routes=None, extra_clusters=(),
                 filters_before=None, host=None):
        """`host`: the build of sluice, "wasm" or "native" (see HOSTS; the
        suite's by default)."""
        self.port = free_port()
        self.upstream_port = free_port()
        self.upstream = Envoy(upstream_bootstrap(self.upstream_port, free_port()), concurrency=1)
        filters = (filters_before or []) + [sluice_filter(plugin_config, host)] + (extra_filters or [])
        clusters = [(n, p or self.upstream_port) for n, p in extra_clusters]
        boot = front_bootstrap(self.port, free_port(), self.upstream_port, filters, routes, clusters)
        self.front = Envoy(boot, concurrency, log_level)

    def upstream_requests(self):
        """Requests the upstream Envoy has received."""
        return self.upstream.stat("http.upstream.downstream_rq_total")


def validate(plugin_config, host=None):
    """Runs `envoy --mode validate` on a front config; returns (ok, output)."""
    boot = front_bootstrap(free_port(), free_port(), free_port(), [sluice_filter(plugin_config, host)])
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
        def listening():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        try:
            wait_until(listening, ENVOY_READY_S, f"{self.script} listening on {self.port}", interval=0.05)
        except AssertionError:
            self.__exit__()
            raise RuntimeError(f"{self.script} did not start")
        return self

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
    """tests/capacity_upstream.py: an upstream whose capacity, error rate
    and service time change at run time (`set_capacity`,
    `control("/__errors?pct=P")`, `control("/__service?lo=A&hi=B")`)."""

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
        filters = [sluice_filter(plugin_config)] if plugin_config is not None else []
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
    limited = re.compile(r'^sluice_rl_requests_total\{domain="default",rule="per-client",result="limited"\} [1-9]', re.M)
    prom = []

    def refusals_counted():
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats/prometheus", timeout=5) as r:
            prom.append(r.read().decode())
        return limited.search(prom[-1])

    wait_until(refusals_counted, METRICS_DUE_S, lambda: f"the refusals in the metrics: {prom[-1][-2000:]}")
