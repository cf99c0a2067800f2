//! The limits file: envoyproxy/ratelimit's configuration, in JSON.
//!
//! ```json
//! [{"domain": "demo",
//!   "descriptors": [
//!     {"key": "remote_address", "rate_limit": {"unit": "minute", "requests_per_unit": 20}},
//!     {"key": "tenant", "value": "gold",
//!      "descriptors": [{"key": "user", "rate_limit": {"unit": "second", "requests_per_unit": 5}}]}]}]
//! ```
//!
//! A single domain object is accepted as well as a list. A descriptor
//! without `value` matches any value of its key; one with a `value` matches
//! only that value and is preferred over the key alone.

use std::collections::HashMap;
use std::fmt;

use serde::Deserialize;

/// A window length, as envoyproxy/ratelimit's `unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
}

impl Unit {
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
        }
    }

    /// The `RateLimitResponse.RateLimit.Unit` enum value.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
        }
    }

    /// From the proto enum (a descriptor's `limit` override); the units
    /// without a fixed length in seconds (month, year) and week are refused.
    pub fn from_proto(v: i32) -> Option<Unit> {
        match v {
            1 => Some(Unit::Second),
            2 => Some(Unit::Minute),
            3 => Some(Unit::Hour),
            4 => Some(Unit::Day),
            _ => None,
        }
    }

    fn parse(s: &str) -> Option<Unit> {
        match s.to_ascii_lowercase().as_str() {
            "second" => Some(Unit::Second),
            "minute" => Some(Unit::Minute),
            "hour" => Some(Unit::Hour),
            "day" => Some(Unit::Day),
            _ => None,
        }
    }
}

/// One limit: `requests_per_unit` hits per fixed window of one `unit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    pub name: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DomainFile {
    domain: String,
    #[serde(default)]
    descriptors: Vec<DescriptorFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorFile {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RateLimitFile>,
    #[serde(default)]
    descriptors: Vec<DescriptorFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitFile {
    #[serde(default)]
    name: Option<String>,
    unit: String,
    requests_per_unit: u32,
}

/// A node of a domain's descriptor tree.
#[derive(Debug, Default)]
struct Node {
    limit: Option<Limit>,
    children: Children,
}

/// Children by (key, value); a `None` value matches any value.
type Children = HashMap<(String, Option<String>), Node>;

/// Every domain's tree, ready for lookups.
#[derive(Debug, Default)]
pub struct Config {
    domains: HashMap<String, Children>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Config {
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        let domains: Vec<DomainFile> = if value.is_array() {
            serde_json::from_value(value)
        } else {
            serde_json::from_value(value).map(|d| vec![d])
        }
        .map_err(|e| ConfigError(e.to_string()))?;
        let mut config = Config::default();
        for (i, d) in domains.into_iter().enumerate() {
            let at = format!("[{i}]");
            if d.domain.is_empty() {
                return Err(ConfigError(format!("{at}.domain: empty")));
            }
            if config.domains.contains_key(&d.domain) {
                return Err(ConfigError(format!(
                    "{at}.domain: duplicate domain {:?}",
                    d.domain
                )));
            }
            let tree = build(&d.descriptors, &format!("{at}.descriptors"))?;
            config.domains.insert(d.domain, tree);
        }
        Ok(config)
    }

    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// The limit for one request descriptor, found as envoyproxy/ratelimit
    /// finds it: walk the entries down the tree, at each level preferring
    /// `key` with the entry's value over `key` alone; the limit applies only
    /// if the node reached by the *last* entry has one. None: no limit (the
    /// descriptor is answered OK without a current limit).
    pub fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<&Limit> {
        let mut level = self.domains.get(domain)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let node = level
                .get(&(key.to_string(), Some(value.to_string())))
                .or_else(|| level.get(&(key.to_string(), None)))?;
            if i + 1 == entries.len() {
                return node.limit.as_ref();
            }
            level = &node.children;
        }
        None
    }
}

fn build(descriptors: &[DescriptorFile], at: &str) -> Result<Children, ConfigError> {
    let mut out = Children::new();
    for (i, d) in descriptors.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if d.key.is_empty() {
            return Err(ConfigError(format!("{at}.key: empty")));
        }
        let limit = match &d.rate_limit {
            None => None,
            Some(r) => {
                let unit = Unit::parse(&r.unit).ok_or_else(|| {
                    ConfigError(format!(
                        "{at}.rate_limit.unit: {:?} is not second, minute, hour or day",
                        r.unit
                    ))
                })?;
                Some(Limit {
                    name: r.name.clone().unwrap_or_default(),
                    requests_per_unit: r.requests_per_unit,
                    unit,
                })
            }
        };
        let node = Node {
            limit,
            children: build(&d.descriptors, &format!("{at}.descriptors"))?,
        };
        let id = (d.key.clone(), d.value.clone().filter(|v| !v.is_empty()));
        if out.insert(id, node).is_some() {
            return Err(ConfigError(format!(
                "{at}: duplicate descriptor {}{}",
                d.key,
                d.value
                    .as_deref()
                    .map(|v| format!("={v}"))
                    .unwrap_or_default()
            )));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NESTED: &str = r#"[{"domain": "d", "descriptors": [
        {"key": "user", "rate_limit": {"unit": "minute", "requests_per_unit": 3}},
        {"key": "tenant", "value": "gold", "rate_limit": {"unit": "hour", "requests_per_unit": 100},
         "descriptors": [{"key": "user", "rate_limit": {"unit": "second", "requests_per_unit": 5}}]},
        {"key": "tenant",
         "descriptors": [{"key": "user", "value": "root", "rate_limit": {"unit": "day", "requests_per_unit": 1}},
                         {"key": "user", "rate_limit": {"name": "any", "unit": "MINUTE", "requests_per_unit": 2}}]}
    ]}]"#;

    fn limit(c: &Config, domain: &str, entries: &[(&str, &str)]) -> Option<(u32, Unit)> {
        c.find(domain, entries)
            .map(|l| (l.requests_per_unit, l.unit))
    }

    #[test]
    fn finds_as_envoyproxy_ratelimit_does() {
        let c = Config::parse(NESTED).unwrap();
        assert_eq!(limit(&c, "d", &[("user", "a")]), Some((3, Unit::Minute)));
        // A value match is preferred over the key alone, at each level.
        assert_eq!(
            limit(&c, "d", &[("tenant", "gold")]),
            Some((100, Unit::Hour))
        );
        assert_eq!(
            limit(&c, "d", &[("tenant", "gold"), ("user", "x")]),
            Some((5, Unit::Second))
        );
        assert_eq!(
            limit(&c, "d", &[("tenant", "tin"), ("user", "root")]),
            Some((1, Unit::Day))
        );
        assert_eq!(
            limit(&c, "d", &[("tenant", "tin"), ("user", "x")]),
            Some((2, Unit::Minute))
        );
        assert_eq!(
            c.find("d", &[("tenant", "tin"), ("user", "x")])
                .unwrap()
                .name,
            "any"
        );
        // The node of the last entry must carry the limit.
        assert_eq!(limit(&c, "d", &[("tenant", "tin")]), None);
        // Entries beyond the tree, unknown keys and domains: no limit.
        assert_eq!(limit(&c, "d", &[("user", "a"), ("more", "x")]), None);
        assert_eq!(limit(&c, "d", &[("other", "a")]), None);
        assert_eq!(limit(&c, "nope", &[("user", "a")]), None);
        assert_eq!(limit(&c, "d", &[]), None);
    }

    #[test]
    fn one_domain_object_is_accepted() {
        let c = Config::parse(r#"{"domain": "x", "descriptors": [{"key": "k", "rate_limit": {"unit": "second", "requests_per_unit": 1}}]}"#).unwrap();
        assert_eq!(c.domain_count(), 1);
        assert_eq!(limit(&c, "x", &[("k", "v")]), Some((1, Unit::Second)));
    }

    #[test]
    fn refuses_mistakes_with_their_place() {
        let err = |s: &str| Config::parse(s).unwrap_err().0;
        assert!(err(r#"[{"domain": ""}]"#).contains("[0].domain: empty"));
        assert!(err(r#"[{"domain": "a"}, {"domain": "a"}]"#).contains("[1].domain: duplicate"));
        assert!(err(r#"{"domain": "a", "descriptors": [{"key": "k", "rate_limit": {"unit": "week", "requests_per_unit": 1}}]}"#)
            .contains("[0].descriptors[0].rate_limit.unit"));
        assert!(
            err(r#"{"domain": "a", "descriptors": [{"key": "k"}, {"key": "k"}]}"#)
                .contains("duplicate descriptor k")
        );
        assert!(
            err(r#"{"domain": "a", "descriptors": [{"key": "k", "rate_limits": {}}]}"#)
                .contains("unknown field")
        );
        assert!(err("nope").contains("expected"));
    }

    #[test]
    fn units_map_to_the_proto_enum() {
        for u in [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day] {
            assert_eq!(Unit::from_proto(u.proto()), Some(u));
        }
        assert_eq!(Unit::from_proto(7), None);
        assert_eq!(Unit::Day.seconds(), 86_400);
    }
}
