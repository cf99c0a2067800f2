//! Validators shared by every mechanism's configuration: names, durations,
//! positive numbers, header names, request matches, state ids. A leaf: it
//! imports nothing of the mechanisms, so each mechanism's `config.rs` can
//! use it without an import cycle.
//!
//! Every error names the field by its JSON path (`rate_limits[1].bucket.rate`)
//! and the problem, so the log line Envoy prints when it refuses the plugin is
//! enough to fix the configuration.

use crate::duration::{parse_duration, NS_PER_MS};
use crate::matcher::{HeaderMatch, Match};
use serde::de::{value::MapAccessDeserializer, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::marker::PhantomData;

/// Longest accepted name (it appears in shared-data keys and metric names).
pub const MAX_NAME_LEN: usize = 64;

/// A configuration error: the JSON path of the offending field and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.problem)
        } else {
            write!(f, "invalid configuration: {}: {}", self.field, self.problem)
        }
    }
}

/// Refuses item `i` of `list` (`rate_limits`, `circuit_breakers`,
/// `shedders`) if its state id (the 32-bit hash of its definition that
/// prefixes its shared-data keys) is already taken by an earlier item
/// `(id, name)`: the two would share state. About one chance in four
/// billion per pair; renaming either one changes its id.
pub fn check_state_id<'a>(
    list: &str,
    i: usize,
    id: &str,
    earlier: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), ConfigError> {
    match earlier.into_iter().find(|(other, _)| *other == id) {
        Some((_, name)) => Err(err(
            format!("{list}[{i}].name"),
            format!("its state id collides with `{name}`'s; rename one of them"),
        )),
        None => Ok(()),
    }
}

pub fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

/// A JSON object, and only an object, read as `T`. serde's derived structs
/// also accept an array of their fields in order (`"bucket": [3, "2s", 4]`),
/// which would bypass the names (and "unknown fields are refused"): every
/// struct in the configuration is read through this instead.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Strict<T>(pub T);

/// In the schema, `Strict<T>` is `T` (an object, by `T`'s own schema).
#[cfg(feature = "schema")]
impl<T: schemars::JsonSchema> schemars::JsonSchema for Strict<T> {
    fn inline_schema() -> bool {
        T::inline_schema()
    }
    fn schema_name() -> std::borrow::Cow<'static, str> {
        T::schema_name()
    }
    fn schema_id() -> std::borrow::Cow<'static, str> {
        T::schema_id()
    }
    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        T::json_schema(g)
    }
}

impl<T> Strict<T> {
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> std::ops::Deref for Strict<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Never inlined, nor is the visit of the object: each configuration
/// struct is read by a function of its own instead of inside its parent's
/// reader. Run only at configuration; it keeps the module's largest
/// functions small, and with them the memory V8's optimizing compiler
/// takes (and Envoy's allocator keeps) to compile them.
impl<'de, T: Deserialize<'de>> Deserialize<'de> for Strict<T> {
    #[inline(never)]
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectOnly<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectOnly<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            #[inline(never)]
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjectOnly(PhantomData)).map(Strict)
    }
}

/// The JSON of a request match (`match`), shared by every mechanism.
#[derive(Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub path_prefix: Option<String>,
    pub path: Option<String>,
    #[serde(default)]
    pub ignore_case: bool,
    // Absent: any method; an empty list is refused (it would read as none).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(length(min = 1)))]
    pub methods: Option<Vec<String>>,
    #[serde(default)]
    pub headers: Vec<Strict<RawHeaderMatch>>,
}

/// One header condition of a match.
#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawHeaderMatch {
    pub name: String,
    pub exact: Option<String>,
    pub present: Option<bool>,
}

/// A state id: the first 32 bits of a keyed SipHash-1-3 over the domain
/// and the length-prefixed fields of a definition that decide what its
/// shared state means. Stable across builds: it depends on the fields'
/// values only, never on how Rust prints a value. A changed definition gets
/// fresh state; an unchanged one keeps its state across reconfiguration.
pub struct StateId(crate::hash::Keyed);

impl StateId {
    /// Starts an id; `salt` tells mechanisms apart.
    pub fn new(salt: (u64, u64), domain: &str) -> Self {
        let mut h = crate::hash::Keyed::new(salt);
        h.field(domain.as_bytes());
        StateId(h)
    }

    /// Adds a text or bytes field.
    pub fn text(mut self, bytes: impl AsRef<[u8]>) -> Self {
        self.0.field(bytes.as_ref());
        self
    }

    /// Adds a number.
    pub fn num(mut self, n: u64) -> Self {
        self.0.field(&n.to_le_bytes());
        self
    }

    /// The id.
    pub fn finish(self) -> u32 {
        self.0.finish() as u32
    }
}

pub fn check_name(field: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(err(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(err(
            field,
            format!("must be at most {MAX_NAME_LEN} characters"),
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(err(
            field,
            format!("`{name}` may only contain letters, digits, `_` and `-`"),
        ));
    }
    Ok(())
}

/// An HTTP status for a refusal: 400 to 599.
pub fn status(field: String, value: i64) -> Result<u32, ConfigError> {
    if !(400..=599).contains(&value) {
        return Err(err(
            field,
            format!("must be between 400 and 599, got {value}"),
        ));
    }
    Ok(value as u32)
}

/// The longest duration a `millis` field takes: a day (a breaker open
/// longer, a wait longer, is a mistake, and told back to a client in
/// `Retry-After` it would overflow the nanoseconds sluice counts in).
const MAX_MILLIS_NS: u64 = 24 * 3600 * 1_000_000_000;

/// A duration field in whole milliseconds (1 ms to 24 h), `default` if absent.
pub fn millis(field: String, text: Option<String>, default: &str) -> Result<u64, ConfigError> {
    let ns =
        parse_duration(text.as_deref().unwrap_or(default)).map_err(|p| err(field.clone(), p))?;
    if ns < NS_PER_MS {
        return Err(err(field, "must be at least 1ms"));
    }
    if ns > MAX_MILLIS_NS {
        return Err(err(field, "must be at most 24h"));
    }
    whole_millis(field, ns)
}

/// A duration in whole milliseconds that may be 0 (`0`, `0s`), else at
/// least 1ms; at most 24 h.
pub fn millis_or_zero(field: &str, text: String) -> Result<u64, ConfigError> {
    let ns = parse_duration(&text).map_err(|p| err(field, p))?;
    if ns > 0 && ns < NS_PER_MS {
        return Err(err(field, "must be 0 or at least 1ms"));
    }
    if ns > MAX_MILLIS_NS {
        return Err(err(field, "must be at most 24h"));
    }
    whole_millis(field.to_string(), ns)
}

/// A fraction (a ratio, a rate) in thousandths, refused unless it is a
/// whole number of them: rounded, a finer value would not be the one
/// written (0.0004 would turn into 0, 0.0015 into 2 thousandths).
pub fn permille(field: String, value: f64) -> Result<u32, ConfigError> {
    let scaled = value * 1000.0;
    if (scaled.round() - scaled).abs() > 1e-6 {
        return Err(err(
            field,
            format!("must be a multiple of 0.001, got {value}"),
        ));
    }
    Ok(scaled.round() as u32)
}

/// `ns` in milliseconds, refused unless whole: cut to a millisecond, a
/// duration would not be the one written (and one just over a field's
/// bound would pass it).
fn whole_millis(field: String, ns: u64) -> Result<u64, ConfigError> {
    if ns % NS_PER_MS != 0 {
        return Err(err(
            field,
            format!(
                "must be a whole number of milliseconds, got {}ms and {}ns",
                ns / NS_PER_MS,
                ns % NS_PER_MS
            ),
        ));
    }
    Ok(ns / NS_PER_MS)
}

pub fn positive(field: String, value: i64) -> Result<u64, ConfigError> {
    if value <= 0 {
        return Err(err(field, format!("must be greater than 0, got {value}")));
    }
    Ok(value as u64)
}

/// Validates and lower-cases a header name.
pub fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 {
        return Err(err(field, "header name must be 1 to 256 characters"));
    }
    let ok = name.bytes().enumerate().all(|(i, b)| {
        b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b) || (i == 0 && b == b':')
    });
    if !ok || name == ":" {
        return Err(err(field, format!("`{name}` is not a valid header name")));
    }
    Ok(name.to_ascii_lowercase())
}

/// Validates and lower-cases the name of a header sluice adds to its
/// replies: not a pseudo-header nor one of the headers Envoy sets or
/// drops itself (framing, connection), and not one sluice writes on a
/// refusal already, any of which would silently never show.
pub fn response_header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    const RESERVED: [&str; 25] = [
        "connection",
        "content-length",
        "content-type",
        "date",
        "grpc-message",
        "grpc-status",
        "host",
        "keep-alive",
        "proxy-connection",
        "ratelimit",
        "ratelimit-policy",
        "retry-after",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-sluice-bulkhead",
        "x-sluice-circuit",
        "x-sluice-deadline",
        "x-sluice-retry-budget",
        "x-sluice-shed",
    ];
    let name = header_name(field, name)?;
    if name.starts_with(':') {
        return Err(err(
            field,
            format!("`{name}` is a pseudo-header: Envoy sets it itself"),
        ));
    }
    if RESERVED.contains(&name.as_str()) {
        return Err(err(
            field,
            format!("`{name}` is set by Envoy or by sluice on a refusal: choose another name"),
        ));
    }
    Ok(name)
}

pub fn validate_match(at: &str, raw: RawMatch) -> Result<Match, ConfigError> {
    if raw.path_prefix.is_some() && raw.path.is_some() {
        return Err(err(
            format!("{at}.match"),
            "give either `path` or `path_prefix`, not both",
        ));
    }
    for (field, value) in [("path_prefix", &raw.path_prefix), ("path", &raw.path)] {
        if let Some(p) = value {
            if !p.starts_with('/') {
                return Err(err(
                    format!("{at}.match.{field}"),
                    format!("`{p}` must start with `/`"),
                ));
            }
        }
    }
    if raw.methods.as_ref().is_some_and(Vec::is_empty) {
        return Err(err(
            format!("{at}.match.methods"),
            "list at least one method, or leave `methods` out to match any",
        ));
    }
    let raw_methods = raw.methods.unwrap_or_default();
    let mut methods = Vec::with_capacity(raw_methods.len());
    for (j, m) in raw_methods.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(err(
                format!("{at}.match.methods[{j}]"),
                format!("`{m}` is not an HTTP method"),
            ));
        }
        methods.push(m.to_ascii_uppercase());
    }
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (j, h) in raw.headers.into_iter().map(Strict::into_inner).enumerate() {
        let field = format!("{at}.match.headers[{j}]");
        let name = header_name(&format!("{field}.name"), &h.name)?;
        let m = match (h.exact, h.present) {
            (Some(_), Some(_)) => {
                return Err(err(field, "give either `exact` or `present`, not both"))
            }
            (Some(value), None) => HeaderMatch::Exact(name, value.into_bytes()),
            (None, Some(present)) => HeaderMatch::Present(name, present),
            (None, None) => HeaderMatch::Present(name, true),
        };
        headers.push(m);
    }
    Ok(Match {
        path_prefix: raw.path_prefix,
        path: raw.path,
        ignore_case: raw.ignore_case,
        methods,
        headers,
    })
}
