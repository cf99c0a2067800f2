"""`make run-fleet` (scripts/run_fleet.py) as a person meets it: two
Envoys sharing one global limit of 20 requests a minute per client
address; the loop of curls it prints, alternating between the two ports,
gets at most 20 successes in total and 429s from both; Ctrl-C stops
everything and frees the ports."""

import signal
import subprocess
import sys
import threading

import http1
from harness import ENVOY, ROOT, free_port, port_free, time_passes, wait_until
from rls import wait_out_window_edge
from test_run import RunSh, group_members


class RunFleet(RunSh):
    """scripts/run_fleet.py in its own process group, its output collected."""

    def __init__(self, chosen, tmpdir):
        super().__init__({}, tmpdir)
        self.chosen = chosen
        self.env["ENVOY_BIN"] = str(ENVOY)

    def __enter__(self):
        args = [sys.executable, str(ROOT / "scripts/run_fleet.py")]
        for opt, var in [("--port", "PORT"), ("--port2", "PORT2"), ("--admin-port", "ADMIN_PORT"),
                         ("--admin-port2", "ADMIN_PORT2"), ("--upstream-port", "UPSTREAM_PORT"),
                         ("--upstream-admin-port", "UPSTREAM_ADMIN_PORT")]:
            args += [opt, str(self.chosen[var])]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.pgid = self.proc.pid
        threading.Thread(target=self._read, daemon=True).start()
        return self


def test_run_fleet_shares_one_limit_across_two_envoys_and_stops_on_ctrl_c(tmp_path):
    names = ["PORT", "PORT2", "ADMIN_PORT", "ADMIN_PORT2", "UPSTREAM_PORT", "UPSTREAM_ADMIN_PORT"]
    chosen = {}
    while len(set(chosen.values())) < len(names):
        chosen = {n: free_port() for n in names}
    with RunFleet(chosen, tmp_path / "tmp") as run:
        run.wait_for(r"sluice fleet is running", timeout=120)
        run.wait_for(r"Press Ctrl-C", timeout=10)
        p1, p2 = chosen["PORT"], chosen["PORT2"]
        wait_out_window_edge(60, 10)
        got = []
        for i in range(1, 31):  # the printed loop: 30 requests, alternating
            port = p1 if i % 2 else p2
            got.append((port, http1.get(port, "/").status))
            time_passes(0.05)  # the printed loop's pace
        ok = [p for p, s in got if s == 200]
        refused = {p for p, s in got if s == 429}
        assert set(s for _, s in got) <= {200, 429}, got
        assert 1 <= len(ok) <= 20, got
        assert refused == {p1, p2}, got
        pids = group_members(run.pgid)
        assert len(pids) >= 5, pids  # the script, redis, the service, three Envoys
        run.proc.send_signal(signal.SIGINT)
        assert run.finish(60) == 0, run.output()[-3000:]
        assert "stopped" in run.output()
        wait_until(lambda: not group_members(run.pgid), 10, lambda: f"processes left behind: {group_members(run.pgid)}",
                   interval=0.1)
        assert all(port_free(chosen[n]) for n in names)
