//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, counted
//! as envoyproxy/ratelimit counts:
//!
//! - each descriptor's limit is looked up in the configuration (or taken
//!   from the descriptor's `limit` override); no limit: `OK`, no counter;
//! - fixed windows aligned to the unit: the counter key is
//!   `domain_key1_value1_..._keyN_valueN_<window start>`, window start =
//!   `now / unit_seconds * unit_seconds`, expiring one unit after its last
//!   increment;
//! - the hits (the descriptor's `hits_addend` if set, else the request's,
//!   0 meaning 1) are added to every limited descriptor's counter *first*,
//!   then compared: a refused request's hits are counted too, and the
//!   other descriptors of a refused request are charged as well;
//! - a descriptor is `OVER_LIMIT` when its counter exceeds
//!   `requests_per_unit`; the response is `OVER_LIMIT` if any is;
//! - each status has the limit, the remaining count (0 when over) and the
//!   seconds to the end of the window.
//!
//! A store failure is answered with gRPC `UNAVAILABLE` (envoyproxy/ratelimit
//! answers a gRPC error too), which Envoy's filter treats as an error
//! (`failure_mode_deny` decides).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::{Request, Response, Status};

use crate::config::{Config, Limit, Unit};
use crate::store::{Incr, Store};

/// What the server has seen, for tests (`GET /stats`).
#[derive(Default)]
pub struct Stats {
    /// ShouldRateLimit calls received.
    pub calls: AtomicU64,
    /// Descriptors received, limited or not.
    pub descriptors: AtomicU64,
    /// Hits added to counters (descriptors with a limit only).
    pub hits: AtomicU64,
    /// Calls answered OK / OVER_LIMIT / with a gRPC error.
    pub ok: AtomicU64,
    pub over_limit: AtomicU64,
    pub errors: AtomicU64,
}

impl Stats {
    pub fn json(&self) -> String {
        serde_json::json!({
            "calls": self.calls.load(Relaxed),
            "descriptors": self.descriptors.load(Relaxed),
            "hits": self.hits.load(Relaxed),
            "ok": self.ok.load(Relaxed),
            "over_limit": self.over_limit.load(Relaxed),
            "errors": self.errors.load(Relaxed),
        })
        .to_string()
    }
}

pub struct Service {
    pub config: Config,
    pub store: Store,
    pub delay: Duration,
    pub stats: Arc<Stats>,
}

/// Counters to increase for a request and, for each descriptor, the index
/// of its counter and its limit (None: no limit).
struct Plan {
    incrs: Vec<Incr>,
    limited: Vec<Option<(usize, Limit)>>,
}

impl Service {
    fn plan(&self, req: &RateLimitRequest, now_s: u64) -> Plan {
        let request_hits = u64::from(req.hits_addend.max(1));
        let mut plan = Plan {
            incrs: Vec::new(),
            limited: Vec::with_capacity(req.descriptors.len()),
        };
        for d in &req.descriptors {
            let Some(limit) = self.limit_for(&req.domain, d) else {
                plan.limited.push(None);
                continue;
            };
            let unit_s = limit.unit.seconds();
            let hits = d.hits_addend.as_ref().map_or(request_hits, |h| h.value);
            plan.incrs.push(Incr {
                key: cache_key(&req.domain, d, now_s / unit_s * unit_s),
                hits,
                ttl_s: unit_s,
            });
            plan.limited.push(Some((plan.incrs.len() - 1, limit)));
        }
        plan
    }

    fn limit_for(&self, domain: &str, d: &RateLimitDescriptor) -> Option<Limit> {
        if let Some(o) = &d.limit {
            // Envoy's per-descriptor override, as envoyproxy/ratelimit
            // honours it (for a configured domain only).
            if !self.config.has_domain(domain) {
                return None;
            }
            return Unit::from_proto(o.unit).map(|unit| Limit {
                name: String::new(),
                requests_per_unit: o.requests_per_unit,
                unit,
            });
        }
        let entries: Vec<(&str, &str)> = d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        self.config.find(domain, &entries).cloned()
    }

    pub async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        let now_s = unix_now_s();
        let plan = self.plan(req, now_s);
        let counts = self.store.incr(&plan.incrs, now_s).await.map_err(|e| {
            Status::unavailable(format!("counter store ({}): {e}", self.store.name()))
        })?;
        let hits: u64 = plan.incrs.iter().map(|i| i.hits).sum();
        self.stats.hits.fetch_add(hits, Relaxed);
        Ok(respond(&plan, &counts, now_s))
    }
}

fn respond(plan: &Plan, counts: &[u64], now_s: u64) -> RateLimitResponse {
    let mut overall = Code::Ok;
    let statuses = plan
        .limited
        .iter()
        .map(|l| match l {
            None => DescriptorStatus {
                code: Code::Ok.into(),
                ..Default::default()
            },
            Some((i, limit)) => {
                let count = counts.get(*i).copied().unwrap_or(u64::MAX);
                let max = u64::from(limit.requests_per_unit);
                let code = if count > max {
                    overall = Code::OverLimit;
                    Code::OverLimit
                } else {
                    Code::Ok
                };
                let unit_s = limit.unit.seconds();
                DescriptorStatus {
                    code: code.into(),
                    current_limit: Some(RateLimit {
                        name: limit.name.clone(),
                        requests_per_unit: limit.requests_per_unit,
                        unit: limit.unit.proto(),
                    }),
                    limit_remaining: u32::try_from(max.saturating_sub(count)).unwrap_or(u32::MAX),
                    duration_until_reset: Some(PbDuration {
                        seconds: i64::try_from(unit_s - now_s % unit_s).unwrap_or(i64::MAX),
                        nanos: 0,
                    }),
                    ..Default::default()
                }
            }
        })
        .collect();
    RateLimitResponse {
        overall_code: overall.into(),
        statuses,
        ..Default::default()
    }
}

/// envoyproxy/ratelimit's cache key: `domain_` then `key_value_` per entry,
/// then the window's start in Unix seconds.
pub fn cache_key(domain: &str, d: &RateLimitDescriptor, window_start_s: u64) -> String {
    let mut k = String::with_capacity(64);
    k.push_str(domain);
    k.push('_');
    for e in &d.entries {
        k.push_str(&e.key);
        k.push('_');
        k.push_str(&e.value);
        k.push('_');
    }
    k.push_str(&window_start_s.to_string());
    k
}

fn unix_now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        self.stats.calls.fetch_add(1, Relaxed);
        self.stats
            .descriptors
            .fetch_add(req.descriptors.len() as u64, Relaxed);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        match self.decide(&req).await {
            Ok(resp) => {
                let counter = if resp.overall_code == i32::from(Code::OverLimit) {
                    &self.stats.over_limit
                } else {
                    &self.stats.ok
                };
                counter.fetch_add(1, Relaxed);
                Ok(Response::new(resp))
            }
            Err(status) => {
                self.stats.errors.fetch_add(1, Relaxed);
                eprintln!("sluice-rls: ShouldRateLimit failed: {}", status.message());
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::google::protobuf::UInt64Value;

    const CONFIG: &str = r#"{"domain": "d", "descriptors": [
        {"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 3}},
        {"key": "path", "rate_limit": {"unit": "hour", "requests_per_unit": 10}}]}"#;

    fn service() -> Service {
        Service {
            config: Config::parse(CONFIG).unwrap(),
            store: Store::Memory(MemoryStore::default()),
            delay: Duration::ZERO,
            stats: Arc::default(),
        }
    }

    fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
        RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: hits,
        }
    }

    async fn call(s: &Service, r: &RateLimitRequest) -> RateLimitResponse {
        s.should_rate_limit(Request::new(r.clone()))
            .await
            .unwrap()
            .into_inner()
    }

    const OK: i32 = Code::Ok as i32;
    const OVER: i32 = Code::OverLimit as i32;

    #[tokio::test]
    async fn admits_the_limit_then_refuses_per_value() {
        let s = service();
        let a = req("d", vec![desc(&[("user", "a")])], 0);
        let mut remaining = vec![];
        for _ in 0..3 {
            let r = call(&s, &a).await;
            assert_eq!(r.overall_code, OK);
            remaining.push(r.statuses[0].limit_remaining);
        }
        assert_eq!(remaining, vec![2, 1, 0]);
        let r = call(&s, &a).await;
        assert_eq!(r.overall_code, OVER);
        let st = &r.statuses[0];
        assert_eq!((st.code, st.limit_remaining), (OVER, 0));
        let limit = st.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (3, Unit::Minute.proto())
        );
        let reset = st.duration_until_reset.as_ref().unwrap().seconds;
        assert!((1..=60).contains(&reset), "{reset}");
        // Another value has its own counter.
        let b = req("d", vec![desc(&[("user", "b")])], 0);
        assert_eq!(call(&s, &b).await.overall_code, OK);
        let json: serde_json::Value = serde_json::from_str(&s.stats.json()).unwrap();
        assert_eq!(
            (
                &json["calls"],
                &json["over_limit"],
                &json["hits"],
                &json["ok"]
            ),
            (&5.into(), &1.into(), &5.into(), &4.into()),
            "{json}"
        );
    }

    #[tokio::test]
    async fn refused_hits_are_counted_and_every_descriptor_is_charged() {
        let s = service();
        let both = req("d", vec![desc(&[("user", "a")]), desc(&[("path", "/")])], 2);
        assert_eq!(call(&s, &both).await.overall_code, OK); // user 2/3, path 2/10
        let r = call(&s, &both).await; // user 4/3: over; path 4/10 charged anyway
        assert_eq!(r.overall_code, OVER);
        assert_eq!((r.statuses[0].code, r.statuses[1].code), (OVER, OK));
        assert_eq!(r.statuses[1].limit_remaining, 6);
        // The refused hits stay counted: one more hit is still over.
        let one = req("d", vec![desc(&[("user", "a")])], 0);
        assert_eq!(call(&s, &one).await.overall_code, OVER);
    }

    #[tokio::test]
    async fn descriptor_hits_addend_overrides_the_request_one() {
        let s = service();
        let mut d = desc(&[("user", "a")]);
        d.hits_addend = Some(UInt64Value { value: 3 });
        let r = call(&s, &req("d", vec![d.clone()], 1)).await;
        assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));
        d.hits_addend = Some(UInt64Value { value: 0 }); // a look without spending
        assert_eq!(call(&s, &req("d", vec![d], 1)).await.overall_code, OK);
        assert_eq!(
            call(&s, &req("d", vec![desc(&[("user", "a")])], 0))
                .await
                .overall_code,
            OVER
        );
    }

    #[tokio::test]
    async fn no_limit_is_ok_without_a_current_limit() {
        let s = service();
        for r in [
            req("d", vec![desc(&[("other", "x")])], 0),
            req("unknown", vec![desc(&[("user", "a")])], 0),
        ] {
            let resp = call(&s, &r).await;
            assert_eq!(resp.overall_code, OK);
            assert_eq!(resp.statuses.len(), 1);
            assert_eq!(resp.statuses[0].code, OK);
            assert!(resp.statuses[0].current_limit.is_none());
        }
        assert_eq!(s.stats.hits.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn descriptor_limit_override_is_honoured() {
        let s = service();
        let mut d = desc(&[("anything", "x")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 1,
            unit: Unit::Second.proto(),
        });
        let r = req("d", vec![d], 0);
        let first = call(&s, &r).await;
        let second = call(&s, &r).await;
        // Two calls may straddle a second: at least one of the pair is OK,
        // and within one window the second is refused.
        assert_eq!(first.overall_code, OK);
        if first.statuses[0].duration_until_reset == second.statuses[0].duration_until_reset {
            assert_eq!(second.overall_code, OVER);
        }
    }

    #[tokio::test]
    async fn bad_requests_are_grpc_errors() {
        let s = service();
        let e = s
            .should_rate_limit(Request::new(req("", vec![desc(&[("user", "a")])], 0)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = s
            .should_rate_limit(Request::new(req("d", vec![], 0)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(s.stats.errors.load(Relaxed), 2);
    }

    #[tokio::test]
    async fn redis_down_is_unavailable() {
        // Port 1: nothing listens there.
        let store =
            crate::store::RedisStore::new("redis://127.0.0.1:1", Duration::from_millis(500))
                .unwrap();
        let s = Service {
            store: Store::Redis(store),
            ..service()
        };
        let e = s
            .should_rate_limit(Request::new(req("d", vec![desc(&[("user", "a")])], 0)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        // A descriptor without a limit needs no store.
        let r = call(&s, &req("d", vec![desc(&[("other", "a")])], 0)).await;
        assert_eq!(r.overall_code, OK);
    }

    #[test]
    fn cache_key_is_envoyproxy_ratelimits() {
        let d = desc(&[("tenant", "gold"), ("user", "a")]);
        assert_eq!(
            cache_key("d", &d, 1_700_000_040),
            "d_tenant_gold_user_a_1700000040"
        );
    }
}
