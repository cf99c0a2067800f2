// A proxy-wasm host (ABI 0.2.1) for the built module, without Envoy: it
// answers the host calls sluice imports as Envoy 1.40 does and calls the
// module's hooks in Envoy's order (docs/design.md#what-is-tested-where).
// The host owns the clock and the ticks, so tests are deterministic and
// take no wall time: `host.advance(ms)` moves the clock and fires each root
// context's tick when due.
//
//   const host = await Host.load(WASM);
//   const vm = host.vm();                   // one worker's VM (an instance)
//   const root = vm.configure({...});       // a root context (a plugin)
//   const s = vm.request(root, {"x-tenant": "a"});
//   s.action, s.upstream, s.reply, s.continued; s.respond(200); s.end();
//
// As in Envoy: shared data per vm_id, with CAS versions from one counter;
// shared queues per vm_id, heard by the root context that registered them,
// delivered later (posted, not nested); `proxy_continue_stream` and local
// replies take effect once the VM call returns, and a local reply passes
// through the filter's response hook; `proxy_set_effective_context` fails
// for a deleted context; hooks the module does not export are skipped;
// metrics are shared by name across VMs (counters only go up). Calls out
// (gRPC, HTTP) are not implemented: one fails the test.
import { readFile } from "node:fs/promises";

const OK = 0, NOT_FOUND = 1, BAD_ARGUMENT = 2, EMPTY = 7, CAS_MISMATCH = 8;
const REQUEST_HEADERS = 0, RESPONSE_HEADERS = 2, PLUGIN_CONFIGURATION = 7;
const COUNTER = 0, GAUGE = 1, HISTOGRAM = 2;
const LEVELS = ["trace", "debug", "info", "warn", "error", "critical"];
const utf8 = new TextEncoder();
const text = new TextDecoder();

/** Headers as given by a test: an object or [name, value] pairs. */
const pairs = (h) => (Array.isArray(h) ? h : Object.entries(h)).map(([k, v]) => [k.toLowerCase(), String(v)]);

/** The proxy-wasm map format: count, each name's and value's size, then each NUL-terminated. */
function serialize(map) {
  const parts = map.map(([k, v]) => [utf8.encode(k), utf8.encode(v)]);
  const size = 4 + parts.reduce((n, [k, v]) => n + 10 + k.length + v.length, 0);
  const out = new Uint8Array(size);
  const view = new DataView(out.buffer);
  view.setUint32(0, parts.length, true);
  let at = 4 + 8 * parts.length;
  parts.forEach(([k, v], i) => {
    view.setUint32(4 + 8 * i, k.length, true);
    view.setUint32(8 + 8 * i, v.length, true);
    out.set(k, at);
    out.set(v, at + k.length + 1);
    at += k.length + v.length + 2;
  });
  return out;
}

function deserialize(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const count = bytes.length ? view.getUint32(0, true) : 0;
  const out = [];
  let at = 4 + 8 * count;
  for (let i = 0; i < count; i++) {
    const k = view.getUint32(4 + 8 * i, true), v = view.getUint32(8 + 8 * i, true);
    out.push([text.decode(bytes.subarray(at, at + k)), text.decode(bytes.subarray(at + k + 1, at + k + 1 + v))]);
    at += k + v + 2;
  }
  return out;
}

export class Host {
  static async load(path) {
    return new Host(await WebAssembly.compile(await readFile(path)));
  }

  constructor(module) {
    this.module = module;
    this.now = 1_700_000_000_000; // ms since the epoch
    this.vms = [];
    this.shared = new Map(); // vm_id -> key -> {value, cas}
    this.cas = 1;
    this.queues = new Map(); // token -> {vmId, name, vm, context, items}
    this.metrics = new Map(); // name -> {type, value, samples}
    this.tasks = []; // posted work (queue deliveries), run by settle()
    // (vm, key) before a VM's write to shared data: a test runs another
    // worker there to race it (workers run in parallel in Envoy).
    this.beforeWrite = null;
  }

  /** A new VM (a worker's, or the main thread's) sharing this host's state. */
  vm(vmId = "sluice") {
    const vm = new Vm(this, vmId, this.vms.length + 1);
    this.vms.push(vm);
    return vm;
  }

  /** Runs posted work, as Envoy's event loop would, until there is none. */
  settle() {
    while (this.tasks.length) this.tasks.shift()();
  }

  /** Moves the clock by `ms`, firing every tick that falls due on the way, in time order. */
  advance(ms) {
    const end = this.now + ms;
    for (;;) {
      let next = null;
      for (const vm of this.vms) {
        for (const root of vm.roots()) {
          if (root.nextTick !== null && root.nextTick <= end && (!next || root.nextTick < next.root.nextTick)) {
            next = { vm, root };
          }
        }
      }
      if (!next) break;
      this.now = next.root.nextTick;
      next.root.nextTick = this.now + next.root.period;
      next.vm.call(next.root.id, "proxy_on_tick", next.root.id);
      this.settle();
    }
    this.now = end;
  }

  /** A metric's value by its full name (labels included, as Envoy's /stats names it). */
  metric(name) {
    const m = this.metrics.get(name);
    return m && (m.type === HISTOGRAM ? m.samples : m.value);
  }

  data(vmId) {
    if (!this.shared.has(vmId)) this.shared.set(vmId, new Map());
    return this.shared.get(vmId);
  }
}

/** One VM: a module instance, its contexts, and the host calls it imports. */
class Vm {
  constructor(host, vmId, seed) {
    this.host = host;
    this.vmId = vmId;
    this.contexts = new Map();
    this.nextId = 1;
    this.metricNames = new Map(); // this VM's metric id -> name
    this.logs = [];
    this.logLevel = 2; // info
    this.current = 0;
    this.effective = 0;
    this.depth = 0;
    this.after = []; // what Envoy does once the outermost VM call returns
    this.random = (seed * 0x9e3779b9) >>> 0;
    const instance = new WebAssembly.Instance(host.module, this.imports());
    this.exports = instance.exports;
    this.exports._initialize?.();
  }

  roots() {
    return [...this.contexts.values()].filter((c) => c.root === 0);
  }

  /** Calls a hook in `context`, if the module exports it (Envoy skips those it does not). */
  call(context, hook, ...args) {
    const fn = this.exports[hook];
    if (!fn) return undefined;
    const saved = [this.current, this.effective];
    this.current = this.effective = context;
    this.depth++;
    try {
      return fn(...args);
    } finally {
      [this.current, this.effective] = saved;
      if (--this.depth === 0) {
        const after = this.after.splice(0);
        after.forEach((f) => f());
      }
    }
  }

  /** A new root context with this plugin configuration (a JSON value or text); `ok` says if it was accepted. */
  configure(config) {
    const bytes = utf8.encode(typeof config === "string" ? config : JSON.stringify(config));
    const root = { id: this.nextId++, root: 0, config: bytes, period: 0, nextTick: null };
    this.contexts.set(root.id, root);
    this.call(root.id, "proxy_on_context_create", root.id, 0);
    this.call(root.id, "proxy_on_vm_start", root.id, 0);
    root.ok = this.call(root.id, "proxy_on_configure", root.id, bytes.length) !== 0;
    return root;
  }

  /** Deletes a root context, as Envoy does with a replaced plugin once its streams are gone. */
  remove(root) {
    this.call(root.id, "proxy_on_done", root.id);
    this.call(root.id, "proxy_on_delete", root.id);
    this.contexts.delete(root.id);
  }

  /** A new stream of `root` whose request headers arrive (end of stream: no body). */
  request(root, headers, properties = {}) {
    const s = new Stream(this, root, headers, properties);
    this.contexts.set(s.id, s);
    this.call(s.id, "proxy_on_context_create", s.id, root.id);
    s.action = this.call(s.id, "proxy_on_request_headers", s.id, s.request.length, 1) === 0 ? "continue" : "pause";
    if (s.action === "continue" && !s.reply) s.goUpstream();
    this.host.settle();
    return s;
  }

  // Memory: the module's, read and written afresh (it may grow).
  bytes(ptr, len) {
    return new Uint8Array(this.exports.memory.buffer, ptr, len).slice();
  }
  str(ptr, len) {
    return text.decode(this.bytes(ptr, len));
  }
  u32(ptr, value) {
    new DataView(this.exports.memory.buffer).setUint32(ptr, value, true);
  }
  /** Copies `data` into memory the module allocates, and tells it where. */
  give(data, ptrPtr, sizePtr) {
    const bytes = typeof data === "string" ? utf8.encode(data) : data;
    const ptr = this.exports.proxy_on_memory_allocate(bytes.length);
    new Uint8Array(this.exports.memory.buffer, ptr, bytes.length).set(bytes);
    this.u32(ptrPtr, ptr);
    this.u32(sizePtr, bytes.length);
    return OK;
  }

  /** The context host calls act on: the effective one if it still exists, else the current one. */
  context() {
    return this.contexts.get(this.effective) ?? this.contexts.get(this.current);
  }
  rootOf(c) {
    return c.root === 0 ? c : this.contexts.get(c.root);
  }
  map(type) {
    const c = this.context();
    const map = type === REQUEST_HEADERS ? c.request : type === RESPONSE_HEADERS ? c.response : null;
    if (!map) throw new Error(`header map ${type} of context ${c.id}`);
    return map;
  }

  imports() {
    const host = this.host;
    const env = {
      proxy_log: (level, ptr, len) => {
        const line = { level: LEVELS[level], message: this.str(ptr, len) };
        this.logs.push(line);
        if (process.env.HOST_LOG || level >= 4) console.error(`[vm ${this.vmId}] ${line.level}: ${line.message}`);
        return OK;
      },
      proxy_get_log_level: (ptr) => (this.u32(ptr, this.logLevel), OK),
      proxy_get_current_time_nanoseconds: (ptr) => {
        new DataView(this.exports.memory.buffer).setBigUint64(ptr, BigInt(host.now) * 1_000_000n, true);
        return OK;
      },
      proxy_set_tick_period_milliseconds: (period) => {
        const root = this.rootOf(this.context());
        root.period = period;
        root.nextTick = period > 0 ? host.now + period : null;
        return OK;
      },
      proxy_get_buffer_bytes: (type, start, max, ptrPtr, sizePtr) => {
        if (type !== PLUGIN_CONFIGURATION) throw new Error(`buffer ${type}`);
        const config = this.rootOf(this.context()).config;
        return this.give(config.subarray(start, start + (max >>> 0)), ptrPtr, sizePtr); // usize::MAX: all
      },
      proxy_get_property: (pathPtr, pathLen, ptrPtr, sizePtr) => {
        const path = this.str(pathPtr, pathLen).split("\0").join(".");
        const c = this.context();
        const value = path === "plugin_vm_id" ? this.vmId : c.properties?.[path];
        return value === undefined ? NOT_FOUND : this.give(String(value), ptrPtr, sizePtr);
      },
      proxy_get_header_map_value: (type, kPtr, kLen, ptrPtr, sizePtr) => {
        const name = this.str(kPtr, kLen).toLowerCase();
        const entry = this.map(type).find(([k]) => k === name);
        return entry ? this.give(entry[1], ptrPtr, sizePtr) : NOT_FOUND;
      },
      proxy_get_header_map_pairs: (type, ptrPtr, sizePtr) => this.give(serialize(this.map(type)), ptrPtr, sizePtr),
      proxy_set_header_map_pairs: (type, ptr, len) => {
        this.map(type).splice(0, Infinity, ...deserialize(this.bytes(ptr, len)));
        return OK;
      },
      proxy_add_header_map_value: (type, kPtr, kLen, vPtr, vLen) => {
        this.map(type).push([this.str(kPtr, kLen).toLowerCase(), this.str(vPtr, vLen)]);
        return OK;
      },
      proxy_replace_header_map_value: (type, kPtr, kLen, vPtr, vLen) => {
        const map = this.map(type), name = this.str(kPtr, kLen).toLowerCase();
        const value = this.str(vPtr, vLen);
        const i = map.findIndex(([k]) => k === name);
        if (i < 0) map.push([name, value]);
        else map.splice(i, Infinity, [name, value], ...map.slice(i + 1).filter(([k]) => k !== name));
        return OK;
      },
      proxy_remove_header_map_value: (type, kPtr, kLen) => {
        const map = this.map(type), name = this.str(kPtr, kLen).toLowerCase();
        map.splice(0, Infinity, ...map.filter(([k]) => k !== name));
        return OK;
      },
      proxy_get_shared_data: (kPtr, kLen, ptrPtr, sizePtr, casPtr) => {
        const entry = host.data(this.vmId).get(this.str(kPtr, kLen));
        if (!entry) return NOT_FOUND;
        this.u32(casPtr, entry.cas);
        return this.give(entry.value, ptrPtr, sizePtr);
      },
      proxy_set_shared_data: (kPtr, kLen, vPtr, vLen, cas) => {
        const data = host.data(this.vmId), key = this.str(kPtr, kLen);
        host.beforeWrite?.(this, key);
        const entry = data.get(key);
        if (entry && cas !== 0 && cas >>> 0 !== entry.cas) return CAS_MISMATCH;
        data.set(key, { value: this.bytes(vPtr, vLen), cas: host.cas++ });
        return OK;
      },
      proxy_register_shared_queue: (nPtr, nLen, tokenPtr) => {
        const name = this.str(nPtr, nLen);
        let token = [...host.queues].find(([, q]) => q.vmId === this.vmId && q.name === name)?.[0];
        if (token === undefined) token = host.queues.size + 1;
        const old = host.queues.get(token);
        const root = this.rootOf(this.context());
        host.queues.set(token, { vmId: this.vmId, name, vm: this, context: root.id, items: old?.items ?? [] });
        this.u32(tokenPtr, token);
        return OK;
      },
      proxy_resolve_shared_queue: (vPtr, vLen, nPtr, nLen, tokenPtr) => {
        const vmId = this.str(vPtr, vLen), name = this.str(nPtr, nLen);
        const found = [...host.queues].find(([, q]) => q.vmId === vmId && q.name === name);
        if (!found) return NOT_FOUND;
        this.u32(tokenPtr, found[0]);
        return OK;
      },
      proxy_enqueue_shared_queue: (token, ptr, len) => {
        const q = host.queues.get(token);
        if (!q) return NOT_FOUND;
        q.items.push(this.bytes(ptr, len));
        host.tasks.push(() => {
          if (q.vm.contexts.has(q.context)) q.vm.call(q.context, "proxy_on_queue_ready", q.context, token);
        });
        return OK;
      },
      proxy_dequeue_shared_queue: (token, ptrPtr, sizePtr) => {
        const q = host.queues.get(token);
        if (!q) return NOT_FOUND;
        return q.items.length ? this.give(q.items.shift(), ptrPtr, sizePtr) : EMPTY;
      },
      proxy_define_metric: (type, nPtr, nLen, idPtr) => {
        const name = this.str(nPtr, nLen);
        if (!host.metrics.has(name)) host.metrics.set(name, { type, value: 0n, samples: [] });
        const id = ((this.metricNames.size + 1) << 2) | type;
        this.metricNames.set(id, name);
        this.u32(idPtr, id);
        return OK;
      },
      proxy_increment_metric: (id, offset) => {
        const m = host.metrics.get(this.metricNames.get(id));
        if (!m) return NOT_FOUND;
        if (m.type === HISTOGRAM || (m.type === COUNTER && offset <= 0n)) return BAD_ARGUMENT;
        m.value += offset;
        return OK;
      },
      proxy_record_metric: (id, value) => {
        const m = host.metrics.get(this.metricNames.get(id));
        if (!m) return NOT_FOUND;
        if (m.type === COUNTER) m.value += value;
        else if (m.type === GAUGE) m.value = value;
        else m.samples.push(value);
        return OK;
      },
      proxy_set_effective_context: (id) => {
        if (!this.contexts.has(id)) return BAD_ARGUMENT;
        this.effective = id;
        return OK;
      },
      proxy_continue_stream: (type) => {
        const s = this.context();
        if (!(s instanceof Stream) || type !== 0) throw new Error(`continue ${type} in context ${s.id}`);
        s.continued++;
        this.after.push(() => s.goUpstream());
        return OK;
      },
      proxy_send_local_response: (status, _dPtr, _dLen, bPtr, bLen, hPtr, hLen, grpcStatus) => {
        const s = this.context();
        if (!(s instanceof Stream)) throw new Error(`local reply in context ${s.id}`);
        const headers = deserialize(this.bytes(hPtr, hLen)).map(([k, v]) => [k.toLowerCase(), v]);
        const reply = { status, headers, body: this.str(bPtr, bLen), grpcStatus };
        s.replies.push(reply);
        this.after.push(() => s.localReply(reply));
        return OK;
      },
    };
    // Imported, not implemented here (calls out, foreign functions): a call fails the test.
    for (const i of WebAssembly.Module.imports(this.host.module)) {
      if (i.module === "env" && !(i.name in env)) {
        env[i.name] = () => {
          throw new Error(`host call ${i.name} is not implemented here`);
        };
      }
    }
    return { env, wasi_snapshot_preview1: this.wasi() };
  }

  /** WASI as the module needs it: randomness (seeded per VM), no environment, stderr. */
  wasi() {
    return {
      random_get: (ptr, len) => {
        const out = new Uint8Array(this.exports.memory.buffer, ptr, len);
        for (let i = 0; i < len; i++) {
          this.random = (Math.imul(this.random, 1664525) + 1013904223) >>> 0;
          out[i] = this.random >>> 24;
        }
        return 0;
      },
      environ_sizes_get: (countPtr, sizePtr) => (this.u32(countPtr, 0), this.u32(sizePtr, 0), 0),
      environ_get: () => 0,
      fd_write: (fd, iovs, count, writtenPtr) => {
        const view = new DataView(this.exports.memory.buffer);
        let n = 0;
        for (let i = 0; i < count; i++) {
          const chunk = this.bytes(view.getUint32(iovs + 8 * i, true), view.getUint32(iovs + 8 * i + 4, true));
          process.stderr.write(chunk);
          n += chunk.length;
        }
        this.u32(writtenPtr, n);
        return 0;
      },
      proc_exit: (code) => {
        throw new Error(`proc_exit(${code})`);
      },
    };
  }
}

/** One HTTP stream: the test plays the client and the upstream. */
class Stream {
  constructor(vm, root, headers, properties) {
    this.vm = vm;
    this.id = vm.nextId++;
    this.root = root.id;
    this.request = pairs(headers);
    this.response = null;
    this.properties = { "source.address": "10.0.0.1:5000", ...properties };
    this.action = null; // what proxy_on_request_headers returned
    this.continued = 0; // proxy_continue_stream calls for its request
    this.upstream = null; // its request headers as they went upstream
    this.replies = []; // local replies sent on it
  }

  get reply() {
    return this.replies[0] ?? null;
  }

  /** The reply's header `name` (first value), or undefined. */
  replyHeader(name) {
    return this.reply?.headers.find(([k]) => k === name)?.[1];
  }

  goUpstream() {
    if (this.upstream) throw new Error(`stream ${this.id} went upstream twice`);
    if (!this.ended) this.upstream = this.request.map(([k, v]) => [k, v]);
  }

  /** The request header `name` as it went upstream. */
  upstreamHeader(name) {
    return this.upstream?.find(([k]) => k === name)?.[1];
  }

  /**
   * The upstream answers (through Envoy's router, which marks it); returns
   * the response headers as the filter leaves them.
   */
  respond(status, headers = {}) {
    const marked = [[":status", String(status)], ...pairs(headers), ["x-envoy-upstream-service-time", "1"]];
    this.encode(marked, "via_upstream");
    this.vm.host.settle();
    return this.response;
  }

  /**
   * Envoy sends a local reply through the encoder filters, this one
   * included (empty details); a gRPC request gets a trailers-only answer.
   */
  localReply(r) {
    const type = this.request.find(([k]) => k === "content-type")?.[1] ?? "";
    if (!/^application\/grpc($|[+;])/.test(type)) return this.encode([[":status", String(r.status)], ...r.headers], "");
    const grpc = [["content-type", "application/grpc"], ["grpc-status", String(r.grpcStatus)], ["grpc-message", r.body]];
    this.encode([[":status", "200"], ...grpc, ...r.headers], "");
  }

  encode(headers, details) {
    if (this.ended || this.response) return;
    this.response = headers;
    this.properties["response.code_details"] = details;
    this.vm.call(this.id, "proxy_on_response_headers", this.id, headers.length, 1);
  }

  /** The stream ends, answered or not (a client that left): done, log, delete, as Envoy calls them. */
  end() {
    const vm = this.vm;
    this.ended = true;
    vm.call(this.id, "proxy_on_done", this.id);
    vm.call(this.id, "proxy_on_log", this.id);
    vm.call(this.id, "proxy_on_delete", this.id);
    vm.contexts.delete(this.id);
    vm.host.settle();
  }
}
