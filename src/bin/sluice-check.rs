//! `sluice-check`: checks plugin configurations before they are published,
//! with the filter's own validation code, and prints the JSON Schema.
//!
//!     sluice-check FILE...     every problem of each file, with its field
//!     sluice-check -           the configuration on standard input
//!     sluice-check --schema    the JSON Schema of the configuration
//!
//! Exit status: 0 when every file is accepted, 1 when any has a problem,
//! 2 when a file cannot be read.

use sluice::wiring::check::{check, schema};
use std::io::Read;
use std::process::ExitCode;

fn read(path: &str) -> std::io::Result<Vec<u8>> {
    if path == "-" {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf)?;
        Ok(buf)
    } else {
        std::fs::read(path)
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() || args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!("usage: sluice-check FILE... | - | --schema");
        return ExitCode::from(2);
    }
    if args.iter().any(|a| a == "--schema") {
        print!("{}", schema());
        return ExitCode::SUCCESS;
    }
    let mut status = ExitCode::SUCCESS;
    for path in &args {
        match read(path) {
            Err(e) => {
                eprintln!("{path}: cannot read: {e}");
                return ExitCode::from(2);
            }
            Ok(bytes) => {
                let problems = check(&bytes);
                if problems.is_empty() {
                    println!("{path}: ok");
                }
                for p in problems {
                    let field = if p.field.is_empty() {
                        "(top level)"
                    } else {
                        &p.field
                    };
                    println!("{path}: {field}: {}", p.problem);
                    status = ExitCode::FAILURE;
                }
            }
        }
    }
    status
}
