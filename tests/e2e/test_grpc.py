"""End to end: every refusal (rate limit, open breaker, shed) is either a
well-formed gRPC error or the configured HTTP status, whatever the request's
content type, with and without Envoy's grpc_web filter in front of sluice.
Never a bare 200 that a client would read as success."""

import threading

import http1
from harness import TRAFFIC_SEEN_S, Stack, settle, wait_until

# Every worker re-reads the breakers' shared state within 20 ms; no condition
# shows it without a request that would change the breaker's count.
SHARED_STATE_S = 0.1

GRPC_WEB = {"name": "envoy.filters.http.grpc_web",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_web.v3.GrpcWeb"}}

CONTENT_TYPES = [
    "application/grpc", "application/grpc+proto", "application/grpc-web",
    "application/grpc-web+proto", "application/grpc-web-text", "application/grpc;charset=utf-8",
    "application/grpcx", "application/json", None,
]

CFG = {
    "rate_limits": [{"name": "rl", "match": {"path_prefix": "/rl"}, "key": [{"header": "x-case"}],
                     "bucket": {"rate": 1, "period": "1h", "burst": 1}}],
    "circuit_breakers": [{"name": "cb", "match": {"path_prefix": "/cb"}, "min_requests": 2,
                          "error_rate": 0.5, "open": {"base": "60s", "max": "60s"}}],
    "shedders": [{"name": "sh", "match": {"path_prefix": "/shed"},
                  "concurrency": {"max": 1, "queue": 0}}],
}


def refusal_is_honest(r, http_status, grpc_status):
    """A gRPC error (grpc-status set and not OK) or the configured status."""
    if r.status == 200:
        assert r.header("grpc-status") == grpc_status, (r.status, r.headers)
        assert (r.header("content-type") or "").startswith("application/grpc"), r.headers
        assert r.header("grpc-message"), r.headers
    else:
        assert r.status == http_status, (r.status, r.headers)
        # Behind grpc_web, a grpc-web client is told in grpc-web terms too.
        if (r.header("content-type") or "").startswith("application/grpc-web"):
            assert r.header("grpc-status") not in (None, "0"), r.headers


def request(port, path, ct, case):
    h = {"x-case": case, "te": "trailers"}
    if ct is not None:
        h["content-type"] = ct
    return http1.Conn(port).request(path, h, method="POST")


def check_every_mechanism(filters_before):
    with Stack(CFG, filters_before=filters_before) as s:
        # Trip the breaker with plain requests the upstream fails.
        c = http1.Conn(s.port)
        for _ in range(3):
            c.request("/cb", {"x-envoy-fault-abort-request": "503"})
        settle(SHARED_STATE_S)
        # Hold the shedder's only slot with a slow request.
        before = s.upstream_requests()
        slow = threading.Thread(target=http1.get, args=(s.port, "/shed/slow"),
                                kwargs={"headers": {"x-envoy-fault-delay-request": "3000"}})
        slow.start()
        wait_until(lambda: s.upstream_requests() > before, TRAFFIC_SEEN_S, "the slow request at the upstream")
        try:
            for i, ct in enumerate(CONTENT_TYPES):
                case = f"{i}-{bool(filters_before)}"
                assert request(s.port, "/rl", ct, case).status in (200,), ct  # within the limit
                refusal_is_honest(request(s.port, "/rl", ct, case), 429, "8")
                refusal_is_honest(request(s.port, "/cb", ct, case), 503, "14")
                refusal_is_honest(request(s.port, "/shed/x", ct, case), 503, "14")
        finally:
            slow.join(timeout=10)


def test_refusals_are_grpc_errors_or_http_errors_for_every_content_type():
    check_every_mechanism(None)


def test_refusals_behind_the_grpc_web_filter_are_grpc_web_errors_or_http_errors():
    check_every_mechanism([GRPC_WEB])
