//! Checking a configuration before publishing it (`make check-config`, the
//! `sluice-check` command): every problem with its field path, not only the
//! first, and the JSON Schema of the configuration.

use super::config::parse;
use crate::config::ConfigError;
use serde_json::{Map, Value};

/// The lists whose items are checked one by one.
const LISTS: [&str; 5] = [
    "rate_limits",
    "circuit_breakers",
    "shedders",
    "retry_budgets",
    "concurrency_limits",
];

/// Every problem of a configuration, each naming its field: the top level,
/// then each item of each list on its own (the first problem of each), then
/// what only the whole shows (a name given twice, colliding state ids).
/// Empty when the filter would accept the configuration.
pub fn check(bytes: &[u8]) -> Vec<ConfigError> {
    let whole = match parse(bytes) {
        Ok(_) => return Vec::new(),
        Err(e) => e,
    };
    let Ok(Value::Object(top)) = serde_json::from_slice::<Value>(bytes) else {
        return vec![whole];
    };
    let mut out = Vec::new();
    let mut bare = top.clone();
    for list in LISTS {
        if bare.contains_key(list) {
            bare.insert(list.to_string(), Value::Array(Vec::new()));
        }
    }
    if let Err(e) = parse_value(bare) {
        out.push(e);
    }
    for list in LISTS {
        let Some(Value::Array(items)) = top.get(list) else {
            continue;
        };
        for (i, item) in items.iter().enumerate() {
            let mut one = Map::new();
            one.insert(list.to_string(), Value::Array(vec![item.clone()]));
            if let Err(mut e) = parse_value(one) {
                e.field = e
                    .field
                    .replacen(&format!("{list}[0]"), &format!("{list}[{i}]"), 1);
                out.push(e);
            }
        }
    }
    if !out.contains(&whole) && !out.iter().any(|e| e.field == whole.field) {
        out.push(whole);
    }
    out
}

/// Parses a rebuilt document; positions in its errors would point into the
/// rebuilt text, not the user's, so they are left out.
fn parse_value(v: Map<String, Value>) -> Result<(), ConfigError> {
    let bytes = serde_json::to_vec(&Value::Object(v)).unwrap_or_default();
    parse(&bytes).map(|_| ()).map_err(|mut e| {
        if let Some(at) = e.problem.find(" at line ") {
            e.problem.truncate(at);
        }
        e
    })
}

/// The JSON Schema of the configuration, derived from the types the filter
/// parses with (field names, types, defaults' optionality, unknown fields
/// refused). Ranges and cross-field rules are the parser's: check a file
/// with [`check`] as well.
#[cfg(feature = "schema")]
pub fn schema() -> String {
    let mut s = schemars::schema_for!(super::config::RawConfig);
    s.insert("title".into(), "sluice plugin configuration".into());
    serde_json::to_string_pretty(&s).unwrap_or_default() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn every_problem_is_named_with_its_field() {
        let got = check(
            br#"{"domain":"a b","rate_limits":[
                {"name":"ok","bucket":{"rate":1,"period":"1s"}},
                {"name":"r","bucket":{"rate":0,"period":"1s"}},
                {"name":"s","bucket":{"rate":1,"period":"1x"}}],
              "shedders":[{"name":"q","concurrency":{"max":0}}]}"#,
        );
        let fields: Vec<&str> = got.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "domain",
                "rate_limits[1].bucket.rate",
                "rate_limits[2].bucket.period",
                "shedders[0].concurrency.max"
            ]
        );
    }

    #[cfg(feature = "schema")]
    #[test]
    fn the_shipped_schema_is_the_one_the_types_give() {
        let shipped = include_str!("../../docs/sluice.schema.json");
        assert!(
            schema() == shipped,
            "docs/sluice.schema.json is out of date: run `make schema`"
        );
    }

    #[test]
    fn problems_only_the_whole_shows_are_reported_too() {
        let b = r#""bucket":{"rate":1,"period":"1s"}"#;
        let got = check(
            format!(r#"{{"rate_limits":[{{"name":"a",{b}}},{{"name":"a",{b}}}]}}"#).as_bytes(),
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].field, "rate_limits[1].name");
        assert!(check(format!(r#"{{"rate_limits":[{{"name":"a",{b}}}]}}"#).as_bytes()).is_empty());
        assert_eq!(check(b"{").len(), 1);
    }
}
