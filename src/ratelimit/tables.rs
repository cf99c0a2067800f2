//! The slot tables: each rule's table id and key prefix, creating the
//! tables at configuration, switching a global rule between its pools
//! and its backstop, and the tag written with a key's state. Its own
//! file because it decides where state lives in shared data, which the
//! transaction (`evaluate.rs`, `commit.rs`) only reads and writes.

use super::algorithm::Algorithm;
use super::codec::{self, Slot};
use super::config::RuleSpec;
use super::{GlobalTables, Limiter, Rule, MAX_GLOBAL_RULES};
use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::keys::{MissingKey, Placement};
use crate::store::{SlotKey, Store, StoreError};

/// The kind of a rate-limit table's slot keys (`sl1f2e3d4c/12345`).
const KIND: [u8; 2] = *b"sl";

/// A stable 32-bit identifier of a rule's table: a changed rule gets a
/// fresh table; an unchanged one keeps its state across reconfiguration.
/// Short on purpose: slot keys such as `sl1f2e3d4c/12345` fit Envoy's
/// short-string buffer, which halves the memory of a slot.
fn table_id(domain: &str, spec: &RuleSpec) -> u32 {
    let mut id = StateId::new((0x736c_7569_6365, 0x7275_6c65), domain).text(&spec.name);
    id = match spec.algorithm {
        // A bucket's id has no algorithm tag: its table stays the same
        // across sluice versions that add other algorithms.
        Algorithm::Bucket(b) => id.num(b.rate).num(b.period_ns).num(b.burst),
        Algorithm::Window(w) => id.text("sliding_window").num(w.limit).num(w.window_ns),
        Algorithm::Pool(p) => {
            let g = spec.global.as_deref().map(|g| &g.service);
            let mut id = id
                .text("global")
                .num(p.quota)
                .num(p.window_ns)
                .text(g.map_or("", |g| g.cluster.as_str()))
                .text(g.and_then(|g| g.domain.as_deref()).unwrap_or(domain));
            // Tokens were paid for under these descriptor names.
            for k in g.map_or(&[][..], |g| g.descriptor_keys.as_slice()) {
                id = id.text(k);
            }
            id
        }
    };
    for part in &spec.key {
        id = id.text(part.encode());
    }
    let missing = match spec.on_missing_key {
        MissingKey::Skip => 0,
        MissingKey::Shared => 1,
    };
    id.num(missing).num(u64::from(spec.max_keys)).finish()
}

impl Limiter {
    /// Prepares a limiter; `seed` must be the same in every VM. Fails only
    /// if two rules' table ids collide (about one chance in four billion
    /// per pair), naming the rule to rename.
    pub fn new(specs: &[RuleSpec], common: &Common, seed: (u64, u64)) -> Result<Self, ConfigError> {
        let mut rules: Vec<Rule> = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let table = table_id(&common.domain, spec);
            let prefix = SlotKey::prefix(KIND, table);
            let earlier = rules
                .iter()
                .map(|r| (r.prefix.as_str(), r.spec.name.as_str()));
            check_state_id("rate_limits", i, &prefix, earlier)?;
            let globals = rules.iter().filter(|r| r.global.is_some()).count();
            if spec.global.is_some() && globals >= MAX_GLOBAL_RULES {
                return Err(crate::config::fields::err(
                    format!("rate_limits[{i}].global"),
                    format!("at most {MAX_GLOBAL_RULES} global rules in one configuration"),
                ));
            }
            let global = spec.global.as_deref().map(|g| {
                let mut backstop = spec.clone();
                backstop.algorithm = g.backstop;
                backstop.name.push_str("/backstop");
                let backstop_table = table_id(&common.domain, &backstop);
                GlobalTables {
                    pool_prefix: prefix.clone(),
                    pool_table: table,
                    pool: spec.algorithm,
                    backstop_prefix: SlotKey::prefix(KIND, backstop_table),
                    backstop_table,
                    backstop: g.backstop,
                }
            });
            rules.push(Rule {
                // (A key without variable parts has one slot.)
                fixed: crate::keys::fixed_placement(&spec.key, seed, 1),
                prefix,
                table,
                spec: spec.clone(),
                global,
            });
        }
        let lone = match rules.as_slice() {
            [r] => {
                r.global.is_none()
                    && r.spec.shaping.is_none()
                    && !matches!(r.spec.algorithm, Algorithm::Pool(_))
            }
            _ => false,
        };
        Ok(Limiter {
            lone,
            rules,
            seed,
            max_retries: common.max_cas_retries,
            failure_mode_deny: common.failure_mode_deny,
        })
    }

    /// The shared-data key of a rule's slot.
    pub fn slot_key(&self, rule: usize, slot: u32) -> String {
        let prefix = self.rules.get(rule).map_or("", |r| r.prefix.as_str());
        crate::keys::slot_key(prefix, slot)
    }

    /// The same key, as numbers.
    pub(super) fn slot(&self, rule: usize, slot: u32) -> SlotKey {
        SlotKey {
            kind: KIND,
            table: self.rules.get(rule).map_or(0, |r| r.table),
            slot,
        }
    }

    /// How many slots the rule's table really uses (1 for constant keys).
    pub fn table_len(&self, rule: usize) -> u32 {
        let Some(Rule { spec, .. }) = self.rules.get(rule) else {
            return 1;
        };
        if crate::keys::has_variable_parts(&spec.key) {
            spec.max_keys
        } else {
            1
        }
    }

    /// Creates every missing slot as a full bucket. Run at configuration in
    /// every VM; Envoy configures the main thread's VM before any worker
    /// serves a request, so workers only ever find slots already present.
    /// Returns how many slots this call created.
    pub fn create_tables(&self, store: &dyn Store) -> Result<u32, StoreError> {
        let mut created = 0;
        for (i, rule) in self.rules.iter().enumerate() {
            let len = self.table_len(i);
            created += Self::create_table(store, &rule.prefix, len)?;
            if let Some(g) = &rule.global {
                for prefix in [&g.pool_prefix, &g.backstop_prefix] {
                    if *prefix != rule.prefix {
                        created += Self::create_table(store, prefix, len)?;
                    }
                }
            }
        }
        Ok(created)
    }

    /// Serves global rule `rule` from its backstop (`true`) or from its
    /// pools (`false`).
    pub fn use_backstop(&mut self, rule: usize, on: bool) {
        let Some(r) = self.rules.get_mut(rule) else {
            return;
        };
        let Some(g) = &r.global else { return };
        let (prefix, table, algorithm) = if on {
            (&g.backstop_prefix, g.backstop_table, g.backstop)
        } else {
            (&g.pool_prefix, g.pool_table, g.pool)
        };
        r.prefix.clone_from(prefix);
        r.table = table;
        r.spec.algorithm = algorithm;
    }

    /// Creates one rule's missing slots, unless its table is marked
    /// complete: then one read is all a configuration costs, whatever
    /// `max_keys` (every VM configures on every update, and a table of a
    /// million slots took seconds to check).
    fn create_table(store: &dyn Store, prefix: &str, len: u32) -> Result<u32, StoreError> {
        let marker_key = format!("{prefix}complete");
        let marker = codec::table_marker(len);
        if let Some(found) = store.get(&marker_key)? {
            if found.bytes == marker {
                return Ok(0);
            }
        }
        let empty = Slot {
            fingerprint: 0,
            tat: 0,
        }
        .encode();
        let mut created = 0;
        for slot in 0..len {
            let key = crate::keys::slot_key(prefix, slot);
            if store.get(&key)?.is_none() {
                store.set(&key, &empty, None)?;
                created += 1;
            }
        }
        store.set(&marker_key, &marker, None)?;
        Ok(created)
    }

    /// The tag written with a key's state: a pool's comes from other bits
    /// of the hash than its first slot.
    pub(super) fn tag(algorithm: &Algorithm, placement: &Placement) -> u32 {
        match algorithm {
            Algorithm::Pool(_) => placement.pool_tag(),
            _ => placement.tag(),
        }
    }
}
