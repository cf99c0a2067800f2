"""`make run` (scripts/run.sh) as a person meets it: it says it is running
only when the front Envoy answers through its own listener, it limits, it
stops everything on Ctrl-C, and it fails at once, naming the port, when a
port is taken, or with Envoy's last log lines when an Envoy exits."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness import (ENVOY, ENVOY_READY_S, NATIVE, ROOT, assert_demo_limit, free_port, port_free, upstream_bootstrap, wait_ready,
                     wait_until)

RUN = ROOT / "scripts/run.sh"


def ports():
    chosen = {}
    while len(set(chosen.values())) < 4:
        chosen = {v: free_port() for v in ("PORT", "ADMIN_PORT", "UPSTREAM_PORT", "UPSTREAM_ADMIN_PORT")}
    return chosen


class RunSh:
    """scripts/run.sh as a child in its own process group (so that
    everything it started can be found, and killed if the test fails), its
    output collected line by line."""

    def __init__(self, chosen, tmpdir, **env):
        """`tmpdir`: run.sh's TMPDIR, to check that it leaves nothing there;
        `env`: more environment (HOST=native, say)."""
        self.tmpdir = Path(tmpdir)
        self.tmpdir.mkdir(exist_ok=True)
        self.env = dict(os.environ, ENVOY=ENVOY, TMPDIR=str(tmpdir), **{k: str(v) for k, v in chosen.items()}, **env)
        self.lines = queue.Queue()
        self.out = []

    def __enter__(self):
        # Ctrl-C as a terminal sends it, whatever this process inherited: a
        # shell that starts a job in the background without job control
        # ignores SIGINT in it, and a signal ignored on entry cannot be
        # trapped (run.sh would never see Ctrl-C).
        self.proc = subprocess.Popen(["bash", str(RUN)], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.pgid = self.proc.pid
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern, timeout):
        """The first output line matching `pattern`, or fail after `timeout` s."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            self.out.append(line)
            if re.search(pattern, line):
                return line
        pytest.fail(f"no line matching {pattern!r} within {timeout}s:\n" + self.output()[-4000:])

    def finish(self, timeout):
        """Exit status, waiting at most `timeout` s; all output collected."""
        rc = self.proc.wait(timeout)
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.out.append(line)
        return rc

    def output(self):
        return "".join(self.out)

    def left_behind(self):
        return sorted(p.name for p in self.tmpdir.iterdir())

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (nothing, if run.sh did its job).
        for pid in group_members(self.pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"


def group_members(pgid):
    """Live (not zombie) processes in the process group."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def proc_file(pid, name):
    """/proc/PID/NAME, or "" when PID has exited since it was listed (the
    group has short-lived members, such as run.sh's `sleep`)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_run_serves_limits_and_stops_on_ctrl_c(tmp_path):
    chosen = ports()
    with RunSh(chosen, tmp_path / "tmp") as run:
        line = run.wait_for(r"sluice is running", timeout=60)
        assert f"http://127.0.0.1:{chosen['PORT']}" in line
        assert f"admin: http://127.0.0.1:{chosen['ADMIN_PORT']}" in line
        tmp = re.search(r"in (/\S+sluice-run\.\w+)", run.wait_for(r"^Configuration:", timeout=5)).group(1)
        assert Path(tmp, "envoy.yaml").exists() and Path(tmp).parent == tmp_path / "tmp"
        run.wait_for(r"Press Ctrl-C", timeout=5)

        # The demo bucket, and the admin port is this Envoy's: it counts
        # what sluice did.
        assert_demo_limit(chosen["PORT"], chosen["ADMIN_PORT"])

        pids = group_members(run.pgid)
        assert len(pids) >= 3, pids  # run.sh and two Envoys (and their tees)

        run.proc.send_signal(signal.SIGINT)
        assert run.finish(timeout=20) == 0, run.output()[-3000:]
        assert run.output().rstrip().endswith("stopped")
        wait_until(lambda: group_members(run.pgid) == [], 5, "no processes left behind", interval=0.05)
        for var, port in chosen.items():
            assert port_free(port), f"{var} {port} still bound"
        assert run.left_behind() == [], "the rendered configuration was not removed"


@pytest.mark.native
def test_run_with_host_native_serves_the_same_demo_on_the_native_build(tmp_path):
    """`make run HOST=native` (run by `make test-native`): the same rule and
    metric series from the dynamic module."""
    chosen = ports()
    with RunSh(chosen, tmp_path / "tmp", HOST="native", SLUICE_NATIVE=str(NATIVE)) as run:
        line = run.wait_for(r"sluice is running", timeout=60)
        assert "(native build)" in line, line
        tmp = re.search(r"in (/\S+sluice-run\.\w+)", run.wait_for(r"^Configuration:", timeout=5)).group(1)
        assert "DynamicModuleFilter" in Path(tmp, "envoy.yaml").read_text()
        assert_demo_limit(chosen["PORT"], chosen["ADMIN_PORT"])
        run.proc.send_signal(signal.SIGINT)
        try:
            rc = run.finish(timeout=20)
        except subprocess.TimeoutExpired:
            left = [cmdline(p) for p in group_members(run.pgid)]
            pytest.fail(f"run.sh still running 20 s after Ctrl-C; its processes: {left}\n{run.output()[-3000:]}")
        assert rc == 0, run.output()[-3000:]
        wait_until(lambda: group_members(run.pgid) == [], 5, "no processes left behind", interval=0.05)


@pytest.mark.parametrize("var", ["PORT", "ADMIN_PORT", "UPSTREAM_PORT"])
def test_run_fails_fast_naming_a_taken_port(var, tmp_path):
    chosen = ports()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", chosen[var]))
        squatter.listen(8)
        start = time.time()
        with RunSh(chosen, tmp_path / "tmp") as run:
            rc = run.finish(timeout=15)
            took = time.time() - start
            out = run.output()
            assert rc != 0, out
            assert took < 5, f"took {took:.1f}s:\n{out}"
            assert f"port {chosen[var]} ({var}:" in out, out
            assert "already in use" in out and f"make run {var}=" in out, out
            assert "running" not in out, out
            assert group_members(run.pgid) == []
            assert run.left_behind() == []


def test_run_reports_an_envoy_that_exits(tmp_path):
    """Another Envoy holds the hot-restart base id run.sh gives the front
    Envoy (its listener port): the front Envoy exits at start, and run.sh
    says so with the Envoy's own words, fast, instead of "running"."""
    chosen = ports()
    admin = free_port()
    cfg = tmp_path / "other.json"
    cfg.write_text(json.dumps(upstream_bootstrap(free_port(), admin)))
    with open(tmp_path / "other.log", "w") as log:
        other = subprocess.Popen([ENVOY, "-c", str(cfg), "--base-id", str(chosen["PORT"]), "--concurrency", "1",
                                  "-l", "warn"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        assert wait_ready(other, f"http://127.0.0.1:{admin}/ready", ENVOY_READY_S, "the other Envoy",
                          lambda: (tmp_path / "other.log").read_text()), "the other Envoy did not become ready"
        start = time.time()
        with RunSh(chosen, tmp_path / "tmp") as run:
            rc = run.finish(timeout=40)
            took = time.time() - start
            out = run.output()
            assert group_members(run.pgid) == []
            assert run.left_behind() == []
        assert rc != 0, out
        assert took < 20, f"took {took:.1f}s"
        assert "sluice is running" not in out
        assert re.search(r"make run: the front Envoy exited \(status [1-9]\d*\) before it was ready", out), out
        tail = out.split("--- last lines of the front Envoy's log:", 1)[1]
        assert "base_id" in tail or "base-id" in tail, out
    finally:
        other.terminate()
        other.wait(10)


def test_run_reports_an_envoy_that_dies_while_running(tmp_path):
    """The front Envoy killed under it (the OOM killer, say): run.sh says
    so, stops the upstream, cleans up and fails."""
    chosen = ports()
    with RunSh(chosen, tmp_path / "tmp") as run:
        run.wait_for(r"Press Ctrl-C", timeout=60)
        front = [pid for pid in group_members(run.pgid)
                 if "envoy.yaml" in proc_file(pid, "cmdline")
                 and "tee" not in proc_file(pid, "comm")]
        assert len(front) == 1, front
        os.kill(front[0], signal.SIGKILL)
        rc = run.finish(timeout=20)
        out = run.output()
        assert rc != 0, out
        assert "make run: the front Envoy exited (status 137)" in out, out
        assert "--- last lines of the front Envoy's log:" in out, out
        assert group_members(run.pgid) == []
        assert run.left_behind() == []
    for var, port in chosen.items():
        assert port_free(port), f"{var} {port} still bound"
