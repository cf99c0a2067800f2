//! Caller keys: an ordered list of parts read from the request, hashed with a
//! secret seed into a rule's fixed slot table.
//!
//! Invariants: parts are hashed length-prefixed with a tag per kind, so no
//! header value can impersonate another combination of parts; a missing part
//! hashes to a marker distinct from every value (including the empty one).
//! A key with variable parts maps to two distinct slots (see `bucket` and
//! the README: a count-min sketch with conservative update); a key with no
//! variable part is one bucket and uses one slot.

use crate::config::fields::header_name;
use crate::hash::Keyed;
use crate::request::{normalize_path, strip_port, Attribute, RequestView};
use serde::Deserialize;

/// What a rule does when a key part is missing from the request.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    /// The rule does not apply to the request (as Envoy's descriptors do).
    #[default]
    Skip,
    /// All requests missing that part share one bucket, distinct from any value.
    Shared,
}

/// One part of a caller key.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyPart {
    /// A request header's (first) value.
    Header(String),
    /// The path without its query string.
    Path,
    /// The request method.
    Method,
    /// The `:authority` (Host).
    Authority,
    /// The client address without its port (`source.address`).
    ClientAddress,
    /// The route name (`xds.route_name`).
    Route,
    /// The upstream cluster name (`xds.cluster_name`).
    Cluster,
    /// A constant string.
    Constant(String),
}

impl KeyPart {
    /// Checks the part: a header part must name a valid header.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            KeyPart::Header(name) => header_name("", name).map(|_| ()).map_err(|e| e.problem),
            _ => Ok(()),
        }
    }

    /// Lower-cases header names (header lookups are by lower-case name).
    pub fn normalised(self) -> Self {
        match self {
            KeyPart::Header(name) => KeyPart::Header(name.to_ascii_lowercase()),
            other => other,
        }
    }

    /// A stable encoding of the part (its kind and its name or value), for
    /// state ids.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.tag()];
        if let KeyPart::Header(v) | KeyPart::Constant(v) = self {
            out.extend_from_slice(v.as_bytes());
        }
        out
    }

    fn is_variable(&self) -> bool {
        !matches!(self, KeyPart::Constant(_))
    }

    /// `f` of the part's value in the request (`None`: missing), read in
    /// place where the host can.
    fn read_with(&self, req: &dyn RequestView, f: &mut dyn FnMut(Option<&[u8]>)) {
        match self {
            KeyPart::Header(name) => req.header_with(name, f),
            KeyPart::Path => req.header_with(":path", &mut |p| {
                f(p.map(normalize_path).as_deref());
            }),
            KeyPart::Method => req.header_with(":method", f),
            KeyPart::Authority => req.header_with(":authority", f),
            KeyPart::ClientAddress => req.attribute_with(Attribute::ClientAddress, &mut |a| {
                f(a.map(strip_port));
            }),
            KeyPart::Route => req.attribute_with(Attribute::RouteName, f),
            KeyPart::Cluster => req.attribute_with(Attribute::ClusterName, f),
            KeyPart::Constant(c) => f(Some(c.as_bytes())),
        }
    }

    fn read(&self, req: &dyn RequestView) -> Option<Vec<u8>> {
        match self {
            KeyPart::Header(name) => req.header(name),
            KeyPart::Path => req.header(":path").map(|p| normalize_path(&p).into_owned()),
            KeyPart::Method => req.header(":method"),
            KeyPart::Authority => req.header(":authority"),
            KeyPart::ClientAddress => req
                .attribute(Attribute::ClientAddress)
                .map(|a| strip_port(&a).to_vec()),
            KeyPart::Route => req.attribute(Attribute::RouteName),
            KeyPart::Cluster => req.attribute(Attribute::ClusterName),
            KeyPart::Constant(c) => Some(c.as_bytes().to_vec()),
        }
    }

    fn tag(&self) -> u8 {
        match self {
            KeyPart::Header(_) => 1,
            KeyPart::Path => 2,
            KeyPart::Method => 3,
            KeyPart::Authority => 4,
            KeyPart::ClientAddress => 5,
            KeyPart::Route => 6,
            KeyPart::Cluster => 7,
            KeyPart::Constant(_) => 8,
        }
    }
}

/// Where a caller's state lives in its rule's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The key's 64-bit hash (its fingerprint, for collision accounting).
    pub fingerprint: u64,
    /// One or two distinct slot indexes below the table size.
    pub slots: [u32; 2],
    /// How many entries of `slots` are used (1 or 2).
    pub count: usize,
}

impl Placement {
    /// The 32-bit tag stored in slots for collision accounting (never 0,
    /// which marks a slot no key has charged).
    pub fn tag(&self) -> u32 {
        (self.fingerprint as u32) | 1
    }

    /// The tag of a global rule's pool: from the hash's high bits, which
    /// do not choose the first slot (two keys share a pool only if 32 more
    /// bits of their hashes agree).
    pub fn pool_tag(&self) -> u32 {
        ((self.fingerprint >> 32) as u32) | 1
    }

    /// The used slot indexes.
    pub fn slots(&self) -> &[u32] {
        self.slots.get(..self.count).unwrap_or(&self.slots)
    }
}

/// Whether a key with these parts can take more than one value.
pub fn has_variable_parts(parts: &[KeyPart]) -> bool {
    parts.iter().any(KeyPart::is_variable)
}

/// Computes where the request's key lives, or `None` if a part is missing
/// and the rule says to skip. `table_size` is at least 1.
pub fn place(
    parts: &[KeyPart],
    on_missing: MissingKey,
    seed: (u64, u64),
    table_size: u32,
    req: &dyn RequestView,
) -> Option<Placement> {
    let mut h = Keyed::new(seed);
    for part in parts {
        h.write(&[part.tag()]);
        let mut found = false;
        part.read_with(req, &mut |v| {
            if let Some(value) = v {
                found = true;
                h.write(&[1]);
                h.field(value);
            }
        });
        if !found {
            match on_missing {
                MissingKey::Skip => return None,
                MissingKey::Shared => h.write(&[0]),
            }
        }
    }
    Some(placement(h.finish(), has_variable_parts(parts), table_size))
}

/// Where a key without variable parts lives (the same for every request:
/// computed once), or `None` for a key with variable parts.
pub fn fixed_placement(parts: &[KeyPart], seed: (u64, u64), table_size: u32) -> Option<Placement> {
    /// A request with nothing in it: constant parts read none.
    struct Nothing;
    impl RequestView for Nothing {
        fn header(&self, _name: &str) -> Option<Vec<u8>> {
            None
        }
        fn attribute(&self, _attr: Attribute) -> Option<Vec<u8>> {
            None
        }
    }
    if has_variable_parts(parts) {
        return None;
    }
    place(parts, MissingKey::Skip, seed, table_size, &Nothing)
}

/// Where a key of this hash lives: one slot for a key without variable
/// parts (or a table of one), else two distinct ones.
pub fn placement(fingerprint: u64, variable: bool, table_size: u32) -> Placement {
    if !variable || table_size <= 1 {
        return Placement {
            fingerprint,
            slots: [0, 0],
            count: 1,
        };
    }
    let n = table_size as u64;
    let first = fingerprint % n;
    // The second slot is derived from the high bits and never equals the first.
    let step = 1 + (fingerprint >> 32).wrapping_mul(0x9e37_79b9) % (n - 1);
    let second = (first + step) % n;
    Placement {
        fingerprint,
        slots: [first as u32, second as u32],
        count: 2,
    }
}

/// The shared-data key of a slot of a table: its prefix and the slot in
/// decimal, built without `format!` (on every request).
pub fn slot_key(prefix: &str, slot: u32) -> String {
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    let mut n = slot;
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        start -= 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut key = String::with_capacity(prefix.len() + digits.len() - start);
    key.push_str(prefix);
    key.extend(digits.iter().skip(start).map(|&d| char::from(d)));
    key
}

/// The values of a key's parts, as the request has them (a missing part
/// is empty): the descriptor a global rule sends to its service.
pub fn values(parts: &[KeyPart], req: &dyn RequestView) -> Vec<Vec<u8>> {
    parts
        .iter()
        .map(|p| p.read(req).unwrap_or_default())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const SEED: (u64, u64) = (11, 22);

    fn fp(parts: &[KeyPart], req: &FakeRequest) -> Option<u64> {
        place(parts, MissingKey::Skip, SEED, 1000, req).map(|p| p.fingerprint)
    }

    #[test]
    fn same_request_same_key_and_two_distinct_slots_in_range() {
        let parts = vec![KeyPart::Header("x-api-key".into()), KeyPart::ClientAddress];
        for i in 0..2000u32 {
            let req = FakeRequest::new("GET", "/").with_header("x-api-key", &i.to_le_bytes());
            let a = place(&parts, MissingKey::Skip, SEED, 7, &req).expect("placed");
            let b = place(&parts, MissingKey::Skip, SEED, 7, &req).expect("placed");
            assert_eq!(a, b);
            assert_eq!(a.count, 2);
            assert_ne!(a.slots[0], a.slots[1]);
            assert!(a.slots.iter().all(|&s| s < 7));
        }
    }

    #[test]
    fn separators_in_values_cannot_forge_another_key() {
        let parts = vec![KeyPart::Header("a".into()), KeyPart::Header("b".into())];
        let r1 = FakeRequest::new("GET", "/")
            .with_header("a", b"x|y")
            .with_header("b", b"z");
        let r2 = FakeRequest::new("GET", "/")
            .with_header("a", b"x")
            .with_header("b", b"y|z");
        assert_ne!(fp(&parts, &r1), fp(&parts, &r2));
    }

    #[test]
    fn a_header_cannot_impersonate_a_constant_or_another_part_kind() {
        let req = FakeRequest::new("GET", "/p").with_header("h", b"/p");
        let by_header = fp(&[KeyPart::Header("h".into())], &req);
        let by_path = fp(&[KeyPart::Path], &req);
        let by_const = fp(&[KeyPart::Constant("/p".into())], &req);
        assert_ne!(by_header, by_path);
        assert_ne!(by_header, by_const);
    }

    #[test]
    fn missing_parts_skip_or_share_a_bucket_distinct_from_empty() {
        let parts = vec![KeyPart::Header("x-tenant".into())];
        let missing = FakeRequest::new("GET", "/");
        let empty = FakeRequest::new("GET", "/").with_header("x-tenant", b"");
        assert_eq!(place(&parts, MissingKey::Skip, SEED, 10, &missing), None);
        let shared = place(&parts, MissingKey::Shared, SEED, 10, &missing).expect("shared");
        let with_empty = place(&parts, MissingKey::Shared, SEED, 10, &empty).expect("empty");
        assert_ne!(shared.fingerprint, with_empty.fingerprint);
    }

    #[test]
    fn constant_keys_use_a_single_slot() {
        let p = place(
            &[KeyPart::Constant("all".into())],
            MissingKey::Skip,
            SEED,
            50,
            &FakeRequest::new("GET", "/"),
        );
        assert_eq!(p.map(|p| p.slots().to_vec()), Some(vec![0]));
        let p = place(
            &[],
            MissingKey::Skip,
            SEED,
            50,
            &FakeRequest::new("GET", "/"),
        );
        assert_eq!(p.map(|p| p.count), Some(1));
    }

    /// A key without variable parts is placed once, where every request
    /// would place it; a key with one is placed per request.
    #[test]
    fn a_fixed_placement_is_where_each_request_goes() {
        let req = FakeRequest::new("GET", "/").with_header("x-tenant", b"a");
        for parts in [vec![], vec![KeyPart::Constant("all".into())]] {
            let fixed = fixed_placement(&parts, SEED, 1);
            assert!(fixed.is_some());
            for size in [1, 50] {
                assert_eq!(fixed, place(&parts, MissingKey::Skip, SEED, size, &req));
            }
        }
        let variable = [
            KeyPart::Constant("c".into()),
            KeyPart::Header("x-tenant".into()),
        ];
        assert_eq!(fixed_placement(&variable, SEED, 50), None);
    }

    #[test]
    fn the_seed_changes_placement() {
        let parts = vec![KeyPart::ClientAddress];
        let req = FakeRequest::new("GET", "/");
        let a = place(&parts, MissingKey::Skip, (1, 2), 1 << 20, &req);
        let b = place(&parts, MissingKey::Skip, (3, 4), 1 << 20, &req);
        assert_ne!(a, b);
    }

    #[test]
    fn slots_spread_evenly_over_the_table() {
        let parts = vec![KeyPart::Header("k".into())];
        let mut counts = vec![0u32; 100];
        for i in 0..100_000u32 {
            let req = FakeRequest::new("GET", "/").with_header("k", i.to_string().as_bytes());
            let p = place(&parts, MissingKey::Skip, SEED, 100, &req).expect("placed");
            for &s in p.slots() {
                counts[s as usize] += 1;
            }
        }
        // 2,000 expected per slot; allow generous statistical slack.
        assert!(
            counts.iter().all(|&c| (1700..2300).contains(&c)),
            "{counts:?}"
        );
    }
}
