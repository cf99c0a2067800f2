//! The headers a stage adds to an admitted request's response: short
//! values (the rate-limit headers' numbers) inline, a few of them without
//! a heap allocation, since every admitted request may carry them from
//! its request to its response.

use crate::small::Small;
use std::ops::Deref;

/// The longest value kept inline.
const INLINE: usize = 22;

/// Headers for a response, in order: (name, value).
pub type Headers = Small<(&'static str, HeaderValue), 3>;

/// A header value: text, inline up to [`INLINE`] bytes. Hosts send its
/// bytes (`as_bytes`: no UTF-8 check on the way).
#[derive(Clone)]
pub struct HeaderValue(Repr);

#[derive(Clone)]
enum Repr {
    /// The text is `buf[start..]`.
    Inline {
        start: u8,
        buf: [u8; INLINE],
    },
    Heap(Box<str>),
}

impl Default for HeaderValue {
    fn default() -> Self {
        HeaderValue(Repr::Inline {
            start: INLINE as u8,
            buf: [0; INLINE],
        })
    }
}

/// `00` to `99`.
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

impl HeaderValue {
    /// `n` in decimal.
    pub fn decimal(mut n: u64) -> Self {
        let mut buf = [0u8; INLINE];
        let mut i = INLINE;
        let mut put = |i: usize, pair: u64| {
            let p = pair as usize * 2;
            if let (Some(dst), Some(src)) = (buf.get_mut(i..i + 2), PAIRS.get(p..p + 2)) {
                dst.copy_from_slice(src);
            }
        };
        while n >= 100 {
            i -= 2;
            put(i, n % 100);
            n /= 100;
        }
        // The last one or two digits.
        i -= 2;
        put(i, n);
        if n < 10 {
            i += 1;
        }
        HeaderValue(Repr::Inline {
            start: i as u8,
            buf,
        })
    }

    /// The text's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { start, buf } => buf.get(usize::from(*start)..).unwrap_or_default(),
            Repr::Heap(s) => s.as_bytes(),
        }
    }

    /// The text (always UTF-8: made from text and digits).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl From<&str> for HeaderValue {
    fn from(s: &str) -> Self {
        let mut buf = [0; INLINE];
        let start = INLINE.checked_sub(s.len());
        match start.and_then(|i| Some((i, buf.get_mut(i..)?))) {
            Some((i, dst)) => {
                dst.copy_from_slice(s.as_bytes());
                HeaderValue(Repr::Inline {
                    start: i as u8,
                    buf,
                })
            }
            None => HeaderValue(Repr::Heap(s.into())),
        }
    }
}

impl From<String> for HeaderValue {
    fn from(s: String) -> Self {
        if s.len() <= INLINE {
            HeaderValue::from(s.as_str())
        } else {
            HeaderValue(Repr::Heap(s.into_boxed_str()))
        }
    }
}

impl Deref for HeaderValue {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Debug for HeaderValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

impl std::fmt::Display for HeaderValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_str().fmt(f)
    }
}

impl PartialEq for HeaderValue {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for HeaderValue {}

impl PartialEq<str> for HeaderValue {
    fn eq(&self, other: &str) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<&str> for HeaderValue {
    fn eq(&self, other: &&str) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<String> for HeaderValue {
    fn eq(&self, other: &String) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn values_short_and_long_read_back() {
        for n in [0, 7, 9, 10, 99, 100, 101, 999_999_999, u64::MAX] {
            assert_eq!(HeaderValue::decimal(n), n.to_string());
        }
        let long = "\"a-rather-long-policy-name\";q=100;w=60";
        assert_eq!(HeaderValue::from(long), long);
        assert_eq!(HeaderValue::from(long.to_string()), long);
        assert_eq!(HeaderValue::from("ab".to_string()).as_str(), "ab");
        assert_eq!(HeaderValue::default(), "");
        let exactly = "a".repeat(INLINE);
        assert_eq!(HeaderValue::from(exactly.as_str()), exactly);
        assert!(std::mem::size_of::<HeaderValue>() <= 24);
    }
}
