//! Where the counters live: in this process's memory, or in Redis (shared
//! by every server pointed at it).
//!
//! One operation: add hits to a set of counters and read each one's new
//! value, every counter expiring a given number of seconds after its last
//! increment (the length of its window, as envoyproxy/ratelimit sets it).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

/// One counter to increase: its key, the hits to add, its expiry in seconds.
pub struct Incr {
    pub key: String,
    pub hits: u64,
    pub ttl_s: u64,
}

pub enum Store {
    Memory(MemoryStore),
    Redis(RedisStore),
}

impl Store {
    /// Adds every `Incr`'s hits and returns the counters' new values, in
    /// order; all or nothing (Redis: one MULTI/EXEC transaction).
    pub async fn incr(&self, ops: &[Incr], now_s: u64) -> Result<Vec<u64>, String> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Store::Memory(m) => Ok(m.incr(ops, now_s)),
            Store::Redis(r) => r.incr(ops).await,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}

/// Counters in a map, each with the second it expires at; expired ones are
/// swept every `SWEEP_EVERY` calls so that memory follows the live keys.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Default)]
struct MemoryInner {
    counters: HashMap<String, (u64, u64)>,
    calls: u64,
}

const SWEEP_EVERY: u64 = 1024;

impl MemoryStore {
    fn incr(&self, ops: &[Incr], now_s: u64) -> Vec<u64> {
        // A panic elsewhere while holding the lock cannot leave a counter
        // half-written (each update is one assignment): keep going.
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.calls += 1;
        if inner.calls.is_multiple_of(SWEEP_EVERY) {
            inner.counters.retain(|_, (_, expires)| *expires > now_s);
        }
        ops.iter()
            .map(|op| {
                let slot = inner.counters.entry(op.key.clone()).or_insert((0, 0));
                if slot.1 <= now_s {
                    slot.0 = 0;
                }
                slot.0 = slot.0.saturating_add(op.hits);
                slot.1 = now_s.saturating_add(op.ttl_s);
                slot.0
            })
            .collect()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().map(|i| i.counters.len()).unwrap_or(0)
    }
}

/// One multiplexed connection, opened on first use and dropped on any
/// error so that the next call reconnects (a Redis restarted on the same
/// address is picked up again). Every Redis round trip is bounded by
/// `timeout`.
pub struct RedisStore {
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    timeout: Duration,
}

impl RedisStore {
    pub fn new(url: &str, timeout: Duration) -> Result<RedisStore, String> {
        let client = redis::Client::open(url).map_err(|e| format!("--redis-url {url}: {e}"))?;
        Ok(RedisStore {
            client,
            conn: tokio::sync::Mutex::new(None),
            timeout,
        })
    }

    async fn connection(&self) -> Result<MultiplexedConnection, String> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = tokio::time::timeout(
            self.timeout,
            self.client.get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(self.timeout)
                    .set_response_timeout(self.timeout),
            ),
        )
        .await
        .map_err(|_| "redis: connect timed out".to_string())?
        .map_err(|e| format!("redis: {e}"))?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn forget_connection(&self) {
        *self.conn.lock().await = None;
    }

    async fn incr(&self, ops: &[Incr]) -> Result<Vec<u64>, String> {
        let mut conn = self.connection().await?;
        // INCRBY then EXPIRE for each key, in one transaction, as
        // envoyproxy/ratelimit pipelines them.
        let mut pipe = redis::pipe();
        pipe.atomic();
        for op in ops {
            pipe.cmd("INCRBY").arg(&op.key).arg(op.hits);
            pipe.cmd("EXPIRE").arg(&op.key).arg(op.ttl_s).ignore();
        }
        let result = tokio::time::timeout(self.timeout, pipe.query_async::<Vec<u64>>(&mut conn))
            .await
            .map_err(|_| "redis: timed out".to_string())
            .and_then(|r| r.map_err(|e| format!("redis: {e}")));
        match result {
            Ok(values) if values.len() == ops.len() => Ok(values),
            Ok(values) => {
                self.forget_connection().await;
                Err(format!(
                    "redis: {} values for {} counters",
                    values.len(),
                    ops.len()
                ))
            }
            Err(e) => {
                self.forget_connection().await;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(key: &str, hits: u64, ttl_s: u64) -> Incr {
        Incr {
            key: key.into(),
            hits,
            ttl_s,
        }
    }

    #[test]
    fn memory_counts_and_expires() {
        let m = MemoryStore::default();
        assert_eq!(m.incr(&[op("a", 1, 60), op("b", 5, 60)], 100), vec![1, 5]);
        assert_eq!(m.incr(&[op("a", 2, 60)], 159), vec![3]);
        // Expired at 100 + 60 (last increment at 159 moved it to 219).
        assert_eq!(m.incr(&[op("b", 1, 60)], 160), vec![1]);
        assert_eq!(m.incr(&[op("a", 0, 60)], 219), vec![0]);
    }

    #[test]
    fn memory_sweeps_expired_counters() {
        let m = MemoryStore::default();
        for i in 0..SWEEP_EVERY - 1 {
            m.incr(&[op(&format!("k{i}"), 1, 1)], 10);
        }
        assert_eq!(m.len(), (SWEEP_EVERY - 1) as usize);
        m.incr(&[op("late", 1, 1)], 20);
        assert_eq!(m.len(), 1);
    }
}
