//! The stable pass of the fuzz targets (`make test`): each target's body
//! over its committed seeds (`seeds/NAME/`), then over deterministic
//! mutations of them. A failure names the input, written to
//! `artifacts/NAME/` for `cargo run --bin NAME -- FILE` and cargo-fuzz.

use sluice_fuzz::mutate::{mutate, Rng};
use sluice_fuzz::TARGETS;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// Mutations per target: `FUZZ_MUTATIONS`, default 2000.
fn mutations() -> usize {
    let n = std::env::var("FUZZ_MUTATIONS").ok();
    n.and_then(|n| n.parse().ok()).unwrap_or(2000)
}

pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a seed").path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read(f).expect("a seed"))
        .collect()
}

fn run(name: &str, body: fn(&[u8]), input: &[u8], what: &str) {
    if catch_unwind(AssertUnwindSafe(|| body(input))).is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("artifacts")
            .join(name);
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join(format!("stable-{:016x}", fnv(input)));
        let _ = std::fs::write(&file, input);
        panic!(
            "target {name} failed on {what}, written to {}",
            file.display()
        );
    }
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn every_target_over_its_seeds_and_their_mutations() {
    let n = mutations();
    for (name, body) in TARGETS {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "no seeds for {name}");
        for (i, s) in seeds.iter().enumerate() {
            run(name, body, s, &format!("seed {i}"));
        }
        let mut rng = Rng(fnv(name.as_bytes()));
        for m in 0..n {
            let a = &seeds[rng.below(seeds.len())];
            let b = &seeds[rng.below(seeds.len())];
            let input = mutate(&mut rng, a, b);
            run(name, body, &input, &format!("mutation {m}"));
        }
    }
}
