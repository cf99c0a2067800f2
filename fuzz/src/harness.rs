//! What the targets drive the filter's pipeline with, over sluice's public
//! seams only: an in-memory compare-and-swap store, a request made of a
//! header list, a metrics sink that sums by metric, and a host of one
//! worker that carries out the pipeline's effects on a clock it moves.

use sluice::pipeline::telemetry::{MetricId, Sink};
use sluice::pipeline::{Effect, Env, Outcome, Pipeline, StreamId, Verdict};
use sluice::request::{Attribute, RequestView, ResponseView};
use sluice::store::{Entry, Store, StoreError};
use sluice::time::Instant;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

/// Shared data in memory: a value and a version (the CAS token) per key.
#[derive(Default)]
pub struct MemStore {
    pub map: RefCell<BTreeMap<String, (Vec<u8>, u32)>>,
}

impl Store for MemStore {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let map = self.map.borrow();
        Ok(map.get(key).map(|(b, c)| Entry::read(b.clone(), Some(*c))))
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.map.borrow_mut();
        let version = map.get(key).map_or(0, |(_, c)| *c);
        if cas.is_some_and(|c| c != version) {
            return Err(StoreError::CasMismatch);
        }
        map.insert(key.to_string(), (value.to_vec(), version.wrapping_add(1)));
        Ok(())
    }
}

/// A request: its headers (lower-case names, first value wins) and a
/// client address.
#[derive(Clone, Default, Debug)]
pub struct Req {
    pub headers: Vec<(String, Vec<u8>)>,
    pub address: Vec<u8>,
}

impl Req {
    pub fn new(method: &str, path: &str) -> Self {
        Req {
            headers: vec![
                (":method".into(), method.as_bytes().to_vec()),
                (":path".into(), path.as_bytes().to_vec()),
                (":authority".into(), b"example.com".to_vec()),
            ],
            address: b"10.1.2.3:4567".to_vec(),
        }
    }
    pub fn with(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.retain(|(n, _)| n != name);
        self.headers.push((name.to_string(), value.to_vec()));
        self
    }
}

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        let found = self.headers.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.clone())
    }
    fn attribute(&self, attr: Attribute) -> Option<Vec<u8>> {
        match attr {
            Attribute::ClientAddress => Some(self.address.clone()),
            Attribute::RouteName => Some(b"route".to_vec()),
            Attribute::ClusterName => Some(b"cluster".to_vec()),
        }
    }
}

/// An upstream response of a status, with optional headers.
pub struct Resp {
    pub status: u32,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl ResponseView for Resp {
    fn status(&self) -> Option<u32> {
        Some(self.status)
    }
    fn code_details(&self) -> Option<Vec<u8>> {
        Some(b"via_upstream".to_vec())
    }
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        if name == sluice::request::UPSTREAM_MARK {
            return Some(b"1".to_vec());
        }
        let found = self.headers.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.clone())
    }
}

/// Sums every change by metric id.
#[derive(Default)]
pub struct Sums(pub BTreeMap<MetricId, i64>);

impl Sink for Sums {
    fn add(&mut self, m: MetricId, by: i64) {
        *self.0.entry(m).or_default() += by;
    }
    fn add_now(&mut self, m: MetricId, by: i64) {
        self.add(m, by);
    }
    fn record(&mut self, _m: MetricId, _value: u64) {}
}

/// Nanoseconds per millisecond.
pub const MS: u64 = 1_000_000;
/// The clock's start: a realistic time since the Unix epoch.
pub const T0: u64 = 1_700_000_000_000_000_000;

/// Where a stream is, as the host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Paused,
    InFlight,
    Answered,
    Ended,
}

/// One worker's host: a pipeline, its store and clock, and its streams.
pub struct Host<'s> {
    pub store: &'s MemStore,
    pub now: Cell<u64>,
    pub pipeline: Pipeline,
    pub sums: Sums,
    pub streams: Vec<(Req, Phase)>,
    /// Every refusal seen (the current request's and effects').
    pub refusals: Vec<sluice::reply::Rejection>,
    /// RLS calls asked for and not answered yet.
    pub calls: Vec<u64>,
}

impl<'s> Host<'s> {
    /// A host of `config` (which must load and build) over `store`.
    pub fn new(config: &sluice::wiring::Config, store: &'s MemStore, worker: u32) -> Self {
        let pipeline = sluice::wiring::pipeline(config, (1, 2), worker, Instant::from_ns(T0), 7)
            .unwrap_or_else(|e| panic!("a loaded configuration does not build: {e}"));
        let mut host = Host {
            store,
            now: Cell::new(T0),
            pipeline,
            sums: Sums::default(),
            streams: Vec::new(),
            refusals: Vec::new(),
            calls: Vec::new(),
        };
        let now = host.now.get();
        let clock = move || Instant::from_ns(now);
        let mut env = Env {
            store,
            clock: &clock,
            sink: &mut host.sums,
        };
        // A store the pipeline cannot set up is the host's to log; not a panic.
        let _ = host.pipeline.start(&mut env);
        host
    }

    /// Runs `f` on the pipeline with an environment at the current time.
    pub fn call<R>(&mut self, f: impl FnOnce(&mut Pipeline, &mut Env<'_>) -> R) -> R {
        let now = self.now.get();
        let clock = move || Instant::from_ns(now);
        let mut env = Env {
            store: self.store,
            clock: &clock,
            sink: &mut self.sums,
        };
        f(&mut self.pipeline, &mut env)
    }

    pub fn advance_ms(&mut self, ms: u64) {
        self.now
            .set(self.now.get().saturating_add(ms.saturating_mul(MS)));
    }

    /// A new request arrives; returns its stream id and the verdict.
    pub fn arrive(&mut self, req: Req) -> (StreamId, Verdict) {
        let id = StreamId(self.streams.len() as u32);
        self.streams.push((req.clone(), Phase::InFlight));
        let (v, out) = self.call(|p, env| p.request(env, id, &req));
        self.verdict(id.0 as usize, v.clone());
        self.carry_out(out);
        (id, v)
    }

    fn verdict(&mut self, i: usize, v: Verdict) {
        let phase = match v {
            Verdict::Continue => Phase::InFlight,
            Verdict::Pause => Phase::Paused,
            Verdict::Reply(r) => {
                self.refusals.push(r);
                Phase::Answered
            }
        };
        if let Some(s) = self.streams.get_mut(i) {
            s.1 = phase;
        }
    }

    /// Carries out an outcome's effects and keeps its calls.
    pub fn carry_out(&mut self, out: Outcome) {
        self.calls.extend(out.calls.iter().map(|c| c.id));
        for e in out.effects {
            match e {
                Effect::Reply { stream, rejection } => {
                    self.refusals.push(rejection);
                    self.set_phase(stream, Phase::Answered);
                }
                Effect::Resume { stream } => self.go_on(stream, true),
                Effect::Again { stream } => self.go_on(stream, false),
            }
        }
    }

    fn set_phase(&mut self, id: StreamId, phase: Phase) {
        let s = self.streams.get_mut(id.0 as usize);
        let s = s.unwrap_or_else(|| panic!("an effect on unknown stream {id}"));
        assert_eq!(s.1, Phase::Paused, "an effect on stream {id} not paused");
        s.1 = phase;
    }

    fn go_on(&mut self, id: StreamId, resume: bool) {
        self.set_phase(id, Phase::InFlight);
        let req = self.streams[id.0 as usize].0.clone();
        let (v, out) = self.call(|p, env| {
            if resume {
                p.resume(env, id, &req)
            } else {
                p.again(env, id, &req)
            }
        });
        self.verdict(id.0 as usize, v);
        self.carry_out(out);
    }

    /// Stream `id` gets a response of `status` (if in flight) and ends.
    pub fn finish(&mut self, id: StreamId, status: u32, headers: Vec<(String, Vec<u8>)>) {
        let Some(&(_, phase)) = self.streams.get(id.0 as usize) else {
            return;
        };
        if phase == Phase::Ended {
            return;
        }
        if phase == Phase::InFlight {
            let resp = Resp { status, headers };
            let (_, out) = self.call(|p, env| p.response(env, id, &resp));
            self.carry_out(out);
        }
        self.streams[id.0 as usize].1 = Phase::Ended;
        let out = self.call(|p, env| p.end(env, id));
        self.carry_out(out);
    }

    pub fn tick(&mut self) {
        let out = self.call(|p, env| p.tick(env));
        self.carry_out(out);
    }

    /// Answers the oldest RLS call asked for with `body`.
    pub fn answer_call(&mut self, body: Option<&[u8]>) -> bool {
        if self.calls.is_empty() {
            return false;
        }
        let id = self.calls.remove(0);
        let out = self.call(|p, env| p.call_done(env, id, body));
        self.carry_out(out);
        true
    }

    /// Ends every stream and closes the pipeline: nothing stays held.
    pub fn wind_down(&mut self) {
        for id in 0..self.streams.len() {
            self.finish(StreamId(id as u32), 200, Vec::new());
        }
        let out = self.call(|p, env| p.close(env));
        self.carry_out(out);
        for id in 0..self.streams.len() {
            assert!(
                !self.pipeline.holds(StreamId(id as u32)),
                "stream {id} still held"
            );
        }
    }
}

/// Takes bytes off the front of a fuzzer's input.
pub struct Input<'a>(pub &'a [u8]);

impl<'a> Input<'a> {
    pub fn byte(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    /// A length-prefixed piece (one byte of length).
    pub fn piece(&mut self) -> &'a [u8] {
        let n = (self.byte() as usize).min(self.0.len());
        let (p, rest) = self.0.split_at(n);
        self.0 = rest;
        p
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
