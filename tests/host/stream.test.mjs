// The built module in tests/host/host.mjs's host: a stream's life (pause,
// resume, a client that leaves, a replaced configuration, local replies)
// on a clock the test moves. Run by `make test-host`.
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { test } from "node:test";
import { Host } from "./host.mjs";

const WASM = process.env.SLUICE_WASM ?? new URL("../../target/wasm32-wasip1/release/sluice.wasm", import.meta.url);
const module = await WebAssembly.compile(await readFile(WASM));

/** A host with one VM configured with `config`. */
function start(config) {
  const host = new Host(module);
  const vm = host.vm();
  const root = vm.configure(config);
  assert.ok(root.ok, JSON.stringify(vm.logs));
  return { host, vm, root };
}

const get = (headers = {}) => ({ ":method": "GET", ":path": "/", ":authority": "api", ...headers });
const tenant = (t, headers = {}) => get({ "x-tenant": t, ...headers });

const BULKHEAD = {
  concurrency_limits: [{ name: "per-tenant", key: [{ header: "x-tenant" }], max: 1, max_wait: "2s" }],
  deadlines: { headers: ["x-deadline-ms"] },
};
// CoDel kept out of the way (a target above every wait here): queue mode alone.
const SHEDDER = {
  shedders: [{ name: "api", concurrency: { max: 1, queue: 4, max_wait: "1s" }, target: "5s", interval: "10s" }],
};

for (const [what, config] of [["bulkhead", BULKHEAD], ["shedder", SHEDDER]]) {
  test(`${what}: a paused request goes on when the holder ends`, () => {
    const { host, vm, root } = start(config);
    const a = vm.request(root, tenant("t"));
    assert.equal(a.action, "continue");
    const b = vm.request(root, tenant("t"));
    assert.equal(b.action, "pause");
    host.advance(250);
    assert.equal(b.continued, 0);
    assert.equal(b.upstream, null);
    a.respond(200);
    a.end();
    assert.equal(b.continued, 1, "resumed in its own context");
    assert.equal(a.continued, 0);
    assert.ok(b.upstream);
    assert.equal(b.reply, null);
  });

  test(`${what}: a waiter whose client leaves gives its place up, and nothing leaks`, () => {
    const { host, vm, root } = start(config);
    const a = vm.request(root, tenant("t"));
    const b = vm.request(root, tenant("t"));
    const c = vm.request(root, tenant("t"));
    assert.deepEqual([a.action, b.action, c.action], ["continue", "pause", "pause"]);
    b.end(); // reset by the client: no response, the context is deleted
    host.advance(10);
    a.respond(200);
    a.end();
    assert.equal(b.continued, 0);
    assert.equal(c.continued, 1, "the next waiter goes on");
    // c holds the one place: had a place been given back twice (counts
    // stop at 0), x would pass.
    const x = vm.request(root, tenant("t"));
    assert.equal(x.action, "pause", "c holds the only place");
    c.respond(200);
    c.end();
    assert.equal(x.continued, 1);
    x.respond(200);
    x.end();
    host.advance(100);
    // Exactly one place again: neither leaked (d would wait) nor given back twice (e would pass).
    const d = vm.request(root, tenant("t"));
    const e = vm.request(root, tenant("t"));
    assert.deepEqual([d.action, e.action], ["continue", "pause"]);
  });
}

test("the wait is taken off the deadline sent upstream, to the millisecond", () => {
  const { host, vm, root } = start(BULKHEAD);
  const a = vm.request(root, tenant("t", { "x-deadline-ms": "3000" }));
  assert.equal(a.upstreamHeader("x-deadline-ms"), "3000");
  const b = vm.request(root, tenant("t", { "x-deadline-ms": "3000" }));
  host.advance(250);
  a.respond(200);
  a.end();
  assert.equal(b.continued, 1);
  assert.equal(b.upstreamHeader("x-deadline-ms"), "2750");
});

test("a waiter past max_wait is answered from the tick, in its own context", () => {
  const { host, vm, root } = start(SHEDDER);
  vm.request(root, get());
  const b = vm.request(root, get());
  host.advance(999);
  assert.equal(b.reply, null);
  host.advance(2);
  assert.equal(b.reply?.status, 503);
  assert.equal(b.replyHeader("x-sluice-shed"), "default");
  assert.equal(b.continued, 0);
});

test("a rate limit answers 429 with Retry-After, and admits again when the clock has refilled it", () => {
  const { host, vm, root } = start({
    rate_limits: [{ name: "per-client", key: ["client_address"], bucket: { rate: 1, period: "1s", burst: 2 } }],
    response: { retry_after_jitter: "0s" },
  });
  const limited = "domain=.=default;.;rule=.=per-client;.;result=.=limited;.;sluice_rl_requests_total";
  const [a, b, c] = [1, 2, 3].map(() => vm.request(root, get()));
  assert.deepEqual([a.action, b.action, c.action], ["continue", "continue", "pause"]);
  assert.equal(c.upstream, null);
  assert.equal(c.reply.status, 429);
  assert.equal(c.replyHeader("retry-after"), "1");
  assert.equal(c.replyHeader("content-type"), "application/json");
  assert.equal(JSON.parse(c.reply.body).rule, "per-client");
  // Envoy passes the reply through the filter's response hook too: nothing is added twice.
  assert.deepEqual(c.response.slice(0, 2), [[":status", "429"], ["retry-after", "1"]]);
  assert.equal(c.response.filter(([k]) => k === "ratelimit").length, 1);
  assert.equal(host.metric(limited), 0n, "counts reach Envoy on the tick");
  host.advance(100);
  assert.equal(host.metric(limited), 1n);
  const grpc = vm.request(root, get({ "content-type": "application/grpc" }));
  assert.equal(grpc.reply.grpcStatus, 8);
  assert.equal(grpc.replyHeader("content-type"), undefined);
  host.advance(900);
  assert.equal(vm.request(root, get()).action, "continue");
  // Another client has its own bucket.
  assert.equal(vm.request(root, get(), { "source.address": "10.0.0.2:5000" }).action, "continue");
});

test("a replaced configuration: streams in flight finish under the old one, new streams use the new", () => {
  const response = { headers_on_allowed: true, ratelimit_headers: "draft", retry_after_jitter: "0s" };
  const { host, vm, root: old } = start({
    ...BULKHEAD,
    rate_limits: [{ name: "old", bucket: { rate: 100, period: "1s" } }],
    response,
  });
  const policy = (s) => s.response.find(([k]) => k === "ratelimit-policy")?.[1];
  const a = vm.request(old, tenant("t"));
  const b = vm.request(old, tenant("t"));
  assert.equal(b.action, "pause");
  // ECDS: a second root context in the same VM, with the new configuration.
  const next = vm.configure({ rate_limits: [{ name: "new", bucket: { rate: 1, period: "1s", burst: 1 } }], response });
  assert.ok(next.ok);
  const c = vm.request(next, tenant("t"));
  assert.equal(c.action, "continue", "no concurrency limit in the new configuration");
  c.respond(200);
  assert.match(policy(c), /^"new"/);
  const d = vm.request(next, tenant("t"));
  assert.equal(d.reply?.status, 429);
  assert.equal(JSON.parse(d.reply.body).rule, "new");
  host.advance(50);
  a.respond(200);
  assert.match(policy(a), /^"old"/);
  a.end();
  assert.equal(b.continued, 1, "the old configuration still resumes its waiter");
  b.respond(200);
  assert.match(policy(b), /^"old"/);
  b.end();
  c.end();
  vm.remove(old);
  host.advance(1000);
  const e = vm.request(next, tenant("t"));
  assert.equal(e.action, "continue");
  e.respond(200);
  assert.match(policy(e), /^"new"/);
  assert.deepEqual(vm.logs.filter((l) => l.level === "error" || l.level === "critical"), []);
});

test("a configuration replaced again and again, with traffic, defines no metric twice and keeps memory flat", () => {
  // Every mechanism, as an ECDS update every few seconds would deliver it.
  const config = {
    ...BULKHEAD,
    rate_limits: [{ name: "per-user", key: [{ header: "x-user" }], bucket: { rate: 2, period: "1s", burst: 3 }, max_keys: 50 }],
    circuit_breakers: [{ name: "deps", key: { header: "x-dep" } }],
    retry_budgets: [{ name: "retries" }],
    shedders: [{ name: "api", concurrency: { max: 8 } }],
  };
  const host = new Host(module);
  const vm = host.vm();
  let root = vm.configure(config);
  let defined = 0, memory = 0;
  for (let i = 0; i < 300; i++) {
    const next = vm.configure(config);
    assert.ok(next.ok);
    for (let k = 0; k < 5; k++) {
      const s = vm.request(next, get({ "x-user": `u${i * 5 + k}`, "x-tenant": `t${k}`, "x-dep": "a" }));
      s.respond(200);
      s.end();
    }
    host.advance(100);
    vm.remove(root);
    root = next;
    if (i === 10) [defined, memory] = [vm.metricNames.size, vm.exports.memory.buffer.byteLength];
  }
  // Envoy gives every define_metric call a new id and keeps it for the VM's life.
  assert.equal(vm.metricNames.size, defined, "metric ids defined after the first configurations");
  assert.equal(vm.exports.memory.buffer.byteLength, memory, "the module's memory grew");
  assert.deepEqual(vm.logs.filter((l) => l.level === "error" || l.level === "critical"), []);
});

// Places freed on another worker: a bulkhead's waiter finds them on its 1 ms poll,
// a shedder's is woken through a shared queue at once.
for (const [what, config, after] of [["bulkhead", BULKHEAD, 1], ["shedder", SHEDDER, 0]]) {
  test(`${what}, two workers: a place freed on one goes to a waiter on the other`, () => {
    const host = new Host(module);
    const [w1, w2] = [host.vm(), host.vm()];
    const [r1, r2] = [w1.configure(config), w2.configure(config)];
    host.advance(100); // the first tick: each worker listens on its queue
    const a = w1.request(r1, tenant("t"));
    const b = w2.request(r2, tenant("t"));
    assert.deepEqual([a.action, b.action], ["continue", "pause"]);
    a.respond(200);
    a.end();
    assert.equal(b.continued, after ? 0 : 1);
    host.advance(after);
    assert.equal(b.continued, 1, `resumed ${after} ms after`);
    assert.equal(w1.request(r1, tenant("t")).action, "pause", "b holds the place");
  });
}

test("two workers racing on one bucket: the compare-and-swap loser retries, no token is spent twice", () => {
  const config = { rate_limits: [{ name: "all", bucket: { rate: 1, period: "1h", burst: 2 } }] };
  const retries = "domain=.=default;.;rule=.=all;.;sluice_rl_cas_retries_total";
  const host = new Host(module);
  const [w1, w2] = [host.vm(), host.vm()];
  const [r1, r2] = [w1.configure(config), w2.configure(config)];
  let other = null;
  // Between worker 1's read of the bucket and its write, worker 2 spends a token.
  host.beforeWrite = (vm, key) => {
    if (vm === w1 && key.startsWith("sl") && !other) other = w2.request(r2, get());
  };
  const a = w1.request(r1, get());
  host.beforeWrite = null;
  assert.deepEqual([other?.action, a.action], ["continue", "continue"]);
  host.advance(100);
  assert.equal(host.metric(retries), 1n);
  assert.equal(w1.request(r1, get()).reply?.status, 429, "both tokens spent");
});
