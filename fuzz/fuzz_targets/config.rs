//! cargo-fuzz target `config`: see `sluice_fuzz::config`. Built without
//! cargo-fuzz (stable), a replayer: `cargo run --bin config -- FILE...`.
#![cfg_attr(fuzzing, no_main)]

#[cfg(fuzzing)]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_fuzz::config::config(data));

#[cfg(not(fuzzing))]
fn main() {
    for path in std::env::args().skip(1) {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        sluice_fuzz::config::config(&data);
        println!("{path}: ok");
    }
}
