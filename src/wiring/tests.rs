//! Configuration validation: good configurations parse to the documented
//! defaults, and each bad one is refused with its field and problem.

use crate::config::HeaderStyle;
use crate::keys::KeyPart;
use crate::keys::MissingKey;
use crate::time::Instant;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[test]
fn empty_configuration_means_no_rules() {
    for empty in ["", "  \n", "{}"] {
        let c = parse(empty.as_bytes()).expect("empty is fine");
        assert!(c.rules.is_empty());
        assert_eq!(c.common.response.status, 429);
        assert_eq!(c.common.domain, "default");
    }
}

#[test]
fn a_full_rule_parses_with_its_defaults() {
    let c = parse(
        br#"{"rate_limits":[{"name":"per-tenant","key":[{"header":"X-Tenant"},"client_address","path","method",
            "authority","route","cluster",{"constant":"v1"}],"bucket":{"rate":100,"period":"1m"}}]}"#,
    )
    .expect("valid");
    let r = &c.rules[0];
    assert_eq!(
        r.bucket().expect("bucket").burst,
        100,
        "burst defaults to rate"
    );
    assert_eq!(r.bucket().expect("bucket").period_ns, 60_000_000_000);
    assert_eq!(r.key[0], KeyPart::Header("x-tenant".into()));
    assert_eq!(r.key.len(), 8);
    assert_eq!(r.on_missing_key, MissingKey::Skip);
    assert_eq!(r.max_keys, 10_000);
    assert_eq!((r.cost.default, r.cost.max), (1, 1));
    assert!(!r.shadow);
    assert_eq!(c.common.response.ratelimit_headers, HeaderStyle::Both);
    assert_eq!(c.common.response.retry_after_jitter_ns, 1_000_000_000);
    assert!(!c.common.failure_mode_deny);
}

#[test]
fn bad_configurations_name_the_field_and_the_problem() {
    let b = r#""bucket":{"rate":1,"period":"1s"}"#;
    let cases: Vec<(String, &str, &str)> = vec![
        ("{".into(), "", "EOF"),
        ("[]".into(), "", "must be a JSON object"),
        (
            "{\"rate_limits\":[{]}".into(),
            "rate_limits[0]",
            "key must be a string",
        ),
        (
            r#"{"rate_limit":[]}"#.into(),
            "rate_limit",
            "unknown field `rate_limit`",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"burts":3}}]}}"#),
            "rate_limits[0].burts",
            "unknown field `burts`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s","brst":1}}]}"#.into(),
            "rate_limits[0].bucket.brst",
            "unknown field `brst`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":0,"period":"1s"}}]}"#.into(),
            "rate_limits[0].bucket.rate",
            "greater than 0",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":-5,"period":"1s"}}]}"#.into(),
            "rate_limits[0].bucket.rate",
            "greater than 0, got -5",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s","burst":0}}]}"#.into(),
            "rate_limits[0].bucket.burst",
            "greater than 0",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"soon"}}]}"#.into(),
            "rate_limits[0].bucket.period",
            "`soon`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1d"}}]}"#.into(),
            "rate_limits[0].bucket.period",
            "unknown unit `d`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"0s"}}]}"#.into(),
            "rate_limits[0].bucket.period",
            "longer than 0",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"",{b}}}]}}"#),
            "rate_limits[0].name",
            "must not be empty",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a b",{b}}}]}}"#),
            "rate_limits[0].name",
            "may only contain",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b}}},{{"name":"a",{b}}}]}}"#),
            "rate_limits[1].name",
            "duplicate rule name `a`",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"max_keys":0}}]}}"#),
            "rate_limits[0].max_keys",
            "greater than 0",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"max_keys":2000000}}]}}"#),
            "rate_limits[0].max_keys",
            "at most 1000000",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"key":["ip"]}}]}}"#),
            "rate_limits[0].key[0]",
            "unknown variant `ip`",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"key":[{{"header":"bad header"}}]}}]}}"#),
            "rate_limits[0].key[0]",
            "not a valid header name",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"cost":{{"max":5}}}}]}}"#),
            "rate_limits[0].cost.max",
            "larger than the burst",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"on_missing_key":"deny"}}]}}"#),
            "rate_limits[0].on_missing_key",
            "unknown variant `deny`",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"match":{{"path":"x"}}}}]}}"#),
            "rate_limits[0].match.path",
            "must start with `/`",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"match":{{"methods":["GE T"]}}}}]}}"#),
            "rate_limits[0].match.methods[0]",
            "not an HTTP method",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"match":{{"methods":[]}}}}]}}"#),
            "rate_limits[0].match.methods",
            "at least one method",
        ),
        (
            r#"{"rate_limits":[{"name":"a"}]}"#.into(),
            "rate_limits[0].bucket",
            "missing field `bucket`",
        ),
        (
            r#"{"shedders":[{"name":"s","priority":{"shares":{"critical":50,"default":35,"sheddable":15}}}]}"#.into(),
            "shedders[0].priority.shares",
            "needs a concurrency limit (queue mode)",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":4},"priority":{"shares":{"critical":50,"default":35,"sheddable":10}}}]}"#.into(),
            "shedders[0].priority.shares",
            "must add up to 100, got 95",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":4},"priority":{"shares":{"critical":150,"default":-35,"sheddable":-15}}}]}"#.into(),
            "shedders[0].priority.shares.sheddable",
            "must be a percentage between 0 and 100, got -15",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":4},"priority":{"shares":{"critical":100}}}]}"#.into(),
            "shedders[0].priority.shares",
            "missing field `default`",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":4},"priority":{"lifo":true,"shares":{"critical":50,"default":35,"sheddable":15}}}]}"#.into(),
            "shedders[0].priority.lifo",
            "cannot be combined with shares",
        ),
        (
            r#"{"shedders":[{"name":"s","priority":{"lifo":true}}]}"#.into(),
            "shedders[0].priority.lifo",
            "needs a concurrency limit (queue mode)",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":4,"shed_early":"yes"}}]}"#.into(),
            "shedders[0].concurrency.shed_early",
            "invalid type: string \"yes\", expected a boolean",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window"}]}"#.into(),
            "rate_limits[0].window",
            "missing field `window`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"leaky"}]}"#.into(),
            "rate_limits[0].algorithm",
            "unknown variant `leaky`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","bucket":{"rate":1,"period":"1s"},"window":{"limit":1,"period":"1s"}}]}"#.into(),
            "rate_limits[0].bucket",
            "is for algorithm token_bucket",
        ),
        (
            r#"{"rate_limits":[{"name":"a","window":{"limit":1,"period":"1s"},"bucket":{"rate":1,"period":"1s"}}]}"#.into(),
            "rate_limits[0].window",
            "is for algorithm sliding_window",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":0,"period":"1s"}}]}"#.into(),
            "rate_limits[0].window.limit",
            "greater than 0",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":4294967296,"period":"1s"}}]}"#.into(),
            "rate_limits[0].window.limit",
            "at most 4294967295",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"500ms"}}]}"#.into(),
            "rate_limits[0].window.period",
            "at least 1s",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"9000h"}}]}"#.into(),
            "rate_limits[0].window.period",
            "at most 8784h",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"1m","size":3}}]}"#.into(),
            "rate_limits[0].window.size",
            "unknown field",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"1m"},"cost":{"max":6}}]}"#.into(),
            "rate_limits[0].cost.max",
            "larger than the burst or window limit (5)",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"wait"}]}"#.into(),
            "rate_limits[0].on_limit",
            "unknown variant `wait`",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay"}]}"#.into(),
            "rate_limits[0].max_delay",
            "is required with on_limit: delay",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"max_delay":"1s"}]}"#.into(),
            "rate_limits[0].max_delay",
            "only applies with on_limit: delay",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"max_delayed":5}]}"#.into(),
            "rate_limits[0].max_delayed",
            "only applies with on_limit: delay",
        ),
        (
            r#"{"concurrency_limits":[{"name":"t","key":[{"header":"x"}],"max":1,"max_wait":"1.5ms"}]}"#.into(),
            "concurrency_limits[0].max_wait",
            "must be a whole number of milliseconds, got 1ms and 500000ns",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":1,"max_wait":"3600.0005s"}}]}"#.into(),
            "shedders[0].concurrency.max_wait",
            "must be a whole number of milliseconds",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay","max_delay":"0s"}]}"#.into(),
            "rate_limits[0].max_delay",
            "longer than 0",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay","max_delay":"2m"}]}"#.into(),
            "rate_limits[0].max_delay",
            "at most 60s",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay","max_delay":"soon"}]}"#.into(),
            "rate_limits[0].max_delay",
            "",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay","max_delay":"1s","max_delayed":0}]}"#.into(),
            "rate_limits[0].max_delayed",
            "between 1 and 100000, got 0",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s"},"on_limit":"delay","max_delay":"1s","shadow":true}]}"#.into(),
            "rate_limits[0].shadow",
            "cannot be combined with on_limit: delay",
        ),
        (
            r#"{"rate_limits":[{"name":"a","algorithm":"sliding_window","window":{"limit":5,"period":"1m"},"on_limit":"delay","max_delay":"1s"}]}"#.into(),
            "rate_limits[0].on_limit",
            "needs algorithm token_bucket",
        ),
        (
            r#"{"response":{"status":200}}"#.into(),
            "response.status",
            "between 400 and 599",
        ),
        (
            r#"{"response":{"retry_after_jitter":"2h"}}"#.into(),
            "response.retry_after_jitter",
            "at most 1h",
        ),
        (
            r#"{"response":{"ratelimit_headers":"all"}}"#.into(),
            "response.ratelimit_headers",
            "unknown variant `all`",
        ),
        (
            r#"{"response":{"reason_header":":status"}}"#.into(),
            "response.reason_header",
            "pseudo-header",
        ),
        (
            r#"{"response":{"reason_header":"Content-Length"}}"#.into(),
            "response.reason_header",
            "set by Envoy or by sluice",
        ),
        (
            r#"{"response":{"reason_header":"retry-after"}}"#.into(),
            "response.reason_header",
            "set by Envoy or by sluice",
        ),
        (
            r#"{"max_cas_retries":0}"#.into(),
            "max_cas_retries",
            "between 1 and 1000",
        ),
        (r#"{"domain":"a/b"}"#.into(), "domain", "may only contain"),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":1.5}}]}"#.into(),
            "shedders[0].concurrency.max",
            "must be a whole number of requests, or \"auto\"",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":1},"latency":{"floor_window":"10s"}}]}"#.into(),
            "shedders[0].latency",
            "applies only to a shedder without concurrency",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","graded":{"max":0.0004}}]}"#.into(),
            "circuit_breakers[0].graded.max",
            "must be a multiple of 0.001, got 0.0004",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","error_rate":0.3333}]}"#.into(),
            "circuit_breakers[0].error_rate",
            "must be a multiple of 0.001",
        ),
        (
            r#"{"rate_limits":[{"name":"a","key":[["header","x"]],"bucket":{"rate":1,"period":"1s"}}]}"#.into(),
            "rate_limits[0].key[0]",
            "has the wrong JSON type: expected a name (a string)",
        ),
        (
            r#"{"rate_limits":[{"name":"a","key":[{"header":"x","constant":"y"}],"bucket":{"rate":1,"period":"1s"}}]}"#.into(),
            "rate_limits[0].key[0]",
            "an object of one field",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","key":{ }}]}"#.into(),
            "circuit_breakers[0].key",
            "an object of one field",
        ),
        (
            r#"{"rate_limits":[{"name":"a","on_limit":7,"bucket":{"rate":1,"period":"1s"}}]}"#.into(),
            "rate_limits[0].on_limit",
            "has the wrong JSON type",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","open":{"base":"25h","max":"25h"}}]}"#.into(),
            "circuit_breakers[0].open.base",
            "must be at most 24h",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":1,"max_wait":"100000h"}}]}"#.into(),
            "shedders[0].concurrency.max_wait",
            "must be at most 24h",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","failure":{"statuses":["+500"]}}]}"#.into(),
            "circuit_breakers[0].failure.statuses[0]",
            "is neither a status",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","failure":{"statuses":["0500"]}}]}"#.into(),
            "circuit_breakers[0].failure.statuses[0]",
            "is neither a status",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","failure":{"grpc_statuses":[0]}}]}"#.into(),
            "circuit_breakers[0].failure.grpc_statuses[0]",
            "is not a gRPC error status (1-16)",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","failure":{"grpc_statuses":[17]}}]}"#.into(),
            "circuit_breakers[0].failure.grpc_statuses[0]",
            "is not a gRPC error status (1-16)",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":"auto","adaptive":{"tolerance":1.234}}}]}"#.into(),
            "shedders[0].concurrency.adaptive.tolerance",
            "must be a multiple of 0.01, got 1.234",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":99999999999}}]}"#.into(),
            "shedders[0].concurrency.max",
            "must be at most 1000000",
        ),
        (
            r#"{"deadlines":{"min_remaining":"25h"}}"#.into(),
            "deadlines.min_remaining",
            "must be at most 24h",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","key":{"header":":"}}]}"#.into(),
            "circuit_breakers[0].key.header",
            "is not a valid header name",
        ),
        (
            "{\"rate_limits\":[{\"name\":\"a\",\n\"on_limit\": }]}".into(),
            "rate_limits[0].on_limit",
            "expected value at line 2 column 13",
        ),
    ];
    for (json, field, problem) in cases {
        let e = parse(json.as_bytes()).expect_err(&json);
        assert_eq!(e.field, field, "{json}: {e}");
        assert!(e.to_string().contains(problem), "{json}: {e}");
        assert!(e.to_string().starts_with("invalid configuration"), "{e}");
    }
}

#[test]
fn a_state_id_taken_by_an_earlier_item_is_refused_naming_both() {
    let earlier = [("sl00000001/", "tenant"), ("sl00000002/", "global")];
    assert_eq!(
        crate::config::fields::check_state_id("rate_limits", 2, "sl00000002/", earlier),
        Err(crate::config::ConfigError {
            field: "rate_limits[2].name".into(),
            problem: "its state id collides with `global`'s; rename one of them".into(),
        })
    );
    assert!(crate::config::fields::check_state_id("shedders", 2, "sl00000003/", earlier).is_ok());
}

#[test]
fn the_parser_is_as_strict_as_the_docs() {
    let b = r#""bucket":{"rate":1,"period":"1s"}"#;
    let cases: Vec<(String, &str, &str)> = vec![
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b}}}]}} trailing"#),
            "",
            "unexpected data after the configuration object",
        ),
        (
            format!(r#"{{"rate_limits":[]}}{{"rate_limits":[{{"name":"a",{b}}}]}}"#),
            "",
            "unexpected data after the configuration object",
        ),
        (
            r#"{"response":[429]}"#.into(),
            "response",
            "expected a JSON object",
        ),
        (
            r#"{"rate_limits":[{"name":"a","bucket":[3,"2s",4]}]}"#.into(),
            "rate_limits[0].bucket",
            "expected a JSON object",
        ),
        (
            r#"{"rate_limits":[["a",null,[],"skip",{"rate":1,"period":"1s"}]]}"#.into(),
            "rate_limits[0]",
            "expected a JSON object",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"cost":[1]}}]}}"#),
            "rate_limits[0].cost",
            "expected a JSON object",
        ),
        (
            format!(r#"{{"rate_limits":[{{"name":"a",{b},"match":["/x"]}}]}}"#),
            "rate_limits[0].match",
            "expected a JSON object",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","open":["1s","2s",2]}]}"#.into(),
            "circuit_breakers[0].open",
            "expected a JSON object",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":[4]}]}"#.into(),
            "shedders[0].concurrency",
            "expected a JSON object",
        ),
        (
            r#"{"shedders":[{"name":"s","priority":{"classes":[[{},"critical"]]}}]}"#.into(),
            "shedders[0].priority.classes[0]",
            "expected a JSON object",
        ),
    ];
    for (json, field, problem) in cases {
        let e = parse(json.as_bytes()).expect_err(&json);
        assert_eq!(e.field, field, "{json}: {e}");
        assert!(e.problem.contains(problem), "{json}: {e}");
    }
    // Whitespace after the object is not data.
    assert!(parse(format!("{{\"rate_limits\":[{{\"name\":\"a\",{b}}}]}}\n \t").as_bytes()).is_ok());
}

/// A configuration with every mechanism and every option that has
/// metrics of its own (shaping, a global rule, an adaptive limit).
const EVERYTHING: &str = r#"{"deadlines":{},
    "circuit_breakers":[{"name":"b"}],
    "retry_budgets":[{"name":"r"}],
    "concurrency_limits":[{"name":"c","key":[{"header":"x-t"}],"max":2,"max_wait":"100ms"}],
    "rate_limits":[
        {"name":"p","bucket":{"rate":10,"period":"1s"},"on_limit":"delay","max_delay":"1s"},
        {"name":"g","key":[{"header":"x-key"}],"algorithm":"sliding_window",
         "window":{"limit":100,"period":"1h"},
         "global":{"cluster":"rls","domain":"fleet","instances":1}}],
    "shedders":[{"name":"s","concurrency":{"max":"auto","adaptive":{}}}]}"#;

#[test]
fn every_declared_metric_is_defined_by_some_configuration_and_documented() {
    let config = parse(EVERYTHING.as_bytes()).expect("valid");
    let p = crate::wiring::pipeline(&config, (1, 2), 1, Instant::EPOCH, 0).expect("builds");
    let defined: Vec<&str> = p
        .metrics
        .defs
        .iter()
        .map(|d| d.name.rsplit(";.;").next().unwrap_or(""))
        .collect();
    let docs = include_str!("../../docs/operations.md");
    for d in crate::wiring::METRIC_TABLES.iter().flat_map(|t| t.iter()) {
        assert!(
            defined.contains(&d.name),
            "{} is declared, never defined",
            d.name
        );
        assert!(
            docs.contains(d.name),
            "{} is not in docs/operations.md",
            d.name
        );
    }
}
