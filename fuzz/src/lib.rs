//! The bodies of sluice's fuzz targets, as plain functions of the bytes a
//! fuzzer hands over: `fuzz_targets/` runs each under cargo-fuzz
//! (libFuzzer, nightly), `tests/corpus.rs` runs each over the committed
//! seeds and a few thousand deterministic mutations on stable (`make
//! test`). They call the filter's own code through its public API, as the
//! host does, and assert its invariants, not only the absence of a panic.
//! See README.md.

pub mod config;
pub mod harness;
pub mod headers;
pub mod mutate;
pub mod records;
pub mod rls;
pub mod store;

/// A target's body.
pub type Target = fn(&[u8]);

/// Every target, by name (as `fuzz_targets/NAME.rs` and `seeds/NAME/`).
pub const TARGETS: [(&str, Target); 5] = [
    ("config", config::config),
    ("headers", headers::headers),
    ("records", records::records),
    ("store", store::store),
    ("rls", rls::rls),
];
