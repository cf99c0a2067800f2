//! cargo-fuzz target `records`: see `sluice_fuzz::records`. Built without
//! cargo-fuzz (stable), a replayer: `cargo run --bin records -- FILE...`.
#![cfg_attr(fuzzing, no_main)]

#[cfg(fuzzing)]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_fuzz::records::records(data));

#[cfg(not(fuzzing))]
fn main() {
    for path in std::env::args().skip(1) {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        sluice_fuzz::records::records(&data);
        println!("{path}: ok");
    }
}
