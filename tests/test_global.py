"""End to end: global rules. Several front Envoys (replicas, two workers
each) share one limit through the reference rate-limit service (rls/),
without a call on any request's path; a local backstop serves while the
service is down.
"""

import concurrent.futures
import json
import time

import pytest

import http1
from harness import Envoy, free_port, front_bootstrap, upstream_bootstrap, wasm_filter
from rls import Redis, RlsServer, rls_cluster

RLS_DOMAIN = "fleet"


def limits(per_unit, unit="hour", key="x-tenant"):
    return {"domain": RLS_DOMAIN,
            "descriptors": [{"key": key, "rate_limit": {"unit": unit, "requests_per_unit": per_unit}}]}


def plugin(limit, period="1h", instances=3, **global_fields):
    g = {"cluster": "rls", "domain": RLS_DOMAIN, "instances": instances}
    g.update(global_fields)
    return {"domain": "global-test",
            "rate_limits": [{"name": "per-tenant", "key": [{"header": "x-tenant"}],
                             "algorithm": "sliding_window",
                             "window": {"limit": limit, "period": period},
                             "global": g}]}


class Upstream(Envoy):
    def __init__(self):
        self.port = free_port()
        super().__init__(upstream_bootstrap(self.port, free_port()), concurrency=1)


def replica(upstream, rls_port, config, concurrency=2):
    port = free_port()
    boot = front_bootstrap(port, free_port(), upstream.port, [wasm_filter(config)])
    boot["static_resources"]["clusters"].append(rls_cluster("rls", rls_port))
    e = Envoy(boot, concurrency=concurrency)
    e.port = port
    return e


def get(port, tenant, path="/"):
    return http1.get(port, path, {"x-tenant": tenant})


def wait_out_hour_edge(margin_s=120):
    left = 3600 - time.time() % 3600
    if left < margin_s:
        time.sleep(left + 0.5)
