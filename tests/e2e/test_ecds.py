"""Live reconfiguration through ECDS, as Istio delivers a WasmPlugin: the
sluice filter's configuration comes from an extension-config discovery file
that the test rewrites atomically, while a background thread keeps sending
requests. Real Envoy 1.40, 2 workers.

Observed behaviour of Envoy 1.40 (see docs/deploy.md):
- a good update is applied within a few tens of milliseconds of the rename
  (`extension_config_discovery.http_filter.<name>.update_success` + 1);
- a bad one makes sluice's `on_configure` return false in the main-thread
  VM (the native build's `config_new` return none); Envoy then logs
  "Unable to create Wasm plugin <name>" ("Failed to initialize dynamic
  module"), counts `update_rejected` and `config_fail`, keeps the
  `version` of the last good update, and keeps serving with the old
  configuration, whatever the wasm plugin's failure_policy;
- but with no earlier good configuration (a proxy starting with a bad one),
  Envoy becomes ready anyway and answers 500 on that listener until a good
  configuration arrives.
"""

import contextlib
import json
import shutil
import threading
import time

import pytest

import http1
from ecds import EcdsStack, Load, host_config, plugin_config
from harness import (HOST, NATIVE, SlowUpstream, assert_burst_within_limit, metric, native_filter, settle, time_passes,
                     wait_until)

# What Envoy 1.40 logs when it rejects an update the filter refused, by host.
REJECTED = {"wasm": "Filesystem config update rejected: Unable to create Wasm plugin sluice",
            "native": "Filesystem config update rejected: Failed to create filter config: "
                      "Failed to initialize dynamic module"}
FAIL_OPEN_IS_WASM = pytest.mark.wasm_only("failure_policy is the wasm filter's")


def filter_config(failure_policy):
    """The filter's config with this wasm failure_policy (none: the host's
    default config)."""
    if failure_policy is None:
        return lambda c, _name: host_config(c)
    return lambda c, _name: plugin_config(c, failure_policy=failure_policy)

UPDATE_TIMEOUT = 15  # seconds; an update lands in well under one on an idle machine


def body_rule(r):
    return json.loads(r.body)["rule"] if r.status == 429 else None


def spend(port, path, headers, n):
    """Sends n requests one by one; returns their statuses."""
    return [http1.get(port, path, headers).status for _ in range(n)]


def test_new_limits_take_effect_promptly_under_load():
    loose = {"rate_limits": [{"name": "all", "bucket": {"rate": 1, "period": "1h", "burst": 100000}}]}
    tight = {"rate_limits": [{"name": "all", "bucket": {"rate": 1, "period": "1h", "burst": 3}}]}
    with EcdsStack(loose) as s, Load(s.port, max_seconds=40) as load:
        load.wait_count(30)
        assert {r[1] for r in load.results} == {200}, load.results[:20]
        t0 = time.time()
        s.push(tight)
        first_429 = load.wait_for(lambda r: r[1] == 429, since=t0, timeout=UPDATE_TIMEOUT,
                                  what=lambda: f"a 429 after the update:\n{s.front.logs()[-3000:]}")
        latency = first_429[0] - t0
        s.wait_stat("update_success", 2)
        # A changed rule starts with a fresh bucket of 3 (its table id hashes
        # its definition): once the load has spent it, everything is refused.
        # Half a second of the load to see that no request passes any more.
        settle(0.5)
        after = load.since(first_429[0])
        assert len(after) >= 10 and {(r[1], r[2]) for r in after} == {(429, "all")}, after[:20]
        assert not load.unexpected({(200, None), (429, "all")}), load.unexpected({(200, None), (429, "all")})[:5]
        print(f"first 429 {latency * 1000:.0f} ms after the update was renamed into place")
        # Prompt: generous for a loaded 2-core machine; about 0.1 s when idle.
        assert latency < 5, latency


def test_unchanged_rules_keep_their_state_when_others_change():
    rule_a = {"name": "per-client", "match": {"path_prefix": "/a"}, "key": [{"header": "x-client"}],
              "bucket": {"rate": 1, "period": "1h", "burst": 5}}
    rule_b = {"name": "b", "match": {"path_prefix": "/b"}, "bucket": {"rate": 1, "period": "1h", "burst": 50}}
    rule_c = {"name": "c", "match": {"path_prefix": "/c"}, "bucket": {"rate": 1, "period": "1h", "burst": 1}}
    spender = {"x-client": "spender"}
    with EcdsStack({"rate_limits": [rule_a, rule_b]}) as s, Load(s.port, path="/load", max_seconds=60) as load:
        assert spend(s.port, "/a", spender, 6) == [200] * 5 + [429]

        # B changed, C added, A untouched (same definition, same place).
        rule_b2 = dict(rule_b, bucket={"rate": 1, "period": "1h", "burst": 2})
        s.push({"rate_limits": [rule_a, rule_b2, rule_c]})
        s.wait_stat("update_success", 2)
        # The new configuration serves on every worker once rule c refuses
        # (fresh connections land on either worker; it has a burst of 1).
        wait_until(lambda: [body_rule(http1.get(s.port, "/c")) for _ in range(4)].count("c") >= 3, UPDATE_TIMEOUT,
                   lambda: f"rule c refusing on every worker:\n{s.front.logs()[-3000:]}")
        r = http1.get(s.port, "/a", spender)
        assert (r.status, body_rule(r)) == (429, "per-client"), "an unrelated change refilled rule A"
        assert spend(s.port, "/a", {"x-client": "fresh"}, 1) == [200]

        # Control: changing A itself does start it afresh.
        rule_a2 = dict(rule_a, bucket={"rate": 1, "period": "1h", "burst": 6})
        s.push({"rate_limits": [rule_a2, rule_b2, rule_c]})
        s.wait_stat("update_success", 3)
        wait_until(lambda: http1.get(s.port, "/a", spender).status == 200, UPDATE_TIMEOUT,
                   "changed rule A starting afresh (it kept its old state)")

        load.wait_count(50)
        unexpected = load.unexpected({(200, None)})
        assert not unexpected, unexpected[:5]


@pytest.mark.parametrize("failure_policy", [None, pytest.param("FAIL_OPEN", marks=FAIL_OPEN_IS_WASM)],
                         ids=["default-fail-closed", "fail-open"])
def test_bad_configuration_is_refused_and_the_old_one_keeps_serving(failure_policy):
    good = {"rate_limits": [
        {"name": "load", "match": {"path_prefix": "/load"}, "bucket": {"rate": 20, "period": "1s", "burst": 20}},
        {"name": "a", "match": {"path_prefix": "/a"}, "bucket": {"rate": 1, "period": "1h", "burst": 3}},
    ]}
    # Would lift both limits if it were applied; `rate: 0` makes it invalid.
    bad = {"rate_limits": [
        {"name": "load", "match": {"path_prefix": "/load"}, "bucket": {"rate": 100000, "period": "1s"}},
        {"name": "a", "match": {"path_prefix": "/a"}, "bucket": {"rate": 0, "period": "1s", "burst": 1000}},
    ]}
    allowed = {(200, None), (429, "load")}

    with EcdsStack(good, wasm_config=filter_config(failure_policy)) as s, \
            Load(s.port, path="/load", max_seconds=60, pause=0.001) as load:
        assert spend(s.port, "/a", {}, 3) == [200] * 3
        load.wait_for(lambda r: r[1] == 429, since=0, timeout=20, what="the load reaching its limit")
        version = s.ecds_stat("version")
        assert s.ecds_stat("update_success") == 1

        t0 = time.time()
        s.push(bad)
        s.wait_stat("update_rejected", 1)
        assert s.ecds_stat("config_fail") == 1
        assert s.ecds_stat("update_success") == 1
        assert s.ecds_stat("version") == version  # still the last good one
        settle(1.0)  # keep the load running a while after the rejection: nothing changes
        during = load.since(t0)
        assert len(during) >= 20, "the load stalled during the update"
        unexpected = load.unexpected(allowed)
        assert not unexpected, unexpected[:5]
        assert {(r[1], r[2]) for r in during} == allowed, "the old limit on /load stopped applying"

        # The old limits still apply, state included: /a spent its 3.
        r = http1.get(s.port, "/a")
        assert (r.status, body_rule(r)) == (429, "a")

        logs = s.front.logs()
        assert "invalid configuration: rate_limits[1].bucket.rate: must be greater than 0, got 0" in logs
        assert REJECTED[HOST] in logs

        # The subscription still takes the next good configuration.
        s.push({"rate_limits": [dict(good["rate_limits"][1], bucket={"rate": 1, "period": "1h", "burst": 50})]})
        s.wait_stat("update_success", 2)
        wait_until(lambda: http1.get(s.port, "/a").status == 200, UPDATE_TIMEOUT, "the next good configuration serving")
        unexpected = load.unexpected(allowed)
        assert not unexpected, unexpected[:5]


def test_bad_first_configuration_leaves_the_filter_missing_500_until_a_good_one():
    """With no earlier good configuration to keep, a rejected one leaves the
    ECDS filter without config: Envoy 1.40 still becomes ready and answers
    every request on that listener with an empty 500, whatever the wasm
    plugin's failure_policy (FAIL_OPEN here), until a good configuration
    arrives."""
    bad = {"rate_limits": [{"name": "a", "bucket": {"rate": 0, "period": "1s"}}]}

    with EcdsStack(bad, wasm_config=filter_config("FAIL_OPEN" if HOST == "wasm" else None)) as s:
        assert s.ecds_stat("update_rejected") == 1
        assert s.ecds_stat("update_success") == 0
        assert [http1.get(s.port).status for _ in range(3)] == [500] * 3
        s.push({"rate_limits": [{"name": "a", "bucket": {"rate": 1, "period": "1h", "burst": 1}}]})
        s.wait_stat("update_success", 1)
        wait_until(lambda: http1.get(s.port).status == 429, UPDATE_TIMEOUT, "the good configuration limiting")


def test_a_replaced_configuration_gives_its_leased_shedder_slots_back():
    """Updates that keep the same shedder must not leak the concurrency
    slots the old configuration's workers had leased (see Slot leases in
    the README): five updates under steady load, then a burst still gets
    the whole limit. (Leases go back on every tick, and a configuration
    that goes away returns what it still holds; on Envoy 1.40 the ticks
    alone already returned them in this test.)"""
    shedder = {"name": "wide", "concurrency": {"max": 64, "queue": 0}}

    def config(i):
        # The rule's name changes the configuration; the shedder (and so its
        # shared counter) stays the same.
        return {"shedders": [shedder],
                "rate_limits": [{"name": f"v{i}", "bucket": {"rate": 1, "period": "1s", "burst": 100000}}]}

    with SlowUpstream(200, 300) as up, EcdsStack(config(0), upstream_port=up.port) as s:
        # 30 clients on a 300 ms upstream: an arrival every 10 ms, so both
        # workers hold leases nearly all the time, updates included.
        with contextlib.ExitStack() as clients:
            loads = [clients.enter_context(Load(s.port, max_seconds=30)) for _ in range(30)]
            for i in range(1, 6):
                time_passes(0.4)  # updates 0.4 s apart under the steady load
                s.push(config(i))
                s.wait_stat("update_success", i + 1)
        assert all(load.results for load in loads)
        assert [r for load in loads for r in load.unexpected({(200, None)})] == []
        # The last streams end; ticks return the current leases (nothing
        # shows when: the gauges count requests, not leases).
        time_passes(0.5)
        assert_burst_within_limit(s.port, 64)
        assert up.stats()["max_in_flight"] <= 64


def test_a_live_update_beside_a_million_slot_table_does_not_stall_traffic():
    """Every VM configures again on every update: a rule left unchanged must
    not cost a check of each of its slots (a million took seconds on every
    worker, and the admin endpoint stopped answering meanwhile)."""
    big = {"name": "big", "match": {"path_prefix": "/big"}, "key": ["client_address"],
           "bucket": {"rate": 100, "period": "1s"}, "max_keys": 1000000}
    load_rule = {"name": "load", "bucket": {"rate": 1, "period": "1h", "burst": 1000000}}
    extra = {"name": "extra", "match": {"path_prefix": "/other"}, "bucket": {"rate": 5, "period": "1s"}}
    with EcdsStack({"rate_limits": [big, load_rule]}) as s, \
            Load(s.port, max_seconds=40, requests_per_connection=5) as load:
        load.wait_count(50)
        t0 = time.time()
        s.push({"rate_limits": [big, load_rule, extra]})
        admin_worst = 0.0
        deadline = t0 + 3.0
        while time.time() < deadline:
            a = time.time()
            s.front.admin("/ready")
            admin_worst = max(admin_worst, time.time() - a)
            time_passes(0.05)  # the admin endpoint is timed every 50 ms for 3 s
        s.wait_stat("update_success", 2)
        done = load.since(t0 - 0.5)
        assert len(done) >= 20, "the load stalled during the update"
        times = [r[0] for r in done]
        worst_gap = max(b - a for a, b in zip(times, times[1:]))
        assert worst_gap < 1.0, f"a request waited {worst_gap:.2f} s during the update"
        assert admin_worst < 1.0, f"the admin endpoint took {admin_worst:.2f} s during the update"
        unexpected = load.unexpected({(200, None)})
        assert not unexpected, unexpected[:5]


def test_requests_held_for_their_turn_go_on_across_an_update():
    """Requests paused in the filter (held by a shaping rule) when the
    configuration is replaced are still resumed at their turns: Envoy keeps
    ticking the configuration they started under until they end."""
    def shaped(name):
        return {"rate_limits": [{"name": name, "bucket": {"rate": 2, "period": "1s", "burst": 1},
                                 "on_limit": "delay", "max_delay": "5s"}]}

    with EcdsStack(shaped("before")) as s:
        got, lock = [], threading.Lock()

        def one():
            t = time.time()
            r = http1.Conn(s.port, timeout=10).request("/")
            with lock:
                got.append((r.status, time.time() - t))

        clients = [threading.Thread(target=one) for _ in range(6)]
        for c in clients:
            c.start()
        # Some are held for their turn (one every 0.5 s) when the update lands.
        s.front.wait_stat(metric("sluice_rl_held", rule="before"), lambda v: v >= 2)
        s.push(shaped("after"))
        s.wait_stat("update_success", 2)
        for c in clients:
            c.join(timeout=15)
        # Turns 0, 0.5, ..., 2.5 s: every one answered, none long after its turn.
        assert sorted(st for st, _ in got) == [200] * 6, got
        assert max(t for _, t in got) < 4, got


def test_a_state_started_afresh_brings_the_open_keys_gauge_back(tmp_path):
    """Envoy keeps a gauge by its name: a breaker open in a state that is
    gone (the native module loaded from another file, a wasm VM with
    another vm_id, each starting with an empty store) must not leave
    sluice_cb_open_keys at 1, where SluiceBreakerOpen would fire for a
    breaker nobody has."""
    conf = {"circuit_breakers": [{"name": "b", "key": "cluster", "min_requests": 5,
                                  "open": {"base": "60s", "max": "120s"}}]}
    if HOST == "wasm":
        def fresh(c, _name):
            return plugin_config(c, vm_id="sluice-fresh")
    else:
        copy = tmp_path / "libsluice_native_copy.so"
        shutil.copy(NATIVE, copy)

        def fresh(c, _name):
            return native_filter(c, lib=copy)["typed_config"]
    gauge = metric("sluice_cb_open_keys", breaker="b")
    with EcdsStack(conf) as s:
        for _ in range(6):
            http1.get(s.port, "/", {"x-envoy-fault-abort-request": "503"})
        s.front.wait_stat(gauge, 1)
        time_passes(0.1)  # every worker re-reads the breakers' shared state within 20 ms
        assert http1.get(s.port, "/").status == 503
        s.wasm_config = fresh
        s.push(conf)
        s.wait_stat("update_success", 2)
        wait_until(lambda: all(http1.get(s.port, "/").status == 200 for _ in range(4)), UPDATE_TIMEOUT,
                   "the configuration in a fresh state serving, its breaker closed")
        s.front.wait_stat(gauge, 0)
        time.sleep(1.5)  # past the next second's refresh on every worker
        assert s.front.stat(gauge) == 0


def test_a_breaker_removed_while_open_leaves_no_open_keys_gauge_behind():
    """A configuration without a breaker that was open takes its
    sluice_cb_open_keys down (the wasm build's gauge goes to 0, the native
    build's goes with its configuration), where SluiceBreakerOpen would
    fire for good; a breaker the new configuration keeps stays counted."""
    def both(names):
        return {"circuit_breakers": [{"name": n, "key": "cluster", "min_requests": 5,
                                      "open": {"base": "60s", "max": "120s"}} for n in names]}
    gone, kept = (metric("sluice_cb_open_keys", breaker=n) for n in ("gone", "kept"))
    with EcdsStack(both(["gone", "kept"])) as s:
        for _ in range(6):
            http1.get(s.port, "/", {"x-envoy-fault-abort-request": "503"})
        s.front.wait_stat(gone, 1)
        s.front.wait_stat(kept, 1)
        s.push(both(["kept"]))
        s.wait_stat("update_success", 2)

        def removed():
            names = s.front.stats("sluice_cb_open_keys")
            return names.get(gone, 0) == 0
        wait_until(removed, UPDATE_TIMEOUT, "the removed breaker's gauge at 0 or gone")
        time.sleep(1.5)  # past the next second's refresh on every worker
        assert s.front.stats("sluice_cb_open_keys").get(gone, 0) == 0
        assert s.front.stat(kept) == 1
        assert http1.get(s.port, "/").status == 503, "the kept breaker is still open"


def test_the_gauges_of_mechanisms_a_configuration_drops_come_down():
    """A retry budget's ratio and an adaptive shedder's limit and floor
    read 0 (the wasm build) or are gone (the native build's go with their
    configuration) once the configuration no longer has them; dashboards
    would show their last values for good."""
    conf = {"retry_budgets": [{"name": "rb", "ratio": 1.0, "min_per_second": 0, "window": "10s"}],
            "shedders": [{"name": "ad", "concurrency": {"max": "auto"}}]}
    gauges = [metric("sluice_retry_ratio_permille", budget="rb"), metric("sluice_shed_limit", shedder="ad")]
    with EcdsStack(conf) as s:
        c = http1.Conn(s.port)
        for _ in range(4):
            c.request("/")
        c.request("/", {"x-envoy-attempt-count": "2"})
        for g in gauges:
            s.front.wait_stat(g, lambda v: v > 0)
        s.push({"rate_limits": [{"name": "other", "match": {"path_prefix": "/zzz"},
                                 "bucket": {"rate": 1000, "period": "1s"}}]})
        s.wait_stat("update_success", 2)
        for _ in range(10):
            http1.get(s.port, "/")

        def down():
            stats = s.front.stats("sluice_")
            return all(stats.get(g, 0) == 0 for g in gauges)
        wait_until(down, UPDATE_TIMEOUT, "the dropped mechanisms' gauges at 0 or gone")
        time.sleep(1.5)  # past every worker's next ticks
        assert down(), s.front.stats("sluice_")
