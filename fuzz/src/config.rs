//! Target `config`: the plugin configuration as Envoy hands it over.

use crate::harness::{Host, MemStore, Req};
use sluice::wiring::{parse, Config};

/// Any bytes: the configuration loads, or is refused with an error that
/// names a field path (or none, for the document as a whole) and a
/// problem, never a panic. One that loads loads the same again, and the
/// same from its JSON written out anew (whitespace, escapes and number
/// spellings are not meaning); it builds a pipeline that takes requests.
pub fn config(data: &[u8]) {
    let first = parse(data);
    assert_eq!(
        format!("{first:?}"),
        format!("{:?}", parse(data)),
        "parse is not a function of its input"
    );
    let problems = sluice::wiring::check::check(data);
    assert_eq!(
        problems.is_empty(),
        first.is_ok(),
        "sluice-check and the filter disagree: {problems:?}"
    );
    problems.iter().for_each(check_refusal);
    let config = match first {
        Ok(c) => c,
        Err(e) => {
            check_refusal(&e);
            return;
        }
    };
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        let again = serde_json::to_vec(&value).unwrap_or_default();
        match parse(&again) {
            Ok(c) => assert_eq!(
                without_version(c),
                without_version(config.clone()),
                "the same JSON written anew loads differently"
            ),
            Err(e) => panic!("loads, but not written anew: {e}"),
        }
    }
    run_briefly(&config);
}

/// The configuration's top-level fields: where every field path starts.
const TOP: [&str; 10] = [
    "domain",
    "rate_limits",
    "response",
    "failure_mode_deny",
    "max_cas_retries",
    "circuit_breakers",
    "shedders",
    "retry_budgets",
    "deadlines",
    "concurrency_limits",
];

/// A refusal names a field of the configuration (one it has, or the
/// unknown one it refuses) or none, and a problem.
fn check_refusal(e: &sluice::config::ConfigError) {
    let text = e.to_string();
    assert!(text.starts_with("invalid configuration"), "{text}");
    assert!(!e.problem.is_empty(), "a refusal without a problem");
    if e.field.is_empty() {
        return;
    }
    assert!(text.contains(&e.field), "{text} does not name its field");
    let known = TOP.iter().any(|t| {
        e.field
            .strip_prefix(t)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.') || rest.starts_with('['))
    });
    assert!(
        known || e.problem.contains("unknown field"),
        "a refusal's field is not a path of the configuration: {text}"
    );
}

fn without_version(mut c: Config) -> Config {
    c.common.version = 0;
    c
}

/// A few requests, a response, ticks: a loaded configuration runs (its
/// key tables cut to 64 slots: a table's size changes where keys land,
/// not what runs, and filling 10,000 slots would slow the fuzzer tenfold).
fn run_briefly(config: &Config) {
    let mut config = config.clone();
    config
        .rules
        .iter_mut()
        .for_each(|r| r.max_keys = r.max_keys.min(64));
    let limits = config.concurrency_limits.iter_mut();
    limits.for_each(|l| l.max_keys = l.max_keys.min(64));
    let config = &config;
    let store = MemStore::default();
    let Ok(_) = sluice::wiring::pipeline(config, (1, 2), 1, sluice::time::Instant::EPOCH, 0) else {
        // Refused when built: a defect of its own kind, named by the error.
        return;
    };
    let mut host = Host::new(config, &store, 1);
    for i in 0..4u8 {
        let req = Req::new("GET", "/a").with("x-tenant", &[b'a' + (i % 2)]);
        let (id, _) = host.arrive(req);
        host.advance_ms(3);
        host.tick();
        if i % 2 == 0 {
            host.finish(id, 503, Vec::new());
        }
    }
    host.wind_down();
}
