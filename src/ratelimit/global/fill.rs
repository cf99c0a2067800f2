//! The keys' pools in shared data as the leader sees them: the slots a
//! key's pool may be in, which of them is free to take, the end of each
//! call, whose answer (tokens granted, or a block until the reset) is
//! written into the key's pool with CAS, and the unspent tokens a
//! forgotten key leaves. Its own file because it is where the leader
//! writes the tables the limiter spends from.

use super::pool::Pool;
use super::proto;
use super::{CallResult, Coordinator, GlobalRule, Report, RuleId, MAX_KEYS};
use crate::hash::FastMap;
use crate::rng::SplitMix;
use crate::store::{Store, StoreError};
use std::cmp::Reverse;

/// A pool whose key had no demand for this long may be taken by a key
/// that has no slot (ms).
const FRESH_MS: u64 = 5_000;

impl Coordinator {
    /// A key forgotten for want of demand: what its pool still holds is
    /// counted as dropped once its window has ended, now or, if it may
    /// still be spent (should the key come back), at the window's end
    /// ([`Coordinator::settle_ended`]).
    pub(super) fn forget(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (g, fp): (RuleId, u64),
        report: &mut Report,
    ) {
        let Some(rule) = self.rule(g) else {
            return;
        };
        let (keys, tag) = pool_slots(rule, fp);
        match settle(store, (&keys, tag), now_ms) {
            Settled::Dropped(left) => report.dropped.push((g, u64::from(left))),
            Settled::Live { until_ms } if self.ending.len() < MAX_KEYS => {
                self.ending.push(Reverse((until_ms, g, fp)));
            }
            _ => {}
        }
    }

    /// The forgotten keys whose window has ended are settled as
    /// [`Coordinator::forget`] settles them (one whose pool its key refilled
    /// before it went quiet again waits for the new window's end). Not a key
    /// that came back: its next grant counts what its pool left unspent.
    pub(super) fn settle_ended(&mut self, store: &dyn Store, now_ms: u64, report: &mut Report) {
        while let Some(&Reverse((until_ms, g, fp))) = self.ending.peek() {
            if until_ms > now_ms {
                break;
            }
            self.ending.pop();
            if !self.keys.contains_key(&(g, fp)) {
                self.forget(store, now_ms, (g, fp), report);
            }
        }
    }

    /// A call the host could not start, or that ended: `body` is the
    /// response on success, `None` on a gRPC error or timeout.
    pub fn done(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        id: u64,
        body: Option<&[u8]>,
    ) -> Report {
        let mut report = Report::default();
        let Some((g, fp, hits, started_ms)) = self.calls.remove(&id) else {
            return report;
        };
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.inflight = false;
        }
        let Some(rule) = self.rule(g) else {
            return report;
        };
        let svc = rule.service;
        let answer = body.and_then(|b| proto::response(b).ok());
        let (result, status) = match answer {
            Some(r) if r.overall == proto::Code::Ok => (CallResult::Ok, r.status),
            Some(r) if r.overall == proto::Code::OverLimit => (CallResult::OverLimit, r.status),
            _ => (CallResult::Error, proto::Status::default()),
        };
        report.results.push((g, result));
        if let Some(s) = self.services.get_mut(svc) {
            s.record(
                store,
                now_ms,
                rng,
                result != CallResult::Error,
                svc,
                &mut report,
            );
        }
        if result == CallResult::Error {
            return report;
        }
        let call = (g, fp, hits, started_ms);
        self.fill(store, now_ms, call, result, &status, &mut report);
        report
    }

    /// Puts an answer into the key's pool: the tokens granted, or the
    /// block until the reset.
    fn fill(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (g, fp, hits, started_ms): (RuleId, u64, u32, u64),
        result: CallResult,
        status: &proto::Status,
        report: &mut Report,
    ) {
        let Some(rule) = self.rule(g) else {
            return;
        };
        // The service counted the hits at some moment of the call: the
        // window's end is worked out from the call's start, the earliest
        // it may be (the time to the reset then runs from there, and the
        // unit's window is the one the call started in).
        let until = window_end(started_ms, status, rule.window_ms);
        let (slots, tag) = pool_slots(rule, fp);
        // A refused batch is followed by the smallest call made (a single
        // hit, or the dearest request's cost: a server that does not count
        // refused hits may still have a few); that one refused blocks the
        // key until the reset.
        let block = result == CallResult::OverLimit && u64::from(hits) <= rule.cost_max;
        let fresh = fresh(&self.owners, g, now_ms);
        let site = (slots.as_slice(), tag);
        let dropped = match result {
            CallResult::Ok => {
                report.granted.push((g, u64::from(hits)));
                // Granted tokens with nowhere to go are dropped, all of them.
                update_pool(store, site, now_ms, &fresh, |old| {
                    Pool::grant(old, hits, until, now_ms)
                })
                .unwrap_or(u64::from(hits))
            }
            _ if block => update_pool(store, site, now_ms, &fresh, |old| {
                Pool::block(old, until, now_ms)
            })
            .unwrap_or(0),
            _ => 0,
        };
        if dropped > 0 {
            report.dropped.push((g, dropped));
        }
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.remaining = match result {
                CallResult::OverLimit => Some(0),
                _ => status.remaining,
            };
            if block {
                k.blocked_until_ms = until;
            }
        }
    }
}

/// The slot keys and tag of a key's pool: its two slots (one for a key
/// without variable parts), as `keys::place` gives them; the pool is in
/// whichever it holds.
pub(super) fn pool_slots(rule: &GlobalRule, fingerprint: u64) -> (Vec<String>, u32) {
    let p = crate::keys::placement(fingerprint, rule.variable, rule.table_len);
    let keys = p
        .slots()
        .iter()
        .map(|&s| crate::keys::slot_key(&rule.pool_prefix, s))
        .collect();
    (keys, p.pool_tag())
}

/// One of a key's slots as the leader reads it.
pub(super) struct Site {
    cas: Option<u32>,
    slot: Option<crate::ratelimit::codec::Slot>,
}

impl Site {
    fn ours(&self, tag: u32) -> Option<Pool> {
        self.slot
            .filter(|s| s.fingerprint == tag)
            .map(|s| Pool::decode(s.tat))
    }

    /// Free for a new pool: empty, unreadable, another key's pool with
    /// nothing live (no tokens, no block), or the pool of a key without
    /// recent demand (`fresh` says which owners had some); returns the
    /// tokens it held, dropped by taking it.
    fn free(&self, now_ms: u64, fresh: &dyn Fn(u32) -> bool) -> Option<u32> {
        let Some(s) = self.slot else { return Some(0) };
        let p = Pool::decode(s.tat);
        let blocked = p.blocked && now_ms < p.until_ms;
        let dead = p.live(now_ms) == 0 && !blocked;
        (s.fingerprint == 0 || dead || !fresh(s.fingerprint)).then_some(p.tokens)
    }
}

/// Which owners of rule `g`'s pools (by tag) had demand in the last
/// `FRESH_MS`: a slot held by any other key may be taken for a key that
/// has no slot (its tokens are then counted as dropped).
pub(super) fn fresh(
    owners: &FastMap<(RuleId, u32), u64>,
    g: RuleId,
    now_ms: u64,
) -> impl Fn(u32) -> bool + '_ {
    move |tag| {
        owners
            .get(&(g, tag))
            .is_some_and(|&t| now_ms.saturating_sub(t) < FRESH_MS)
    }
}

/// Reads a key's slots.
pub(super) fn read_sites(store: &dyn Store, keys: &[String]) -> Option<Vec<Site>> {
    let mut sites = Vec::with_capacity(keys.len());
    for k in keys {
        let e = store.get(k).ok()?;
        sites.push(Site {
            cas: e.as_ref().and_then(|e| e.cas),
            slot: e.and_then(|e| crate::ratelimit::codec::Slot::decode(&e.bytes).ok()),
        });
    }
    Some(sites)
}

/// The tokens of the key's pool still good, or `None` if it has no pool
/// and no free slot for one (both slots hold other keys' live pools).
pub(super) fn live_tokens(
    sites: &[Site],
    tag: u32,
    now_ms: u64,
    fresh: &dyn Fn(u32) -> bool,
) -> Option<u32> {
    if let Some(p) = sites.iter().find_map(|s| s.ours(tag)) {
        return Some(p.live(now_ms));
    }
    sites.iter().find_map(|s| s.free(now_ms, fresh)).map(|_| 0)
}

/// When tokens granted now stop being good: the end of the service's
/// window, as early as any of its hints puts it (the time to its reset;
/// its unit, windows aligned on the Unix epoch as envoyproxy/ratelimit
/// counts them), else the end of the rule's own window.
pub fn window_end(now_ms: u64, status: &proto::Status, window_ms: u64) -> u64 {
    let mut ends = Vec::with_capacity(2);
    if let Some(r) = status.reset_ms.filter(|&r| r > 0) {
        ends.push(now_ms.saturating_add(r));
    }
    if let Some((_, unit)) = status.limit.filter(|&(_, u)| u > 0) {
        ends.push((now_ms / unit + 1) * unit);
    }
    ends.into_iter().min().unwrap_or_else(|| {
        let w = window_ms.max(1);
        (now_ms / w + 1) * w
    })
}

/// The tokens of a pool whose window has ended (paid for, never spent).
fn expired(state: u128, now_ms: u64) -> u32 {
    let p = Pool::decode(state);
    if now_ms >= p.until_ms {
        p.tokens
    } else {
        0
    }
}

/// What [`settle`] found of a key's pool.
enum Settled {
    /// None of the key's with tokens in it, or the store failed.
    Nothing,
    /// Its window ends at `until_ms`: its tokens may still be spent.
    Live { until_ms: u64 },
    /// Its window had ended: it held these tokens, now taken out of it,
    /// so that nothing counts them again (a later grant, or another key
    /// taking the slot over).
    Dropped(u32),
}

/// Settles a key's pool whose window has ended (see [`Settled`]).
fn settle(store: &dyn Store, (keys, tag): (&[String], u32), now_ms: u64) -> Settled {
    use crate::ratelimit::codec::Slot;
    for _ in 0..16 {
        let Some(sites) = read_sites(store, keys) else {
            return Settled::Nothing;
        };
        let Some((i, pool)) = sites
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.ours(tag).map(|p| (i, p)))
            .filter(|(_, p)| p.tokens > 0)
        else {
            return Settled::Nothing;
        };
        if now_ms < pool.until_ms {
            return Settled::Live {
                until_ms: pool.until_ms,
            };
        }
        let (Some(key), Some(site)) = (keys.get(i), sites.get(i)) else {
            return Settled::Nothing;
        };
        let emptied = Slot {
            fingerprint: tag,
            tat: Pool { tokens: 0, ..pool }.encode(),
        };
        match store.set(key, &emptied.encode(), site.cas) {
            Ok(()) => return Settled::Dropped(pool.tokens),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Unavailable) => return Settled::Nothing,
        }
    }
    Settled::Nothing
}

/// Rewrites a key's pool with CAS, in the slot it holds, or else in a free
/// one: `f` gets the key's pool (`None` for a new one) and returns the new
/// pool and the live tokens it dropped. Returns the tokens dropped (with
/// those of ours that expired unspent, and a dead pool's in a slot taken
/// over), or `None` if no slot could hold it (both hold other keys' live
/// pools) or the store failed.
fn update_pool(
    store: &dyn Store,
    (keys, tag): (&[String], u32),
    now_ms: u64,
    fresh: &dyn Fn(u32) -> bool,
    f: impl Fn(Option<Pool>) -> (Pool, u32),
) -> Option<u64> {
    use crate::ratelimit::codec::Slot;
    for _ in 0..16 {
        let sites = read_sites(store, keys)?;
        let mine = sites.iter().position(|s| s.ours(tag).is_some());
        let (at, old, dead) = match mine {
            Some(i) => {
                let s = sites.get(i)?;
                (i, s.ours(tag), s.slot.map_or(0, |s| expired(s.tat, now_ms)))
            }
            None => {
                let (i, dead) = sites
                    .iter()
                    .enumerate()
                    .find_map(|(i, s)| s.free(now_ms, fresh).map(|d| (i, d)))?;
                (i, None, dead)
            }
        };
        let (pool, dropped) = f(old);
        let new = Slot {
            fingerprint: tag,
            tat: pool.encode(),
        };
        match store.set(keys.get(at)?, &new.encode(), sites.get(at)?.cas) {
            Ok(()) => return Some(u64::from(dropped) + u64::from(dead)),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Unavailable) => return None,
        }
    }
    None
}
