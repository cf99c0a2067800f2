//! What the core may ask of a request and of its response. The host adapter implements it over
//! proxy-wasm calls; tests implement it over a map. Values are raw bytes:
//! header values need not be UTF-8.

/// A request attribute that is not a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attribute {
    /// The client address without its port (`source.address`).
    ClientAddress,
    /// The name of the route Envoy selected (`xds.route_name`).
    RouteName,
    /// The upstream cluster Envoy selected (`xds.cluster_name`).
    ClusterName,
}

/// Read access to the current request.
pub trait RequestView {
    /// The first value of a request header (lower-case name, pseudo-headers
    /// such as `:path` included), or `None` when absent.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// A request attribute, or `None` when the host does not know it.
    fn attribute(&self, attr: Attribute) -> Option<Vec<u8>>;

    /// `f` of a header's value (as [`RequestView::header`]), read in place
    /// where the host can (no copy).
    fn header_with(&self, name: &str, f: &mut dyn FnMut(Option<&[u8]>)) {
        f(self.header(name).as_deref());
    }

    /// `f` of an attribute (as [`RequestView::attribute`]), read in place
    /// where the host can.
    fn attribute_with(&self, attr: Attribute, f: &mut dyn FnMut(Option<&[u8]>)) {
        f(self.attribute(attr).as_deref());
    }
}

/// Read access to the current response's headers (for stages that watch
/// the upstream's answer).
pub trait ResponseView {
    /// The `:status`, if it parses.
    fn status(&self) -> Option<u32>;
    /// Envoy's `response.code_details` (why Envoy answered as it did: an
    /// upstream answer, or one of Envoy's or a filter's local replies).
    fn code_details(&self) -> Option<Vec<u8>>;
    /// The first value of a response header (lower-case name).
    fn header(&self, name: &str) -> Option<Vec<u8>>;

    /// The status, and whether Envoy's router marked the response as the
    /// upstream's (`x-envoy-upstream-service-time`, which it adds to every
    /// upstream response unless told not to): the host reads both in one
    /// call.
    fn status_and_upstream_mark(&self) -> (Option<u32>, bool) {
        (self.status(), self.header(UPSTREAM_MARK).is_some())
    }
}

/// The header Envoy's router adds to a response that came from upstream.
pub const UPSTREAM_MARK: &str = "x-envoy-upstream-service-time";

/// The first of a header's comma-separated values, trimmed: Envoy joins
/// repeated values of the headers it knows (`grpc-timeout`,
/// `x-envoy-attempt-count`, ...) into one, `5m,5m`, where other headers
/// keep their first value. `None` when the value is not UTF-8.
pub fn first_value(v: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(v).ok()?;
    Some(text.split(',').next().unwrap_or(text).trim())
}

/// A count sent in a header (an attempt number): a decimal integer, `+`
/// allowed, saturating at `u64::MAX` (20 digits of 9 are a large count,
/// not no count at all).
pub fn count(text: &str) -> Option<u64> {
    let digits = text.strip_prefix('+').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(digits.parse().unwrap_or(u64::MAX))
}

/// The path without its query string or fragment.
pub fn strip_query(path: &[u8]) -> &[u8] {
    path.split(|&b| b == b'?' || b == b'#')
        .next()
        .unwrap_or(path)
}

/// The path as an upstream will understand it (RFC 3986 normalization):
/// query and fragment removed, percent-encoded unreserved characters
/// decoded (`%61` is `a`; other escapes kept, hex upper-cased, so `%2F`
/// stays an escaped slash), repeated slashes merged, and `.` and `..`
/// segments removed. Whatever the connection manager's own settings, a
/// client cannot spell a path so that a path rule misses it.
pub fn normalize_path(path: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let path = strip_query(path);
    let plain = !path.contains(&b'%')
        && !path.windows(2).any(|w| w == b"//" || w == b"/.")
        && path.first() == Some(&b'/');
    if plain {
        return std::borrow::Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    if decoded.first() != Some(&b'/') {
        return std::borrow::Cow::Owned(decoded);
    }
    std::borrow::Cow::Owned(remove_dot_segments(&decoded))
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Decodes `%XX` of unreserved characters; upper-cases the others' hex.
fn decode_unreserved(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while let Some(&b) = path.get(i) {
        let escape = (b == b'%')
            .then(|| Some((hex(*path.get(i + 1)?)?, hex(*path.get(i + 2)?)?)))
            .flatten();
        match escape {
            Some((hi, lo)) => {
                let v = hi * 16 + lo;
                if v.is_ascii_alphanumeric() || b"-._~".contains(&v) {
                    out.push(v);
                } else {
                    out.push(b'%');
                    out.extend(
                        path.get(i + 1..i + 3)
                            .unwrap_or_default()
                            .iter()
                            .map(u8::to_ascii_uppercase),
                    );
                }
                i += 3;
            }
            None => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// Merges repeated slashes and removes `.` and `..` segments (never above
/// the root) of an absolute path; a path ending in a dot segment keeps its
/// trailing slash.
fn remove_dot_segments(path: &[u8]) -> Vec<u8> {
    let mut segments: Vec<&[u8]> = Vec::new();
    let parts: Vec<&[u8]> = path.split(|&b| b == b'/').skip(1).collect();
    let last = parts.len().saturating_sub(1);
    let mut trailing = false;
    for (i, seg) in parts.into_iter().enumerate() {
        match seg {
            b"" => trailing = i == last,
            b"." => trailing = i == last,
            b".." => {
                segments.pop();
                trailing = i == last;
            }
            s => {
                segments.push(s);
                trailing = false;
            }
        }
    }
    let mut out = Vec::with_capacity(path.len());
    for s in &segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    if trailing || segments.is_empty() {
        out.push(b'/');
    }
    out
}

/// An address such as `10.0.0.1:5678` or `[::1]:5678` without its port.
pub fn strip_port(address: &[u8]) -> &[u8] {
    if let Some(rest) = address.strip_prefix(b"[") {
        return match rest.iter().position(|&b| b == b']') {
            Some(end) => rest.get(..end).unwrap_or(address),
            None => address,
        };
    }
    let colons = address.iter().filter(|&&b| b == b':').count();
    if colons == 1 {
        if let Some(host) = address.rsplit(|&b| b == b':').nth(1) {
            return host;
        }
    }
    address
}

#[cfg(test)]
pub(crate) mod fake {
    //! A request made of a header map and attribute map, for tests.
    use super::*;
    use std::collections::HashMap;

    #[derive(Default, Clone)]
    pub struct FakeRequest {
        pub headers: HashMap<String, Vec<u8>>,
        pub attributes: HashMap<&'static str, Vec<u8>>,
    }

    impl FakeRequest {
        pub fn new(method: &str, path: &str) -> Self {
            let mut r = Self::default();
            r.headers
                .insert(":method".into(), method.as_bytes().to_vec());
            r.headers.insert(":path".into(), path.as_bytes().to_vec());
            r.headers
                .insert(":authority".into(), b"example.com".to_vec());
            r.attributes.insert("source", b"10.1.2.3:4567".to_vec());
            r
        }
        pub fn with_header(mut self, name: &str, value: &[u8]) -> Self {
            self.headers.insert(name.to_string(), value.to_vec());
            self
        }
    }

    impl RequestView for FakeRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn attribute(&self, attr: Attribute) -> Option<Vec<u8>> {
            let k = match attr {
                Attribute::ClientAddress => "source",
                Attribute::RouteName => "route",
                Attribute::ClusterName => "cluster",
            };
            self.attributes.get(k).cloned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn strips_query_and_fragment() {
        assert_eq!(strip_query(b"/a/b?x=1"), b"/a/b");
        assert_eq!(strip_query(b"/a#f"), b"/a");
        assert_eq!(strip_query(b"/a"), b"/a");
        assert_eq!(strip_query(b""), b"");
    }

    #[test]
    fn paths_are_normalised_as_an_upstream_reads_them() {
        let n =
            |p: &str| String::from_utf8(normalize_path(p.as_bytes()).into_owned()).expect("utf8");
        for spelling in [
            "/api/x",
            "/%61pi/x",
            "/ap%69/x",
            "//api/x",
            "/./api/x",
            "/x/../api/x",
            "/api//x",
            "/api/./x",
            "/%2e/api/x",
            "/x/%2E%2E/api/x",
            "/api/x?q=1",
            "/../api/x",
            "/a/b/../../api/x",
        ] {
            assert_eq!(n(spelling), "/api/x", "{spelling}");
        }
        assert_eq!(n("/api/x/"), "/api/x/");
        assert_eq!(n("/api/x/."), "/api/x/");
        assert_eq!(n("/api/x/.."), "/api/");
        assert_eq!(n("/"), "/");
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/a%2fb"), "/a%2Fb", "an escaped slash stays escaped");
        assert_eq!(n("/a%zz"), "/a%zz", "a broken escape stays as it is");
        assert_eq!(n("/a%4"), "/a%4");
        assert_eq!(n("/..."), "/...");
        assert_eq!(n("*"), "*");
        assert!(matches!(
            normalize_path(b"/plain/path?x"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn strips_ports_from_v4_and_v6_addresses() {
        assert_eq!(strip_port(b"10.0.0.1:5678"), b"10.0.0.1");
        assert_eq!(strip_port(b"[::1]:5678"), b"::1");
        assert_eq!(strip_port(b"::1"), b"::1");
        assert_eq!(strip_port(b"10.0.0.1"), b"10.0.0.1");
        assert_eq!(strip_port(b"[broken"), b"[broken");
    }
}
