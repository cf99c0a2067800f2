//! The lease: which VM of the Envoy is the leader, the one that speaks to
//! the service. Taken, renewed and given up in shared data, and handed
//! over to the newest configuration's VMs; its own file because whether
//! a VM leads is decided here and nowhere else.

use super::codec::{self, Lease};
use super::{Coordinator, Leading, LEASE_MS};
use crate::store::Store;

impl Coordinator {
    /// Says that this configuration is the newest with these rules (when
    /// it starts): a configuration it replaces gives the lease up to it.
    /// (Not retried on a tick: by then a newer one may have started.) A
    /// follower, or a pipeline built again after a crash, says nothing: it
    /// may be built long after its configuration started, when a newer one
    /// has.
    pub fn announce(&self, store: &dyn Store) {
        if self.leading != Leading::Allowed {
            return;
        }
        let _ = store.set(&self.newest_key, &codec::encode_newest(self.config), None);
    }

    /// Whether this VM holds the lease, as shared data says now.
    pub(super) fn holds_lease(&self, store: &dyn Store, now_ms: u64) -> bool {
        store
            .get(&self.lease_key)
            .ok()
            .flatten()
            .and_then(|e| Lease::decode(&e.bytes).ok())
            .is_some_and(|l| l.owner == self.me && l.until_ms > now_ms)
    }

    /// The newest configuration's version (none if unknown or corrupt).
    fn newest(&self, store: &dyn Store) -> Option<u64> {
        let e = store.get(&self.newest_key).ok()??;
        codec::decode_newest(&e.bytes).ok()
    }

    /// Renews or takes the lease; returns whether this VM holds it.
    ///
    /// A configuration replaced (ECDS) lives on in a VM only for its last
    /// requests, and its calls die with it. So a VM of the newest
    /// configuration takes the lease from an older configuration's VM at
    /// once, and an older configuration's VM takes a free lease only once
    /// it has been free for a whole lease (no VM of the newest is there to).
    pub(super) fn hold_lease(&self, store: &dyn Store, now_ms: u64) -> bool {
        let (current, cas) = match store.get(&self.lease_key) {
            Ok(Some(e)) => (Lease::decode(&e.bytes).ok(), e.cas),
            Ok(None) => (None, None),
            Err(_) => return false,
        };
        if let Some(l) = current.filter(|l| l.owner != self.me) {
            let take = if l.until_ms > now_ms {
                l.config != self.config && self.newest(store) == Some(self.config)
            } else {
                now_ms >= l.until_ms.saturating_add(LEASE_MS)
                    || self.newest(store).is_none_or(|n| n == self.config)
            };
            if !take {
                return false;
            }
        }
        let lease = Lease {
            owner: self.me,
            until_ms: now_ms + LEASE_MS,
            config: self.config,
        };
        store.set(&self.lease_key, &lease.encode(), cas).is_ok()
    }

    /// Gives the lease up (the configuration is going away): free from
    /// now on.
    pub fn resign(&mut self, store: &dyn Store, now_ms: u64) {
        if !self.leader {
            return;
        }
        self.leader = false;
        if let Ok(Some(e)) = store.get(&self.lease_key) {
            if let Ok(mut l) = Lease::decode(&e.bytes) {
                if l.owner == self.me {
                    l.until_ms = now_ms;
                    let _ = store.set(&self.lease_key, &l.encode(), e.cas);
                }
            }
        }
    }
}
