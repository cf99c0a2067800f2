"""End to end: an adaptive concurrency limit (`concurrency.max: "auto"`) in
a real Envoy with 2 workers, in front of an upstream whose capacity changes
while closed-loop clients keep it overloaded."""

import threading
import time

import pytest

import http1
from harness import CapacityUpstream, FrontOf, metric, time_passes

# The limit is sampled every half second (the bounds below were measured so).
SAMPLE_EVERY_S = 0.5

SERVICE_MS = 20


def AdaptiveStack(plugin_config, capacity, concurrency=2):
    """An upstream whose capacity changes (a child process) and a front Envoy."""
    return FrontOf(CapacityUpstream(capacity, SERVICE_MS), plugin_config, concurrency)


class Load:
    """Closed-loop clients, each sending requests back to back until
    stopped (or `pause_after_refusal` seconds after an answer other than
    200), client `i` with the headers `headers_for(i)`. Each result is
    (sent_at, latency_s, status, i)."""

    def __init__(self, port, clients, headers_for=lambda i: {}, pause_after_refusal=0.0):
        self.port, self.headers_for = port, headers_for
        self.pause = pause_after_refusal
        self.stop = threading.Event()
        self.results = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,)) for i in range(clients)]

    def client(self, i):
        c = http1.Conn(self.port)
        while not self.stop.is_set():
            t = time.time()
            try:
                r = c.request("/", self.headers_for(i))
            except OSError:
                c.close()
                c = http1.Conn(self.port)
                continue
            with self.lock:
                self.results.append((t, time.time() - t, r.status, i))
            if r.header("connection") == "close":
                c.close()
                c = http1.Conn(self.port)
            if self.pause and r.status != 200:
                time_passes(self.pause)  # a refused client backs off
        c.close()

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def adaptive_config(**adaptive):
    return {"shedders": [{"name": "up", "concurrency": {
        "max": "auto", "queue": 500, "max_wait": "5s",
        "adaptive": dict({"min": 1, "max": 64, "initial": 4, "interval": "100ms"}, **adaptive)}}]}


def limit_of(s):
    return s.front.stat(metric("sluice_shed_limit", shedder="up"))


def floor_of(s):
    return s.front.stat(metric("sluice_shed_latency_floor_ms", shedder="up"))


@pytest.mark.slow
def test_the_limit_converges_up_and_down_as_the_upstream_capacity_changes():
    with AdaptiveStack(adaptive_config(), capacity=4) as s, Load(s.port, 32):
        seen = {}
        for capacity, settle_s in ((4, 4), (12, 5), (2, 4)):
            s.up.set_capacity(capacity)
            time_passes(settle_s)  # the limit converges on the new capacity
            s.up.stats(reset=True)
            time_passes(1)  # the upstream's peak in flight, measured from here on
            limits = []
            for _ in range(5):
                limits.append(limit_of(s))
                time_passes(SAMPLE_EVERY_S)
            peak = s.up.stats()["max_in_flight"]
            # The floor in use, to tell a limit off because of it (a floor
            # measured high) from one off in spite of it; the last is checked.
            floor = floor_of(s)
            seen[capacity] = (limits, peak, floor)
    # Within the tolerance (1.25 by default) of the capacity, and never
    # more in flight at the upstream than the limit allows.
    # Measured here: 6-7 at capacity 4, 15-17 at 12, 2-4 at 2 (the average
    # latency stays within 1.25x the floor up to about 1.33x the capacity,
    # plus the square-root headroom of the next step).
    for capacity, (limits, peak, _) in seen.items():
        median = sorted(limits)[len(limits) // 2]
        assert capacity <= median <= capacity * 1.75 + 1, (capacity, seen)
        assert min(limits) >= capacity // 2, (capacity, seen)
        assert peak <= max(limits), (capacity, seen)
    assert SERVICE_MS <= floor <= SERVICE_MS + 5, (floor, seen)



@pytest.mark.slow
def test_an_upstream_whose_service_time_varies_widely_is_kept_busy():
    """8 slots of 10 to 50 ms (30 on average, however few are in flight),
    the default tolerance: the lowest latency seen is a third of the
    average, and by it alone every interval looked queued (an outside
    review: limit 1 to 2, the upstream 7 to 47% used). The floor measured
    at the minimum limit keeps the limit near the capacity."""
    capacity, mean_ms = 8, 30
    with FrontOf(CapacityUpstream(capacity, mean_ms), adaptive_config(), 2) as s, Load(s.port, 32):
        s.up.control("/__jitter?ms=20")
        time_passes(4)  # the limit settles under the jittery service time
        before, t0 = s.up.stats()["served"], time.time()
        limits = []
        for _ in range(15):
            time_passes(SAMPLE_EVERY_S)
            limits.append(limit_of(s))
        used = (s.up.stats()["served"] - before) / (time.time() - t0) * mean_ms / 1000 / capacity
        floor = floor_of(s)
    median = sorted(limits)[len(limits) // 2]
    assert used > 0.8, (used, limits, floor)
    assert capacity <= median <= capacity * 2, (used, limits, floor)
    assert 20 <= floor <= 45, (used, limits, floor)

def test_bad_adaptive_settings_are_refused_naming_the_field():
    from harness import validate
    for adaptive, message in (
        ({"min": 0}, "shedders[0].concurrency.adaptive.min: must be between 1 and 100000, got 0"),
        ({"min": 10, "max": 5}, "shedders[0].concurrency.adaptive.max: must be at least min (10)"),
        ({"tolerance": 0.5}, "shedders[0].concurrency.adaptive.tolerance: must be between 1.0 and 10.0"),
        ({"initial": 500}, "shedders[0].concurrency.adaptive.initial: must be between min (1) and max (64)"),
        ({"interval": "1s", "floor_window": "1s"},
         "shedders[0].concurrency.adaptive.floor_window: must be at least twice the interval"),
    ):
        ok, out = validate(adaptive_config(**adaptive))
        assert not ok and message in out, (adaptive, out[-1500:])
    ok, out = validate({"shedders": [{"name": "up", "concurrency": {"max": "lots"}}]})
    assert not ok and 'shedders[0].concurrency.max: must be a positive integer or "auto", got "lots"' in out, out[-1500:]
    ok, out = validate({"shedders": [{"name": "up", "concurrency": {"max": 5, "adaptive": {}}}]})
    assert not ok and 'shedders[0].concurrency.adaptive: only applies with max: "auto"' in out, out[-1500:]


WORKERS = 2


def test_shares_hold_under_overload_from_every_class_at_once():
    """16 clients per class (each class alone 4x the upstream's capacity of
    4 slots at 20 ms): admissions split by the configured shares."""
    shares = {"critical": 50, "default": 35, "sheddable": 15}
    cfg = {"shedders": [{"name": "up", "priority": {"header": "x-priority", "shares": shares},
                         "concurrency": {"max": 4, "queue": 200, "max_wait": "2s"}}]}
    with AdaptiveStack(cfg, capacity=4, concurrency=WORKERS) as s:
        stop = threading.Event()
        got = {c: 0 for c in shares}
        lock = threading.Lock()

        def client(cls):
            c = http1.Conn(s.port)
            while not stop.is_set():
                r = c.request("/", {"x-priority": cls})
                if r.status == 200 and measuring.is_set():
                    with lock:
                        got[cls] += 1
                if r.header("connection") == "close":
                    c.close()
                    c = http1.Conn(s.port)
            c.close()

        measuring = threading.Event()
        threads = [threading.Thread(target=client, args=(cls,)) for cls in shares for _ in range(16)]
        for t in threads:
            t.start()
        time_passes(1.5)  # overload sets in; not measured
        measuring.set()
        time_passes(4)  # the measured stretch
        measuring.clear()
        stop.set()
        for t in threads:
            t.join()
    total = sum(got.values())
    assert total > 400, got  # about 200/s for 4 s
    for cls, pct in shares.items():
        assert abs(100 * got[cls] / total - pct) <= 6, got


@pytest.mark.slow
def test_shares_hold_with_the_default_queue_full_on_both_workers():
    """12 clients per class against 4 slots with the default queue (4 x max,
    16 per worker), full on both workers: each sheds from its own queue a
    class's newest turn only, so no class's turn is skipped (measured:
    50/35/15 within 0.2 point on a loaded machine)."""
    shares = {"critical": 50, "default": 35, "sheddable": 15}
    cfg = {"shedders": [{"name": "up", "priority": {"header": "x-priority", "shares": shares},
                         "concurrency": {"max": 4, "max_wait": "1s"}}]}
    got, _, refused = overload_by_class(cfg, per_class=12)
    total = sum(got.values())
    assert total > 400 and len(refused) > 1000, (got, len(refused))
    for cls, pct in shares.items():
        assert abs(100 * got[cls] / total - pct) <= 3, got


def overload_by_class(cfg, seconds=4.0, per_class=16):
    """16 closed-loop clients per class against 4 slots of 20 ms (2 Envoy
    workers); a refused client sends again at once. Returns, from the
    measured stretch, the admissions per class, the admitted latencies and
    the refusals' latencies (seconds)."""
    classes = ("critical", "default", "sheddable")
    with AdaptiveStack(cfg, capacity=4, concurrency=WORKERS) as s:
        stop, measuring = threading.Event(), threading.Event()
        got = {c: 0 for c in classes}
        admitted, refused = [], []
        lock = threading.Lock()

        def client(cls):
            c = http1.Conn(s.port)
            while not stop.is_set():
                t = time.time()
                r = c.request("/", {"x-priority": cls})
                took = time.time() - t
                if measuring.is_set():
                    with lock:
                        if r.status == 200:
                            got[cls] += 1
                            admitted.append(took)
                        else:
                            assert r.status == 503, r.status
                            refused.append(took)
                if r.header("connection") == "close":
                    c.close()
                    c = http1.Conn(s.port)
            c.close()

        threads = [threading.Thread(target=client, args=(cls,)) for cls in classes for _ in range(per_class)]
        for t in threads:
            t.start()
        time_passes(1.5)  # overload sets in; not measured
        measuring.set()
        time_passes(seconds)  # the measured stretch
        measuring.clear()
        stop.set()
        for t in threads:
            t.join()
    return got, sorted(admitted), sorted(refused)


@pytest.mark.slow
def test_shed_early_refuses_at_once_and_keeps_the_shares():
    """With `shed_early`, a request that would wait past max_wait is refused
    on arrival instead of after waiting max_wait out, and the shares still
    hold; without it, the same overload's refusals come after max_wait."""
    shares = {"critical": 50, "default": 35, "sheddable": 15}

    def cfg(early):
        return {"shedders": [{"name": "up", "priority": {"header": "x-priority", "shares": shares},
                              "concurrency": {"max": 4, "queue": 200, "max_wait": "60ms",
                                              "shed_early": early}}]}

    got, admitted, refused = overload_by_class(cfg(True))
    total = sum(got.values())
    assert total > 400, got  # about 200/s for 4 s
    for cls, pct in shares.items():
        assert abs(100 * got[cls] / total - pct) <= 6, got
    # Refused on arrival: well before max_wait (measured: a median of 2.5
    # to 3 ms, and 0.1 to 0.2% at 60 ms or more), save the few whose wait
    # was misjudged. Measured shares: 50/34/16.
    assert refused[len(refused) // 2] < 0.030, refused[len(refused) // 2]
    assert sum(1 for t in refused if t >= 0.060) <= 0.05 * len(refused), len(refused)
    # Admitted: the wait is bounded by max_wait, then the 20 ms upstream
    # (measured p99: 85 ms).
    p99 = admitted[int(len(admitted) * 0.99)]
    assert p99 < 0.060 + 0.020 + 0.040, p99

    # Without it: the refusals wait max_wait out first, and the shares hold
    # too (a waiter that waits max_wait out before its turn leaves the turn
    # to its class; before, critical took 99% here).
    got, _, late = overload_by_class(cfg(False), seconds=3.0)
    assert late[len(late) // 2] >= 0.060, late[len(late) // 2]
    total = sum(got.values())
    for cls, pct in shares.items():
        assert abs(100 * got[cls] / total - pct) <= 6, got
