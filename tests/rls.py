"""Start the reference rate-limit service (rls/, `make rls`) and Debian's
redis-server on free ports, as children of the test, and build the Envoy
pieces that point Envoy's native ratelimit filter at them.

Everything started here is stopped when its `with` block ends.
"""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import cluster, free_port, stop_child, time_passes, wait_ready, wait_until

ROOT = Path(__file__).resolve().parent.parent
RLS_BIN = Path(os.environ.get("SLUICE_RLS_BIN", ROOT / "rls/target/debug/sluice-rls"))
REDIS_BIN = os.environ.get("REDIS_SERVER", shutil.which("redis-server") or "redis-server")


def _wait_tcp(port, seconds, proc, what, logs):
    """Whether `port` accepts a connection within `seconds`; raises if `proc`
    exits first."""

    def listening():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{logs()[-4000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        return wait_until(listening, seconds, f"{what} listening on {port}", interval=0.05)
    except AssertionError:
        return False


class Redis:
    """redis-server on 127.0.0.1, a free port, no persistence. `stop()` and
    `start()` restart it on the same port (a Redis outage)."""

    def __init__(self, port=None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc = None
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-redis-")
        self.log_path = Path(self.dir.name) / "redis.log"

    def start(self):
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self.dir.name, "--logfile", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        logs = lambda: self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        if not _wait_tcp(self.port, 10, self.proc, "redis-server", logs) or self.command("PING") != "PONG":
            self.stop()
            raise RuntimeError(f"redis-server did not start:\n{logs()[-4000:]}")
        return self

    def stop(self):
        stop_child(self.proc, 5)

    def command(self, *args):
        """One command in RESP: a simple string, an integer or a bulk
        string's value (None for a nil); an error raises; an array comes
        back as the raw text of its first reply chunk (for messages)."""
        out = f"*{len(args)}\r\n" + "".join(f"${len(str(a))}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(out.encode())
            reply = b""
            while True:
                lines = reply.split(b"\r\n")
                head = lines[0].decode() if len(lines) > 1 else ""
                if head[:1] in ("+", "-", ":", "*") or head == "$-1":
                    break
                if head[:1] == "$" and len(lines) > 2 and len(lines[1]) >= int(head[1:]):
                    break
                chunk = s.recv(4096)
                if not chunk:
                    raise ConnectionError(f"redis closed the connection after {reply!r}")
                reply += chunk
        if head[0] == "-":
            raise RuntimeError(f"redis: {head[1:]}")
        if head[0] == ":":
            return int(head[1:])
        if head[0] == "$":
            return None if head == "$-1" else lines[1].decode()
        if head[0] == "*":
            return reply.decode(errors="replace")
        return head[1:]

    def __enter__(self):
        try:
            return self.start()
        except Exception:
            self.dir.cleanup()
            raise

    def __exit__(self, *exc):
        self.stop()
        self.dir.cleanup()


class RlsServer:
    """The reference RLS server with `limits` (the JSON config: a domain
    object or a list of them) on a free gRPC port, with its stats port."""

    def __init__(self, limits, store="memory", redis_url=None, delay_ms=0, extra_args=(), port=None):
        """`port`: the gRPC port (a free one by default; give the port of a
        server stopped earlier to restart it where Envoy expects it)."""
        self.port = port or free_port()
        self.stats_port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-rls-")
        self.config_path = Path(self.dir.name) / "limits.json"
        self.config_path.write_text(json.dumps(limits))
        self.log_path = Path(self.dir.name) / "rls.log"
        self.args = [str(RLS_BIN), "--port", str(self.port), "--stats-port", str(self.stats_port),
                     "--config", str(self.config_path), "--store", store, "--delay-ms", str(delay_ms)]
        if redis_url:
            self.args += ["--redis-url", redis_url, "--redis-timeout-ms", "500"]
        self.args += list(extra_args)
        self.proc = None

    def __enter__(self):
        if not RLS_BIN.exists():
            raise RuntimeError(f"{RLS_BIN} is missing: run `make rls`")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # The stats port answers only once the gRPC port is bound.
        if wait_ready(self.proc, f"http://127.0.0.1:{self.stats_port}/stats", 10, "sluice-rls", self.logs):
            return self
        self.__exit__()
        raise RuntimeError(f"sluice-rls did not start:\n{self.logs()[-4000:]}")

    def __exit__(self, *exc):
        stop_child(self.proc, 5)
        self.log.close()
        self.dir.cleanup()

    def logs(self):
        return self.log_path.read_text(errors="replace")

    def stats(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats", timeout=5) as r:
            return json.loads(r.read())


def rls_cluster(name, port):
    """An Envoy cluster for a gRPC service: HTTP/2 to 127.0.0.1:port."""
    c = cluster(name, port)
    c["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return c


def ratelimit_filter(domain, cluster="rls", timeout="1s", **extra):
    """Envoy's native ratelimit filter (envoy.filters.http.ratelimit) calling
    the RLS at `cluster` with API V3; `extra`: more filter fields
    (failure_mode_deny, rate_limits, ...)."""
    cfg = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": domain,
        "timeout": timeout,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": cluster}}, "transport_api_version": "V3"},
    }
    cfg.update(extra)
    return {"name": "envoy.filters.http.ratelimit", "typed_config": cfg}


def limited_route(actions_list, name="default"):
    """A route to the upstream whose `rate_limits` are one entry per list of
    actions (each entry makes one descriptor)."""
    return {"name": name, "match": {"prefix": "/"},
            "route": {"cluster": "upstream", "timeout": "5s",
                      "rate_limits": [{"actions": actions} for actions in actions_list]}}


def header_action(header, key):
    return {"request_headers": {"header_name": header, "descriptor_key": key}}


def wait_out_window_edge(unit_s=60, margin_s=5):
    """Sleeps past the next window boundary if fewer than `margin_s` seconds
    of the current fixed window are left, so that the requests of a short
    test (call it once everything has started) stay in one window."""
    left = unit_s - time.time() % unit_s
    if left < margin_s:
        time_passes(left + 0.05)  # into the next window
