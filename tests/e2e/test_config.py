"""Bad configurations are refused by a real Envoy with a log line naming
the field and the problem; good ones, and every shipped Envoy config, load."""

import subprocess
from pathlib import Path

import pytest

from ecds import EcdsStack
from harness import CONFIG_APPLIED_S, ENVOY, ROOT, next_base_id, validate, wait_until

BUCKET = '"bucket":{"rate":1,"period":"1s"}'

BAD = [
    ('{"rate_limits":[{"name":"a",' + BUCKET + ',"burts":3}]}', "rate_limits[0].burts: unknown field `burts`"),
    ('{"rate_limits":[{"name":"a","bucket":{"rate":0,"period":"1s"}}]}', "rate_limits[0].bucket.rate: must be greater than 0"),
    ('{"rate_limits":[{"name":"a","bucket":{"rate":-3,"period":"1s"}}]}', "rate_limits[0].bucket.rate: must be greater than 0, got -3"),
    ('{"rate_limits":[{"name":"","bucket":{"rate":1,"period":"1s"}}]}', "rate_limits[0].name: must not be empty"),
    ('{"rate_limits":[{"name":"a",' + BUCKET + '},{"name":"a",' + BUCKET + '}]}', "rate_limits[1].name: duplicate rule name `a`"),
    ('{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"fortnight"}}]}', "rate_limits[0].bucket.period: `fortnight`"),
    ('{"rate_limits":[{"name":"a",' + BUCKET + ',"max_keys":0}]}', "rate_limits[0].max_keys: must be greater than 0"),
    ("not json", "invalid configuration: the configuration must be a JSON object"),
    ('{"retry_budgets":[{"name":"r","ratio":20}]}', "retry_budgets[0].ratio: must be between 0 and 10"),
    ('{"concurrency_limits":[{"name":"c","max":2,"max_wait":"soon"}]}', "concurrency_limits[0].max_wait: `soon`"),
    ('{"concurrency_limits":[{"name":"c","max":2,"max_wait":"1s","queue":1000000}]}',
     "concurrency_limits[0].queue: must be at most 100000"),
    # Strict: nothing after the object, and an object wherever the docs say one.
    ('{"rate_limits":[{"name":"a",' + BUCKET + '}]} trailing', "unexpected data after the configuration object"),
    ('{"rate_limits":[]}{"rate_limits":[{"name":"a",' + BUCKET + '}]}', "unexpected data after the configuration object"),
    ('{"response":[429]}', "invalid configuration: response: invalid type: sequence, expected a JSON object"),
    ('{"rate_limits":[{"name":"a","bucket":[3,"2s",4]}]}', "rate_limits[0].bucket: invalid type: sequence, expected a JSON object"),
    ('{"rate_limits":[["a",null,[],"skip",{"rate":1,"period":"1s"}]]}', "rate_limits[0]: invalid type: sequence, expected a JSON object"),
    # Sliding windows and shaping.
    ('{"rate_limits":[{"name":"a","algorithm":"sliding_window"}]}', "rate_limits[0].window: missing field `window`"),
    ('{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"100ms"}}]}',
     "rate_limits[0].window.period: must be at least 1s"),
    ('{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"1m"},'
     '"on_limit":"delay","max_delay":"1s"}]}', "rate_limits[0].on_limit: delay (shaping) needs algorithm token_bucket"),
    ('{"rate_limits":[{"name":"a",' + BUCKET + ',"on_limit":"delay"}]}', "rate_limits[0].max_delay: is required with on_limit: delay"),
    ('{"rate_limits":[{"name":"a",' + BUCKET + ',"on_limit":"delay","max_delay":"1s","shadow":true}]}',
     "rate_limits[0].shadow: cannot be combined with on_limit: delay"),
    ('{"rate_limits":[{"name":"a",' + BUCKET + ',"on_limit":"delay","max_delay":"1s","max_delayed":-1}]}',
     "rate_limits[0].max_delayed: must be between 1 and 100000, got -1"),
    # Global rules: the service's cluster, its protocol, the backstop's share.
    ('{"rate_limits":[{"name":"a","key":["client_address"],' + BUCKET + ',"cost":{"header":"x-cost"},'
     '"global":{"cluster":"rls","instances":2}}]}',
     "rate_limits[0].cost.max: is required for a global rule whose cost comes from a header"),
    ('{"rate_limits":[{"name":"a","key":["client_address"],' + BUCKET + ',"global":{"instances":2}}]}',
     "rate_limits[0].global.cluster: missing: the Envoy cluster of the rate-limit service"),
    ('{"rate_limits":[{"name":"a","key":["client_address"],' + BUCKET + ',"global":{"cluster":"rls","protocol":"http","instances":2}}]}',
     'rate_limits[0].global.protocol: unknown protocol "http"'),
    ('{"rate_limits":[{"name":"a","key":["client_address"],' + BUCKET + ',"global":{"cluster":"rls","instances":0}}]}',
     "rate_limits[0].global.instances: must be between 1 and 100000, got 0"),
]


GOOD = {"rate_limits": [{"name": "a", "key": ["client_address"], "bucket": {"rate": 5, "period": "1s"}}]}


class Updates:
    """One Envoy whose sluice filter comes from ECDS, taking one
    configuration after another: a refused update leaves the last good one
    in place, so each case is checked against the same running Envoy (a
    start per case costs the module's compilation)."""

    def __init__(self, stack):
        self.s = stack

    def push(self, config):
        """Pushes `config`; returns (accepted, the front Envoy's log from the push on)."""
        offset = len(self.s.front.logs())
        counts = (self.s.ecds_stat("update_success"), self.s.ecds_stat("update_rejected"))
        self.s.push(config)
        now = []

        def answered():
            now[:] = [self.s.ecds_stat("update_success"), self.s.ecds_stat("update_rejected")]
            return tuple(now) != counts

        wait_until(answered, CONFIG_APPLIED_S, lambda: f"the update applied or rejected (counts {counts} -> {now})")
        assert now[0] - counts[0] + now[1] - counts[1] == 1, (counts, now)
        return now[0] > counts[0], self.s.front.logs()[offset:]

    def refused(self, config, message):
        offset = len(self.s.front.logs())
        ok, out = self.push(config)
        assert not ok, out[-2000:]
        since = lambda: self.s.front.logs()[offset:]  # noqa: E731
        # The log line may land just after the count.
        wait_until(lambda: message in since(), 2, lambda: f"{message!r} in the log:\n{since()[-3000:]}")
        assert "panicked" not in since()


@pytest.fixture(scope="module")
def updates():
    with EcdsStack(GOOD) as s:
        yield Updates(s)


@pytest.mark.parametrize("config,message", BAD)
def test_bad_configuration_is_refused_with_field_and_problem(updates, config, message):
    updates.refused(config, message)


def test_bad_configuration_at_start_is_refused_with_field_and_problem():
    """The same check when Envoy starts (`--mode validate` runs the VM and
    the configuration as a start does): Envoy refuses to start."""
    for config, message in (BAD[0], BAD[7]):
        ok, out = validate(config)
        assert not ok, out[-2000:]
        assert message in out, out[-3000:]
        assert "panicked" not in out


def test_good_configuration_is_accepted(updates):
    ok, out = updates.push(dict(GOOD, retry_budgets=[{"name": "r", "ratio": 0.2}]))
    assert ok, out[-3000:]
    ok, out = validate(GOOD)
    assert ok, out[-3000:]
    assert "configured 1 rate-limit rule(s)" in out


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in (ROOT / "envoy").glob("*.yaml")))
def test_shipped_envoy_configs_validate(path):
    p = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path), "--base-id", str(next_base_id())],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.json")), ids=lambda p: p.name)
def test_example_plugin_configs_load(path):
    ok, out = validate(path.read_text())
    assert ok, out[-3000:]


@pytest.mark.wasm_only("the wasm module's exports (test_native.py checks the native build's imports)")
def test_the_built_module_exports_no_unused_callbacks():
    """make build strips the callbacks sluice does not use (Envoy then skips
    those trips into the VM); the module must still export the ones it does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("strip_exports", ROOT / "scripts/strip_exports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = (ROOT / "target/wasm32-wasip1/release/sluice.wasm").read_bytes()
    _, removed = mod.strip(data)
    assert removed == []
    for needed in (b"proxy_on_request_headers", b"proxy_on_response_headers", b"proxy_on_delete",
                   b"proxy_on_tick", b"proxy_on_configure", b"proxy_abi_version_0_2_1"):
        assert needed in data


def test_documented_ranges_are_the_real_ones(updates):
    # Any rate up to 4,294,967,295 with any period; protobuf-style durations.
    for bucket in ({"rate": 4294967295, "period": "1s"}, {"rate": 4294967295, "period": "1ms"},
                   {"rate": 10, "period": "0.25s", "burst": 3}, {"rate": 1, "period": "1.5m"}):
        ok, out = updates.push({"rate_limits": [{"name": "a", "bucket": bucket}]})
        assert ok, (bucket, out[-2000:])
    updates.refused({"rate_limits": [{"name": "a", "bucket": {"rate": 1, "period": "1h", "burst": 2000000}}]},
                    "rate_limits[0].bucket: burst x period / rate (the time to refill a full bucket) must be at most 146 years")


def test_a_cost_of_twenty_digits_is_clamped_to_the_maximum():
    from harness import Stack
    import http1
    cfg = {"rate_limits": [{"name": "c", "bucket": {"rate": 1, "period": "1h", "burst": 5},
                            "cost": {"header": "x-cost", "max": 5}}]}
    with Stack(cfg) as s:
        c = http1.Conn(s.port)
        assert c.request("/", {"x-cost": "99999999999999999999"}).status == 200  # costs 5, the max
        assert c.request("/", {"x-cost": "1"}).status == 429
