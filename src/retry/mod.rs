//! Retry budgets: requests that are retries are admitted only while they
//! stay within `ratio` of the first tries over a rolling window, plus a
//! minimum rate so that a quiet service can still retry, shared across
//! Envoy's workers. A retry storm cannot keep a recovering service in a
//! metastable overload: once the budget is spent, retries are refused at
//! once (never queued) until first tries earn it back.
//!
//! The rolling window is two fixed windows weighted by their overlap with
//! it (a sliding-window counter). First tries are counted in each VM and
//! merged into the shared state on every tick and with every retry the VM
//! decides, so the ratio lags by a tick at most; each retry is decided on
//! the shared state by compare-and-swap, so two workers never spend the same
//! allowance. A failing store lets retries through (fail open), counted.

pub mod codec;
pub mod config;
pub mod reply;
pub mod stage;
#[cfg(test)]
mod tests;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::request::RequestView;
use crate::store::{update, Store, StoreError, Update};
use config::BudgetSpec;

/// A budget's shared counts: first tries and retries admitted in the
/// current fixed window (`window`, in units of the budget's window since
/// the epoch) and in the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub window: u64,
    pub tries: u64,
    pub retries: u64,
    pub prev_tries: u64,
    pub prev_retries: u64,
}

impl Counts {
    /// The counts as of fixed window `window` (later windows start empty;
    /// an earlier `window`, from a clock behind, changes nothing).
    pub fn at(self, window: u64) -> Counts {
        if window <= self.window {
            self
        } else if window == self.window + 1 {
            Counts {
                window,
                prev_tries: self.tries,
                prev_retries: self.retries,
                ..Counts::default()
            }
        } else {
            Counts {
                window,
                ..Counts::default()
            }
        }
    }

    /// First tries and retries over the rolling window ending at `now_ms`,
    /// both multiplied by `window_ms` (the previous fixed window counts for
    /// the part of it still inside the rolling window).
    fn rolling(&self, now_ms: u64, window_ms: u64) -> (u128, u128) {
        let w = u128::from(window_ms);
        let left = w - u128::from(now_ms % window_ms);
        let tries = u128::from(self.prev_tries) * left + u128::from(self.tries) * w;
        let retries = u128::from(self.prev_retries) * left + u128::from(self.retries) * w;
        (tries, retries)
    }
}

/// Whether one more retry fits: retries (this one included) at most
/// `ratio` of the first tries plus `min_per_second` for each second of
/// the window, over the rolling window.
pub fn fits(spec: &BudgetSpec, c: &Counts, now_ms: u64) -> bool {
    let w = u128::from(spec.window_ms);
    let (tries, retries) = c.rolling(now_ms, spec.window_ms);
    // Everything times window_ms x 1000 (the ratio is in permille, the
    // minimum per second: min x window_ms / 1000 retries).
    let lhs = 1000 * (retries + w);
    let rhs = u128::from(spec.ratio_permille) * tries + u128::from(spec.min_per_second) * w * w;
    lhs <= rhs
}

/// Retries per 1,000 first tries over the rolling window (no first try
/// counts as one: the figure stays in retries, whatever the window).
pub fn ratio_permille(c: &Counts, now_ms: u64, window_ms: u64) -> u64 {
    let (tries, retries) = c.rolling(now_ms, window_ms);
    let one = u128::from(window_ms).max(1);
    u64::try_from(retries * 1000 / tries.max(one)).unwrap_or(u64::MAX)
}

/// A budget and its shared-data key.
#[derive(Debug, Clone)]
pub struct Budget {
    pub spec: BudgetSpec,
    pub key: String,
}

/// A retry's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryVerdict {
    /// Within the budget (or the store failed: fail open).
    Admit,
    /// Over the budget: refuse it now.
    Refuse,
}

/// All retry budgets of one configuration, in one VM.
pub struct Budgets {
    pub rules: Vec<Budget>,
    /// First tries counted here and not yet merged into the shared state.
    pending: Vec<u64>,
    max_retries: u32,
}

fn state_id(domain: &str, spec: &BudgetSpec) -> u32 {
    StateId::new((0x0072_6574_7279, 0x6275_6467), domain)
        .text(&spec.name)
        .num(spec.window_ms)
        .finish()
}

impl Budgets {
    pub fn new(specs: &[BudgetSpec], common: &Common) -> Result<Self, ConfigError> {
        let mut rules: Vec<Budget> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let key = format!("rb{:08x}", state_id(&common.domain, spec));
            let earlier = rules.iter().map(|r| (r.key.as_str(), r.spec.name.as_str()));
            check_state_id("retry_budgets", i, &key, earlier)?;
            rules.push(Budget {
                spec: spec.clone(),
                key,
            });
        }
        Ok(Budgets {
            pending: vec![0; rules.len()],
            rules,
            max_retries: common.max_cas_retries,
        })
    }

    /// Creates the shared entries (at configuration): a missing key cannot
    /// be created by compare-and-swap without racing another worker.
    pub fn create(&self, store: &dyn Store) -> Result<(), StoreError> {
        for r in &self.rules {
            if store.get(&r.key)?.is_none() {
                store.set(&r.key, &codec::encode(&Counts::default()), None)?;
            }
        }
        Ok(())
    }

    /// Whether the request is a retry for budget `b`.
    pub fn is_retry(&self, b: usize, req: &dyn RequestView) -> bool {
        let Some(r) = self.rules.get(b) else {
            return false;
        };
        r.spec.retry_signs.iter().any(|s| {
            req.header(&s.header).is_some_and(|v| {
                crate::request::first_value(&v)
                    .and_then(crate::request::count)
                    .is_some_and(|n| n > s.above)
            })
        })
    }

    /// Counts a first try (merged into the shared state later).
    pub fn first_try(&mut self, b: usize) {
        if let Some(p) = self.pending.get_mut(b) {
            *p += 1;
        }
    }

    /// Decides on a retry; returns the verdict, the ratio of retries to
    /// first tries it saw, in permille, and the store failures it met (a
    /// corrupt state replaced; an update that failed, which admits it).
    pub fn retry(&mut self, store: &dyn Store, now_ms: u64, b: usize) -> (RetryVerdict, u64, u32) {
        let Some(spec) = self.rules.get(b).map(|r| r.spec.clone()) else {
            return (RetryVerdict::Admit, 0, 0);
        };
        match self.change(store, now_ms, b, true) {
            (Ok((admitted, c)), failures) => {
                let verdict = if admitted {
                    RetryVerdict::Admit
                } else {
                    RetryVerdict::Refuse
                };
                (
                    verdict,
                    ratio_permille(&c, now_ms, spec.window_ms),
                    failures,
                )
            }
            (Err(_), failures) => (RetryVerdict::Admit, 0, failures + 1),
        }
    }

    /// Takes back a retry budget `b` admitted at `charged_ms` that a later
    /// budget refused (it never went out): one retry less in the window
    /// it was counted in, if that is still kept. Returns the store
    /// failures met.
    pub fn give_back(&mut self, store: &dyn Store, now_ms: u64, charged_ms: u64, b: usize) -> u32 {
        let Some(rule) = self.rules.get(b) else {
            return 0;
        };
        let window_ms = rule.spec.window_ms.max(1);
        let (charged, window) = (charged_ms / window_ms, now_ms / window_ms);
        let mut corrupt = 0;
        let result = update(store, &rule.key, self.max_retries, |found| {
            let Some(mut c) = found.and_then(|e| codec::decode(&e.bytes).ok()) else {
                corrupt += u32::from(found.is_some());
                return Update::Keep(());
            };
            c = c.at(window);
            let n = if c.window == charged {
                &mut c.retries
            } else if c.window == charged + 1 {
                &mut c.prev_retries
            } else {
                return Update::Keep(());
            };
            if *n == 0 {
                return Update::Keep(());
            }
            *n -= 1;
            Update::Write(codec::encode(&c), ())
        });
        corrupt + u32::from(result.is_err())
    }

    /// Merges this VM's first tries into the shared state (on every tick);
    /// returns the store failures it met.
    pub fn flush(&mut self, store: &dyn Store, now_ms: u64) -> u32 {
        let mut failures = 0;
        for b in 0..self.rules.len() {
            if self.pending.get(b).is_some_and(|&p| p > 0) {
                let (result, corrupt) = self.change(store, now_ms, b, false);
                failures += corrupt + u32::from(result.is_err());
            }
        }
        failures
    }

    /// One compare-and-swap on budget `b`'s counts: merges the pending
    /// first tries and, for a retry, admits it if it fits. Returns whether
    /// the retry was admitted, and the counts written (or found); with the
    /// corrupt states it replaced.
    fn change(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        b: usize,
        retry: bool,
    ) -> (Result<(bool, Counts), StoreError>, u32) {
        let (Some(rule), Some(&pending)) = (self.rules.get(b), self.pending.get(b)) else {
            return (Ok((true, Counts::default())), 0);
        };
        let spec = &rule.spec;
        let window = now_ms / spec.window_ms;
        let mut corrupt = 0;
        let result = update(store, &rule.key, self.max_retries, |found| {
            let old = match found {
                Some(e) => codec::decode(&e.bytes).unwrap_or_else(|_| {
                    corrupt += 1;
                    Counts::default()
                }),
                None => Counts::default(),
            };
            let mut c = old.at(window);
            c.tries += pending;
            let admitted = retry && fits(spec, &c, now_ms);
            if admitted {
                c.retries += 1;
            }
            if pending == 0 && !admitted {
                return Update::Keep((false, c));
            }
            Update::Write(codec::encode(&c), (admitted, c))
        });
        if result.is_ok() {
            if let Some(p) = self.pending.get_mut(b) {
                *p = 0;
            }
        }
        (result, corrupt)
    }
}
