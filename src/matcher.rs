//! Which requests a rule applies to: path (exact or prefix, query string
//! ignored, as Envoy's route matching does), methods, and headers.
//!
//! Paths are matched as an upstream will understand them (see
//! [`normalize_path`]), whatever the connection manager's settings, so that
//! `/%61pi/x`, `//api/x` or `/x/../api/x` cannot slip past a rule on `/api`;
//! `ignore_case` also matches them case-insensitively, for upstreams that
//! ignore case.

use crate::request::{normalize_path, RequestView};

/// A header condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderMatch {
    /// The header is present (`true`) or absent (`false`).
    Present(String, bool),
    /// The header's first value equals these bytes exactly.
    Exact(String, Vec<u8>),
}

/// A validated request match. All conditions must hold; an empty match
/// matches every request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    pub path_prefix: Option<String>,
    pub path: Option<String>,
    /// Compare `path` and `path_prefix` case-insensitively.
    pub ignore_case: bool,
    /// Upper-case method names; empty means any method.
    pub methods: Vec<String>,
    pub headers: Vec<HeaderMatch>,
}

impl Match {
    /// Whether the request satisfies every condition.
    pub fn matches(&self, req: &dyn RequestView) -> bool {
        if self.path_prefix.is_some() || self.path.is_some() {
            let Some(full) = req.header(":path") else {
                return false;
            };
            let path = normalize_path(&full);
            let same = |a: &[u8], b: &[u8]| {
                if self.ignore_case {
                    a.eq_ignore_ascii_case(b)
                } else {
                    a == b
                }
            };
            if let Some(prefix) = &self.path_prefix {
                let head = path.get(..prefix.len());
                if !head.is_some_and(|h| same(h, prefix.as_bytes())) {
                    return false;
                }
            }
            if let Some(exact) = &self.path {
                if !same(&path, exact.as_bytes()) {
                    return false;
                }
            }
        }
        if !self.methods.is_empty() {
            let Some(method) = req.header(":method") else {
                return false;
            };
            if !self
                .methods
                .iter()
                .any(|m| m.as_bytes().eq_ignore_ascii_case(&method))
            {
                return false;
            }
        }
        self.headers.iter().all(|h| match h {
            HeaderMatch::Present(name, want) => req.header(name).is_some() == *want,
            HeaderMatch::Exact(name, value) => {
                req.header(name).as_deref() == Some(value.as_slice())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fake::FakeRequest;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn empty_match_matches_everything() {
        assert!(Match::default().matches(&FakeRequest::new("GET", "/")));
    }

    #[test]
    fn path_prefix_and_exact_ignore_the_query_string() {
        let prefix = Match {
            path_prefix: Some("/api".into()),
            ..Match::default()
        };
        assert!(prefix.matches(&FakeRequest::new("GET", "/api/v1?x=1")));
        assert!(!prefix.matches(&FakeRequest::new("GET", "/ap")));
        let exact = Match {
            path: Some("/login".into()),
            ..Match::default()
        };
        assert!(exact.matches(&FakeRequest::new("POST", "/login?next=/")));
        assert!(!exact.matches(&FakeRequest::new("POST", "/login/x")));
    }

    #[test]
    fn methods_and_headers_must_all_hold() {
        let m = Match {
            methods: vec!["POST".into()],
            headers: vec![
                HeaderMatch::Exact("x-env".into(), b"prod".to_vec()),
                HeaderMatch::Present("x-debug".into(), false),
            ],
            ..Match::default()
        };
        let ok = FakeRequest::new("POST", "/").with_header("x-env", b"prod");
        assert!(m.matches(&ok));
        assert!(!m.matches(&FakeRequest::new("GET", "/").with_header("x-env", b"prod")));
        assert!(m.matches(&FakeRequest::new("post", "/").with_header("x-env", b"prod")));
        assert!(!m.matches(&ok.clone().with_header("x-debug", b"1")));
        assert!(!m.matches(&FakeRequest::new("POST", "/").with_header("x-env", b"prod\xff")));
    }

    #[test]
    fn path_spellings_cannot_slip_past_and_case_is_ignored_on_request() {
        let m = Match {
            path_prefix: Some("/api".into()),
            ..Match::default()
        };
        for p in ["/%61pi/x", "/ap%69/x", "//api/x", "/./api/x", "/x/../api/x"] {
            assert!(m.matches(&FakeRequest::new("GET", p)), "{p}");
        }
        assert!(!m.matches(&FakeRequest::new("GET", "/API/x")));
        let m = Match {
            path_prefix: Some("/api".into()),
            ignore_case: true,
            ..Match::default()
        };
        assert!(m.matches(&FakeRequest::new("GET", "/API/x")));
        assert!(m.matches(&FakeRequest::new("GET", "/%41pi/x")));
        assert!(!m.matches(&FakeRequest::new("GET", "/ap")));
    }
}
