"""The Istio examples cannot rot: every WasmPlugin manifest under
examples/istio/ is read (standard library only: `pluginConfig` is written as
a JSON object, which is also a YAML flow mapping) and its configuration runs
in a real Envoy through the configuration Istio generates for a WasmPlugin:
an ECDS resource named `extensions.istio.io/wasmplugin/<ns>.<name>` holding
an envoy.extensions.filters.http.wasm.v3.Wasm whose PluginConfig has
name `<ns>.<name>`, root_id = pluginName, the pluginConfig as a JSON
StringValue, a V8 vm_config with NO vm_id, the environment variable
ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION, and failure_policy from
failStrategy (istio/istio pilot/pkg/model/extensions.go).
"""

import json
import re
import textwrap
from pathlib import Path

import pytest

import http1
from ecds import WASM_TYPE, EcdsStack, several
from harness import LABELS, METRICS_DUE_S, ROOT, WASM, metric, settle, wait_until
from test_ecds import body_rule

pytestmark = pytest.mark.wasm_only("Istio's WasmPlugin: the wasm build (its delivery emulated over ECDS)")

ISTIO = ROOT / "examples/istio"
MANIFESTS = sorted(p for p in ISTIO.glob("*.yaml") if "kind: WasmPlugin" in p.read_text())
FAILURE_POLICY = {"FAIL_OPEN": "FAIL_OPEN", "FAIL_CLOSE": "FAIL_CLOSED", "FAIL_RELOAD": "FAIL_RELOAD"}
NAMESPACE = "default"


# --- a tiny reader for the few YAML shapes the manifests use -----------------

def _block_after(text, key):
    """Lines indented deeper than `key:` that follow it (the value block)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"^(\s*){re.escape(key)}:(\s*\|)?\s*$", line)
        if m:
            indent = len(m.group(1))
            out = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                out.append(nxt)
            return textwrap.dedent("\n".join(out))
    raise KeyError(key)


def flow_json(text, key):
    """The value of `key:` written as a JSON object on the following lines."""
    return json.loads(_block_after(text, key))


def scalar(text, key):
    m = re.search(rf"^\s*{re.escape(key)}:[ \t]*(\S[^#\n]*?)\s*$", text, re.M)
    if not m:
        raise KeyError(key)
    return m.group(1).strip("\"'")


class Manifest:
    def __init__(self, path):
        self.path = path
        self.text = path.read_text()
        self.name = scalar(self.text, "name")
        self.plugin_name = scalar(self.text, "pluginName")
        self.fail_strategy = scalar(self.text, "failStrategy")
        self.plugin_config = flow_json(self.text, "pluginConfig")
        self.resource = f"extensions.istio.io/wasmplugin/{NAMESPACE}.{self.name}"
        self.resource_version = 0

    def wasm_config(self, configuration, _name=None):
        """What istiod generates (after istio-agent has turned the oci:// URL
        into a local file): note that there is no vm_id."""
        self.resource_version += 1
        return {
            "@type": WASM_TYPE,
            "config": {
                "name": f"{NAMESPACE}.{self.name}",
                "root_id": self.plugin_name,
                "vm_config": {
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(WASM)}},
                    "environment_variables": {
                        "key_values": {"ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": str(self.resource_version)}
                    },
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    # protojson of a Struct: compact JSON.
                    "value": json.dumps(configuration, separators=(",", ":")),
                },
                "failure_policy": FAILURE_POLICY[self.fail_strategy],
            },
        }

    def stack(self, configuration=None, **kw):
        return EcdsStack(self.plugin_config if configuration is None else configuration,
                         resource_name=self.resource, wasm_config=self.wasm_config, **kw)


def ids(p):
    return p.stem


# How to see each shipped plugin refuse (or, in shadow mode, count) a request:
# (path, method, headers, rule, requests that pass). The test fails if a new
# manifest is added without an entry.
PROBES = {
    "per-client": ("/", "GET", {}, "per-client", 10),
    "layered": ("/login", "POST", {"x-api-key": "k1"}, "login-per-client", 5),
    "shadow-rollout": ("/", "GET", {"x-tenant": "t1"}, "per-tenant-trial", 200),
}


def test_there_are_manifests_and_each_has_a_probe():
    assert {p.stem for p in MANIFESTS} == set(PROBES)


@pytest.mark.parametrize("path", MANIFESTS, ids=ids)
def test_manifest_has_the_settings_that_matter(path):
    m = Manifest(path)
    t = m.text
    assert scalar(t, "apiVersion") == "extensions.istio.io/v1alpha1"
    assert scalar(t, "kind") == "WasmPlugin"
    assert scalar(t, "url").startswith("oci://")
    assert scalar(t, "phase") == "AUTHZ"
    assert m.fail_strategy in FAILURE_POLICY
    assert scalar(t, "type") == "HTTP"
    assert re.search(r"^\s*selector:\s*\n\s*matchLabels:\s*\n\s+\S+:", t, re.M)
    assert re.search(r"^\s*match:\s*\n\s*- mode: SERVER\s*$", t, re.M), "limit inbound traffic only"
    # Istio gives every WasmPlugin an empty vm_id, so all of them share one
    # shared-data namespace in a proxy: each needs its own domain.
    assert m.plugin_config.get("domain") == m.name


def test_manifests_use_distinct_domains():
    domains = [Manifest(p).plugin_config["domain"] for p in MANIFESTS]
    assert len(domains) == len(set(domains))


def test_manifests_match_the_plain_envoy_examples():
    def without_domain(c):
        return {k: v for k, v in c.items() if k != "domain"}

    assert without_domain(Manifest(ISTIO / "layered.yaml").plugin_config) == json.loads(
        (ROOT / "examples/layered.json").read_text())
    assert without_domain(Manifest(ISTIO / "shadow-rollout.yaml").plugin_config) == json.loads(
        (ROOT / "examples/shadow-rollout.json").read_text())
    envoy_demo = json.loads(_block_after((ROOT / "envoy/envoy.yaml").read_text(), "value"))
    assert without_domain(Manifest(ISTIO / "per-client.yaml").plugin_config) == envoy_demo


@pytest.mark.parametrize("path", MANIFESTS, ids=ids)
def test_manifest_plugin_config_loads_and_limits_in_envoy(path):
    m = Manifest(path)
    req_path, method, headers, rule, passing = PROBES[path.stem]
    shadow = any(r.get("shadow") for r in m.plugin_config["rate_limits"] if r["name"] == rule)
    with m.stack() as s:
        assert s.ecds_stat("update_success") == 1
        assert "configured" in s.front.logs()
        conn = http1.Conn(s.port)
        try:
            if shadow:
                # Never refused, so the requests can be pipelined: 2 x burst
                # leave faster than the bucket (100/s here) refills.
                rs = conn.send_all([http1.build(req_path, headers, method)] * (2 * passing))
                assert {r.status for r in rs} == {200}
                s.front.wait_stat(metric("sluice_rl_requests_total", m.plugin_config["domain"], rule=rule,
                                         result="shadow_limited"), lambda v: v >= 1)
                return
            statuses = [conn.request(req_path, headers, method).status for _ in range(passing)]
            assert statuses == [200] * passing
            last = conn.request(req_path, headers, method)
        finally:
            conn.close()
        assert (last.status, body_rule(last)) == (429, rule)
        s.front.wait_stat(metric("sluice_rl_requests_total", m.plugin_config["domain"], rule=rule, result="limited"),
                          lambda v: v >= 1)


def test_istio_update_replaces_the_vms_but_keeps_unchanged_rules_state():
    """Every WasmPlugin change bumps ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION,
    so Envoy builds new VMs; shared data is keyed by vm_id ("" here) and
    survives them. Shadow -> enforce keeps the buckets (`shadow` is not part
    of a rule's definition hash)."""
    m = Manifest(ISTIO / "shadow-rollout.yaml")
    rule = {"name": "trial", "key": [{"header": "x-tenant"}], "bucket": {"rate": 1, "period": "1h", "burst": 5}}
    shadow = {"domain": m.name, "rate_limits": [dict(rule, shadow=True)]}
    enforce = {"domain": m.name, "rate_limits": [dict(rule, shadow=False)]}
    t1 = {"x-tenant": "t1"}
    with m.stack(shadow) as s:
        assert [http1.get(s.port, "/", t1).status for _ in range(7)] == [200] * 7
        s.front.wait_stat(metric("sluice_rl_requests_total", m.name, rule="trial", result="shadow_limited"), 2)
        created = s.front.stat("wasm.envoy.wasm.runtime.v8.created")
        s.push(enforce)
        s.wait_stat("update_success", 2)
        # New VMs (a new vm_config hash), main thread and both workers.
        wait_until(lambda: s.front.stat("wasm.envoy.wasm.runtime.v8.created") >= created + 3, 15,
                   "new VMs on the main thread and both workers", interval=0.05)
        wait_until(lambda: http1.get(s.port, "/", {"x-tenant": "t2"}).status == 200, 15,
                   "the enforced rule admitting a new tenant", interval=0.05)
        r = http1.get(s.port, "/", t1)
        assert (r.status, body_rule(r)) == (429, "trial"), "the enforced rule started with fresh buckets"


def test_two_wasmplugins_share_state_unless_their_domains_differ():
    """Two WasmPlugins on one proxy both have an empty vm_id: with the same
    domain, identical rules are one table and both filters charge it."""
    rule = {"name": "r", "bucket": {"rate": 1, "period": "1h", "burst": 4}}

    def run(domain_a, domain_b):
        a, b = Manifest(ISTIO / "per-client.yaml"), Manifest(ISTIO / "layered.yaml")
        configs = {a.resource: {"domain": domain_a, "rate_limits": [rule]},
                   b.resource: {"domain": domain_b, "rate_limits": [rule]}}
        builders = {a.resource: a.wasm_config, b.resource: b.wasm_config}
        with EcdsStack(several(configs), wasm_config=lambda c, name: builders[name](c)) as s:
            return [http1.get(s.port).status for _ in range(5)]

    assert run("same", "same") == [200, 200, 429, 429, 429]  # each request charged twice
    assert run("one", "other") == [200] * 4 + [429]


def test_metrics_reach_prometheus_with_istio_stats_config():
    """Istio's stats_config (use_all_default_tags false, inclusion list)
    with examples/istio/metrics.yaml's proxyStatsMatcher regex and
    extraStatTags, turned into what Istio's bootstrap generates from them:
    sluice_*{domain=...,rule=...} in /stats/prometheus, no bootstrap
    override; without the matcher, nothing."""
    text = (ISTIO / "metrics.yaml").read_text()
    spec = text[text.index("\nspec:"):]
    regexps = re.findall(r'^\s*- "([^"]+)"$', _block_after(spec, "inclusionRegexps"), re.M)
    extra_tags = re.findall(r"^\s*- (\w+)$", _block_after(spec, "extraStatTags"), re.M)
    assert regexps and set(extra_tags) == set(LABELS), (regexps, extra_tags)
    # The plain Envoy demo ships the very regexes extraStatTags generates.
    demo_tags = re.findall(r"- tag_name: (\w+)\n\s+regex: '([^']+)'", (ROOT / "envoy/envoy.yaml").read_text())
    generated = [(t, rf"({t}=\.=(.*?);\.;)") for t in extra_tags]
    assert set(demo_tags) == set(generated), demo_tags
    m = Manifest(ISTIO / "per-client.yaml")

    def istio_stats(with_matcher):
        # The YAML string "wasmcustom\\..*" is the regex wasmcustom\..*
        patterns = [{"prefix": "reporter="}, {"prefix": "component"}, {"prefix": "istio"}]
        if with_matcher:
            patterns += [{"safe_regex": {"regex": r.replace("\\\\", "\\")}} for r in regexps]
        return {
            "use_all_default_tags": False,
            "stats_tags": [{"tag_name": "response_code", "regex": r"_rq(_(\d{3}))$"}]
            + [{"tag_name": t, "regex": r} for t, r in generated],
            "stats_matcher": {"inclusion_list": {"patterns": patterns}},
        }

    domain = m.plugin_config.get("domain", "default")
    for with_matcher in (True, False):
        with m.stack(stats_config=istio_stats(with_matcher)) as s:
            for _ in range(11):
                http1.get(s.port)
            series = f'sluice_rl_requests_total{{domain="{domain}",rule="per-client",result='
            if with_matcher:  # sluice's counters reach Envoy on a tick
                def counted():
                    prom = s.front.admin("/stats/prometheus")
                    return all(re.search("^" + re.escape(series + f'"{result}"}}') + f" {n}$", prom, re.M)
                               for result, n in (("allowed", 10), ("limited", 1)))

                wait_until(counted, METRICS_DUE_S, "10 allowed and 1 limited in /stats/prometheus", interval=0.05)
            else:
                settle()  # a tick's worth: still nothing
            prom = s.front.admin("/stats/prometheus")
        if with_matcher:
            assert re.search("^" + re.escape(series + '"allowed"}') + " 10$", prom, re.M), prom[-3000:]
            assert re.search("^" + re.escape(series + '"limited"}') + " 1$", prom, re.M)
            assert "=.=" not in prom, "a label left in a metric name"
        else:
            assert "sluice_" not in prom
