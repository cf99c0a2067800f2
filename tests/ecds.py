"""Front Envoys whose sluice filter is delivered through ECDS (Extension
Config Discovery), from a file the test rewrites, as Istio delivers a
WasmPlugin (there over ADS; the resource and the filter are the same), or
Envoy Gateway an `EnvoyExtensionPolicy`'s dynamic module: the suite's host
(harness.HOST) by default.

`EcdsStack(config)` starts a direct-response upstream and a front Envoy
whose HTTP filter `sluice` has `config_discovery` pointing at a file-based
config source; `stack.push(config)` rewrites that file atomically (a temp
file in the same directory, then rename), which is what Envoy's file watcher
expects. Helpers here only build on harness.py.
"""

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import http1
from harness import (CONFIG_APPLIED_S, HOST, TRAFFIC_SEEN_S, WASM, Envoy, Pair, free_port, front_bootstrap, native_filter,
                     time_passes, upstream_bootstrap, wait_until)

WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
NATIVE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
FILTER_TYPES = {"wasm": WASM_TYPE, "native": NATIVE_TYPE}
TEC_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"


def plugin_config(configuration, name="sluice", root_id="sluice", vm_id="sluice", env=None,
                  failure_policy=None, wasm=WASM):
    """A Wasm HTTP filter config (envoy.extensions.filters.http.wasm.v3.Wasm)
    with the plugin configuration as a JSON StringValue."""
    vm = {"vm_id": vm_id, "runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": str(wasm)}}}
    if env:
        vm["environment_variables"] = {"key_values": env}
    cfg = {
        "name": name,
        "root_id": root_id,
        "vm_config": vm,
        "configuration": {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": configuration if isinstance(configuration, str) else json.dumps(configuration),
        },
    }
    if failure_policy:
        cfg["failure_policy"] = failure_policy
    return {"@type": WASM_TYPE, "config": cfg}


def host_config(configuration, host=None):
    """The filter config of `host` (the suite's by default) with this plugin
    configuration: `plugin_config`'s, or the native build's
    DynamicModuleFilter."""
    if (host or HOST) == "wasm":
        return plugin_config(configuration)
    return native_filter(configuration)["typed_config"]


def discovery_response(resource_name, wasm_config, version):
    return {
        "version_info": str(version),
        "type_url": TEC_TYPE,
        "resources": [{"@type": TEC_TYPE, "name": resource_name, "typed_config": wasm_config}],
    }


def ecds_filter(resource_name, path, host=None):
    """An HCM http filter whose config comes from ECDS, read from `path`."""
    return {
        "name": resource_name,
        "config_discovery": {
            "config_source": {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"},
            "type_urls": [FILTER_TYPES[host or HOST]],
        },
    }


def write_atomically(path, text):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EcdsStack(Pair):
    """An upstream Envoy and a front Envoy whose wasm filter(s) come from ECDS.

    `configuration` is a plugin configuration for one filter named
    `resource_name`, or a dict {resource name: configuration} for several
    filters in that order (each its own ECDS resource and file).
    `wasm_config(configuration, name)` builds the filter's typed config
    (default: `host_config`: for the wasm build `plugin_config` with vm_id
    "sluice"); `host`, the build (the suite's by default)."""

    def __init__(self, configuration, resource_name="sluice", concurrency=2, log_level="info",
                 wasm_config=None, stats_config=None, upstream_port=None, clusters=(), host=None):
        """`clusters`: more clusters for the front Envoy (a rate-limit
        service's, say)."""
        self.wasm_config = wasm_config or (lambda c, name: host_config(c, host))
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-ecds-")
        configs = configuration if isinstance(configuration, dict) and "__many__" in configuration else None
        if configs is not None:
            configs = {k: v for k, v in configuration.items() if k != "__many__"}
        else:
            configs = {resource_name: configuration}
        self.resource_name = next(iter(configs))
        self.paths = {name: Path(self.dir.name) / f"ecds-{i}.json" for i, name in enumerate(configs)}
        self.versions = {name: 0 for name in configs}
        for name, cfg in configs.items():
            self.push(cfg, name)
        self.port = free_port()
        # The given upstream port (a server the caller runs), or an Envoy
        # with a direct_response route started here.
        self.upstream_port = upstream_port or free_port()
        self.upstream = (None if upstream_port else
                         Envoy(upstream_bootstrap(self.upstream_port, free_port()), concurrency=1))
        filters = [ecds_filter(name, path, host) for name, path in self.paths.items()]
        boot = front_bootstrap(self.port, free_port(), self.upstream_port, filters)
        boot["static_resources"]["clusters"].extend(clusters)
        # xDS subscriptions, file-based ones included, need a node id and cluster.
        boot["node"] = {"id": "sluice-test", "cluster": "sluice-test"}
        if stats_config is not None:
            boot["stats_config"] = stats_config
        self.front = Envoy(boot, concurrency, log_level)

    @property
    def path(self):
        return self.paths[self.resource_name]

    def push(self, configuration, name=None):
        """Writes a new DiscoveryResponse for resource `name`; returns its version."""
        name = name or self.resource_name
        self.versions[name] += 1
        resp = discovery_response(name, self.wasm_config(configuration, name), self.versions[name])
        write_atomically(self.paths[name], json.dumps(resp))
        return self.versions[name]

    def ecds_stat(self, what, name=None):
        """extension_config_discovery.http_filter.<resource>.<what>."""
        name = name or self.resource_name
        return self.front.stat(f"extension_config_discovery.http_filter.{name}.{what}")

    def wait_stat(self, what, at_least, timeout=CONFIG_APPLIED_S, name=None):
        """Waits until ecds_stat(what) is at least `at_least` (an update
        applied, or rejected); returns it. Fails with the end of the front
        Envoy's log."""
        got = []

        def reached():
            got.append(self.ecds_stat(what, name))
            return got[-1] >= at_least

        wait_until(reached, timeout, lambda: f"{what} >= {at_least} (ECDS); the front Envoy's log:\n"
                   f"{self.front.logs()[-3000:]}", interval=0.05)
        return got[-1]

    def cleanup(self):
        self.dir.cleanup()


def several(configs):
    """Marks {resource name: configuration} for EcdsStack: several filters."""
    return dict(configs, __many__=True)


class Load:
    """A background thread sending requests in a loop on keep-alive
    connections (reconnecting after any error), bounded in count and time.
    Records (time, status or error text, rule header) for each request."""

    def __init__(self, port, headers=None, path="/", max_requests=20000, max_seconds=60, pause=0.002,
                 requests_per_connection=20):
        self.port, self.headers, self.path = port, headers or {}, path
        # New connections now and then, so that both workers see traffic.
        self.requests_per_connection = requests_per_connection
        self.max_requests, self.max_seconds, self.pause = max_requests, max_seconds, pause
        self.results = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        end = time.time() + self.max_seconds
        conn, used = None, 0
        req = http1.build(self.path, self.headers)
        while not self._stop.is_set() and time.time() < end and len(self.results) < self.max_requests:
            try:
                if conn is not None and used >= self.requests_per_connection:
                    conn.close()
                    conn = None
                if conn is None:
                    conn, used = http1.Conn(self.port, timeout=10), 0
                used += 1
                r = conn.send_all([req])[0]
                rule = None
                if r.status == 429:
                    try:
                        rule = json.loads(r.body).get("rule")
                    except ValueError:
                        rule = "?"
                self.results.append((time.time(), r.status, rule))
                if r.header("connection") == "close":
                    conn.close()
                    conn = None
            except Exception as e:  # recorded: a test decides whether that is allowed
                self.results.append((time.time(), f"error: {type(e).__name__}: {e}", None))
                if conn is not None:
                    conn.close()
                conn = None
                time_passes(0.01)  # a moment before reconnecting
            if self.pause:
                time_passes(self.pause)  # the load's pace
        if conn is not None:
            conn.close()

    def since(self, t):
        return [r for r in list(self.results) if r[0] >= t]

    def wait_for(self, predicate, since, timeout, what="a result as wanted"):
        """Waits until a result after `since` satisfies predicate(result);
        returns that result. `what`: a string, or a function returning one."""
        return wait_until(lambda: next((r for r in self.since(since) if predicate(r)), None), timeout,
                          lambda: f"{what() if callable(what) else what} from the load; "
                                  f"last results: {self.results[-5:]}")

    def wait_count(self, n, timeout=TRAFFIC_SEEN_S):
        """Waits until the load has `n` results."""
        wait_until(lambda: len(self.results) >= n, timeout,
                   lambda: f"{n} results from the load; last: {self.results[-5:]}")
        return True

    def unexpected(self, allowed):
        """Results whose (status, rule) is not in `allowed`, e.g.
        {(200, None), (429, "load")}; errors are always unexpected."""
        return [r for r in list(self.results) if (r[1], r[2]) not in allowed]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(self.max_seconds + 15)
