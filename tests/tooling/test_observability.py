"""The Grafana dashboard and Prometheus alerting rules of observability/:
promtool checks and unit-tests the rules; every metric name the dashboard
and the rules use is one a real Envoy with sluice exports; and a real
Prometheus, scraping a real Envoy driven through every mechanism, returns
data for every dashboard panel and every alert expression.

Needs Debian's prometheus package (`make obs-deps`). Each test runs its own
Prometheus on a free port with temporary storage and stops it."""

import json
import math
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import http1
from harness import ENVOY_READY_S, ROOT, Stack, free_port, settle, stop_child, time_passes, wait_ready, wait_until

# Every worker re-reads the breakers' shared state within 20 ms; no condition
# shows it without a request that would change the breaker's count.
SHARED_STATE_S = 0.1

OBS = ROOT / "observability"
ALERTS = OBS / "alerts.yaml"
ALERTS_TEST = OBS / "alerts.test.yaml"
DASHBOARD = OBS / "dashboard.json"
DOMAIN = "obs"
RATE_INTERVAL = "1m"  # for Grafana's $__rate_interval

FAIL = {"x-envoy-fault-abort-request": "503"}

# A rule with a tiny table (4 slots) that many keys crowd, a breaker watching
# /cb only (open for 2 minutes once tripped), and a queue shedder on /shed
# with one slot.
CONFIG = {
    "domain": DOMAIN,
    "rate_limits": [{"name": "per-key", "match": {"path_prefix": "/rl"}, "key": [{"header": "x-key"}],
                     "bucket": {"rate": 1, "period": "1h", "burst": 2}, "max_keys": 4}],
    "circuit_breakers": [{"name": "backend", "match": {"path_prefix": "/cb"}, "min_requests": 5, "error_rate": 0.5,
                          "open": {"base": "120s", "max": "240s"}}],
    "retry_budgets": [{"name": "storm", "match": {"path_prefix": "/retry"}, "ratio": 0.1, "min_per_second": 1,
                       "window": "10s"}],
    "deadlines": {"min_remaining": "10ms"},
    "concurrency_limits": [{"name": "exports", "match": {"path_prefix": "/export"}, "key": [{"header": "x-tenant"}],
                            "max": 1, "max_keys": 16}],
    "shedders": [{"name": "q", "match": {"path_prefix": "/shed"}, "priority": {"header": "x-priority"},
                  "concurrency": {"max": 1, "queue": 16, "max_wait": "150ms"}, "target": "5ms", "interval": "100ms"}],
}

# Alerts whose condition traffic cannot produce: shared-data failures are
# host errors or exhausted CAS retries, which a test cannot cause on
# demand. For these the expression's measured side (before the final
# comparison) must return data; alerts.test.yaml shows them firing.
UNDRIVEN = {"SluiceRateLimitStoreFailures", "SluiceBreakerStoreFailures"}

# Panel queries the traffic below leaves at 0 (every other one must show a
# value above 0): shadow rules, CAS conflicts and stale reads (chance), store
# failures and corrupt slots (see UNDRIVEN), probes (the breaker stays
# open), and the gauges of a shedder or bulkhead that has gone idle.
MAY_BE_ZERO = {
    ("Refusal ratio per rule", "B"),
    ("Bulkhead places held", "A"),
    ("Bulkhead places held", "B"),
    ("Bulkhead places held", "C"),
    ("Store failures and corrupt state", "D"),
    ("Collisions and CAS retries", "B"),
    ("Store failures and corrupt state", "A"),
    ("Store failures and corrupt state", "B"),
    ("Store failures and corrupt state", "C"),
    ("Fast-failed requests and probes", "B"),
    ("Fast-failed requests and probes", "C"),
    ("In flight and queued", "A"),
    ("In flight and queued", "B"),
    ("Overloaded workers", "A"),
    ("Store reads skipped", "B"),
}


def alert_rules():
    """[(alert name, expr)] from alerts.yaml (no YAML library in the venv: the
    file's own layout, `- alert:` then `expr:`, one line or a block; the
    end-to-end test checks the result against what Prometheus loaded)."""
    rules = []
    lines = ALERTS.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*- alert: (\S+)", line)
        if not m:
            continue
        e = re.match(r"(\s*)expr: ?(.*)", lines[i + 1])
        assert e, f"expr must follow alert {m.group(1)}"
        if e.group(2).strip() in ("|", ">", "|-", ">-"):
            body, j = [], i + 2
            indent = len(e.group(1))
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                body.append(lines[j].strip())
                j += 1
            expr = "\n".join(body).strip()
        else:
            expr = e.group(2).strip()
        rules.append((m.group(1), expr))
    return rules


def dashboard():
    return json.loads(DASHBOARD.read_text())


def panel_targets():
    """[(panel title, refId, expr)] of every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p["title"], t["refId"], t["expr"]))
    walk(dashboard()["panels"])
    return out


def substitute(expr, domain=".*"):
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("${domain}", domain)
            .replace("$domain", domain))


KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless", "inf", "nan"}


def metric_names(expr):
    """The metric names a PromQL expression selects: identifiers that are not
    functions, aggregation modifiers or keywords, outside label matchers,
    label lists, ranges and strings."""
    e = re.sub(r'"(\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        if word.lower() in KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue
        if re.fullmatch(r"\d+(\.\d+)?(e\d+)?", word):
            continue
        names.add(word)
    return names


def exported_names(text):
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def promtool(*args):
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: make obs-deps (Debian's prometheus package)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=OBS)


def test_metric_name_parser():
    assert metric_names('sum by (domain, rule) (rate(a_total{result=~"x|y"}[5m])) / b > 0.5') == {"a_total", "b"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))") == {"h_bucket"}
    assert metric_names("x > 0 and on (domain) y") == {"x", "y"}


def test_promtool_checks_the_rules():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_promtool_unit_tests_pass_and_cover_every_alert():
    r = promtool("test", "rules", str(ALERTS_TEST))
    assert r.returncode == 0, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\S+)", ALERTS_TEST.read_text()))
    assert tested == {name for name, _ in alert_rules()}
    # Each alert is shown firing (a non-empty exp_alerts) and not firing.
    text = ALERTS_TEST.read_text()
    for name in tested:
        cases = re.findall(rf"alertname: {name}\n\s*exp_alerts:(.*?)(?=\n\s*- eval_time|\n- interval|\Z)", text, re.S)
        assert any(c.strip() == "[]" for c in cases), f"{name}: no case where it does not fire"
        assert any("exp_labels" in c for c in cases), f"{name}: no case where it fires"


def test_the_dashboard_is_a_grafana_model_with_a_datasource_and_domain_variable():
    d = dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["domain"]["type"] == "query" and variables["domain"]["allValue"] == ".*"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":  # a row only groups the panels under it
            assert not p.get("panels"), "keep rows expanded: panels at the top level"
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p.get("targets"), f"panel {p['title']!r} has no targets"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            if "sluice_store_" not in t["expr"]:  # the store layer has no domain
                assert 'domain=~"$domain"' in t["expr"], (p["title"], t["expr"])


def test_every_metric_the_dashboard_and_alerts_use_is_one_sluice_exports():
    with Stack(CONFIG) as s:
        exported = exported_names(s.front.admin("/stats/prometheus"))
    sluice = {n for n in exported if n.startswith("sluice_")}
    assert "sluice_shed_queue_ms_bucket" in sluice and "sluice_rl_requests_total" in sluice
    exprs = [(f"panel {t!r} {ref}", e) for t, ref, e in panel_targets()] + [(f"alert {a}", e) for a, e in alert_rules()]
    used = set()
    for where, e in exprs:
        names = metric_names(e)
        assert names, f"{where}: no metric in {e!r}"
        assert names <= sluice, f"{where}: {sorted(names - sluice)} not exported by sluice"
        used |= names
    # And the dashboard shows every metric sluice has.
    dash_used = set().union(*(metric_names(e) for _, _, e in panel_targets()))
    assert dash_used == sluice, f"not on the dashboard: {sorted(sluice - dash_used)}"


class Prometheus:
    """Debian's prometheus on a free port, scraping `targets` every second
    with alerts.yaml loaded; temporary storage; stopped on exit."""

    def __init__(self, targets):
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="sluice-prom-")
        d = Path(self.dir.name)
        self.config = d / "prometheus.yml"
        self.config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "sluice", "metrics_path": "/stats/prometheus",
                                "static_configs": [{"targets": targets}]}],
        }))
        self.log_path = d / "prometheus.log"
        self.proc = None

    def __enter__(self):
        exe = shutil.which("prometheus")
        assert exe, "prometheus is missing: make obs-deps (Debian's prometheus package)"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.config}", f"--storage.tsdb.path={Path(self.dir.name) / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if wait_ready(self.proc, f"http://127.0.0.1:{self.port}/-/ready", ENVOY_READY_S, "prometheus", self.logs):
            return self
        self.__exit__()
        raise RuntimeError("prometheus did not become ready")

    def __exit__(self, *exc):
        stop_child(self.proc, 10)
        self.log.close()
        self.dir.cleanup()

    def logs(self):
        return self.log_path.read_text(errors="replace")

    def api(self, path, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query: 400 with the error
            body = json.loads(e.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr, deadline, positive=False):
        """The query's result once a series has a number (not NaN: Envoy
        merges histograms for /stats/prometheus on its stats flush, every
        5 s), or one above zero if `positive` (the last traffic may not be
        scraped yet), or the last result once time.time() passes `deadline`."""
        got = []

        def has_data():
            got.append(self.query(expr))
            values = [float(r["value"][1]) for r in got[-1]]
            return any(v > 0 if positive else math.isfinite(v) for v in values)

        try:
            wait_until(has_data, max(0.0, deadline - time.time()), expr, interval=0.25)
        except AssertionError:
            pass  # the caller tells what is missing
        return got[-1]


def measured_side(expr):
    """An alert expression without its final comparison against a number."""
    m = re.fullmatch(r"(.*?)\s*(>|<|>=|<=|==|!=)\s*[0-9.]+\s*", expr, re.S)
    assert m, expr
    return m.group(1)


def drive(port):
    """Traffic through every mechanism; returns what the client saw."""
    seen = {}
    # A rate-limit rule refusing most requests, its 4-slot table crowded by 12
    # keys: 5 requests per key on 12 connections at once.
    got = http1.burst(port, [[http1.build("/rl", {"x-key": f"k{i}"})] * 5 for i in range(12)])
    seen["rl"] = [r.status for b in got for r in b]
    # A breaker tripped: 6 failures of 6 requests, then fast-failed requests.
    c = http1.Conn(port)
    seen["cb_trip"] = [c.request("/cb", FAIL).status for _ in range(6)]
    c.close()
    settle(SHARED_STATE_S)
    seen["cb_open"] = [http1.get(port, "/cb").header("x-sluice-circuit") for _ in range(5)]
    # A queue shedder with one slot and 150 ms max_wait, upstream 100 ms per
    # request: 12 requests at once, 4 of each priority, in 5 rounds. Some
    # wait and are admitted, the rest are shed (critical ones at max_wait).
    classes = ["sheddable", "default", "critical"]
    shed = []
    for _ in range(5):
        batches = [[http1.build("/shed", {"x-priority": classes[i % 3], "x-envoy-fault-delay-request": "100"})]
                   for i in range(12)]
        shed += [r.header("x-sluice-shed") or r.status for b in http1.burst(port, batches) for r in b]
        time_passes(0.2)  # rounds 200 ms apart
    seen["shed"] = shed
    # A retry storm against a budget of 10% of first tries (plus 1 per
    # second): some retries admitted, most refused.
    c = http1.Conn(port)
    for _ in range(20):
        c.request("/retry")
    seen["retry"] = [c.request("/retry", {"x-envoy-attempt-count": "2"}).status for _ in range(30)]
    # Requests whose caller has (almost) given up.
    seen["deadline"] = [c.request("/", {"grpc-timeout": "2m"}).status for _ in range(3)]
    c.close()
    # A tenant with one export in flight asking for more: refused.
    slow = http1.build("/export", {"x-tenant": "t1", "x-envoy-fault-delay-request": "300"})
    seen["bulkhead"] = [r.status for b in http1.burst(port, [[slow] for _ in range(4)]) for r in b]
    return seen


@pytest.mark.slow
def test_prometheus_returns_data_for_every_panel_and_alert_against_a_real_envoy():
    started = time.time()
    panels = panel_targets()
    alerts = alert_rules()
    with Stack(CONFIG) as s, Prometheus([f"127.0.0.1:{s.front.admin_port}"]) as prom:
        # Every sluice metric is defined at configuration: scrape zeros first,
        # so the traffic below shows as an increase.
        assert prom.wait_for(f'sluice_rl_requests_total{{domain="{DOMAIN}"}}', time.time() + 20), prom.logs()[-3000:]
        def scrapes():
            got = prom.query(f'min(count_over_time(sluice_rl_requests_total{{domain="{DOMAIN}"}}[1m]))')
            return int(float(got[0]["value"][1])) if got else 0

        first = scrapes()
        wait_until(lambda: scrapes() >= first + 2, 20, "two more scrapes of the zeros", interval=0.25)
        seen = drive(s.port)
        print("client saw", {k: (sorted(set(map(str, v))), len(v)) for k, v in seen.items()})
        assert seen["rl"].count(429) > len(seen["rl"]) / 2, seen["rl"]
        assert seen["cb_open"] == ["open"] * 5, seen
        assert {"sheddable", "default", "critical"} <= set(seen["shed"]), seen["shed"]
        assert 200 in seen["shed"], seen["shed"]
        assert 200 in seen["retry"] and 429 in seen["retry"], seen["retry"]
        assert seen["deadline"] == [504] * 3, seen["deadline"]
        assert sorted(seen["bulkhead"]) == [200, 429, 429, 429], seen["bulkhead"]

        assert MAY_BE_ZERO <= {(t, r) for t, r, _ in panels}
        empty = []
        deadline = time.time() + 30  # for all queries together: a broken setup fails in bounded time
        for title, ref, expr in panels:
            for domain in (".*", DOMAIN):
                got = prom.wait_for(substitute(expr, domain), deadline, positive=(title, ref) not in MAY_BE_ZERO)
                if not got:
                    empty.append(f"panel {title!r} {ref} (domain {domain}): {substitute(expr, domain)}")
                elif not any(math.isfinite(float(r["value"][1])) for r in got):
                    empty.append(f"panel {title!r} {ref}: only NaN/Inf: {got}")
                elif (title, ref) not in MAY_BE_ZERO and not any(float(r["value"][1]) > 0 for r in got):
                    empty.append(f"panel {title!r} {ref}: only zeros after traffic: {got}")
        for name, expr in alerts:
            e = measured_side(expr) if name in UNDRIVEN else expr
            if not prom.wait_for(e, deadline):
                empty.append(f"alert {name}: {e}")
        assert not empty, "no data:\n" + "\n".join(empty)

        # Prometheus evaluates the loaded rules without errors, and every
        # alert traffic could drive is pending (their `for:` is minutes).
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert {r["name"] for r in rules} == {n for n, _ in alerts}
        loaded = {r["name"]: r["query"] for r in rules}
        for name, expr in alerts:  # what this file parsed is what Prometheus runs
            assert " ".join(loaded[name].split()) == " ".join(expr.split()), (name, loaded[name])
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        driven = {n for n, _ in alerts} - UNDRIVEN
        states = {}

        def all_pending():
            states.clear()
            states.update({a["labels"]["alertname"]: a["state"] for a in prom.api("alerts")["alerts"]})
            return driven <= set(states)

        wait_until(all_pending, 10, lambda: f"not pending: {sorted(driven - set(states))}", interval=0.5)
        assert all(states[n] == "pending" for n in driven), states
        assert not UNDRIVEN & set(states), states
    print(f"test took {time.time() - started:.1f} s")
    assert time.time() - started < 90
