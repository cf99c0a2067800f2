//! Target `records`: every shared-data record as read back, corrupted,
//! truncated or from another version, through each codec.

use sluice::ratelimit::algorithm::Algorithm;
use sluice::ratelimit::codec::Slot;
use sluice::ratelimit::global::codec as global;
use sluice::ratelimit::global::pool::Pool;
use std::fmt::Debug;

/// The codecs, by the selector byte that starts an input.
pub const CODECS: [&str; 12] = [
    "slot", "lease", "newest", "health", "wants", "pool", "breaker", "bulkhead", "retry", "shed",
    "adaptive", "rule",
];

/// Decoding never panics; what decodes encodes to bytes that decode to the
/// same value (and, for a fixed-size record, to the same bytes).
fn stable<T: PartialEq + Debug, E: Debug, B: AsRef<[u8]>>(
    bytes: &[u8],
    decode: impl Fn(&[u8]) -> Result<T, E>,
    encode: impl Fn(&T) -> B,
) -> Option<T> {
    let value = decode(bytes).ok()?;
    let again = encode(&value);
    match decode(again.as_ref()) {
        Ok(v) => assert_eq!(v, value, "decode(encode(decode(b))) differs"),
        Err(e) => panic!("{value:?} encodes to bytes that do not decode: {e:?}"),
    }
    assert_eq!(
        again.as_ref(),
        bytes,
        "a record that decodes is not canonical"
    );
    Some(value)
}

/// The first byte picks the codec; the rest is the record as read back.
pub fn records(data: &[u8]) {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which as usize % CODECS.len() {
        0 => {
            stable(bytes, Slot::decode, Slot::encode);
        }
        1 => {
            stable(bytes, global::Lease::decode, global::Lease::encode);
        }
        2 => {
            stable(bytes, global::decode_newest, |c| global::encode_newest(*c));
        }
        3 => {
            if let Some(h) = stable(bytes, global::Health::decode, global::Health::encode) {
                let _ = h.down();
            }
        }
        4 => wants(bytes),
        5 => pool(bytes),
        6 => {
            stable(
                bytes,
                sluice::breaker::codec::decode,
                sluice::breaker::codec::encode,
            );
        }
        7 => {
            stable(bytes, sluice::bulkhead::codec::decode, |n| {
                sluice::bulkhead::codec::encode(*n)
            });
        }
        8 => {
            stable(
                bytes,
                sluice::retry::codec::decode,
                sluice::retry::codec::encode,
            );
        }
        9 => shed(bytes),
        10 => {
            use sluice::shed::adaptive::Auto;
            stable(bytes, Auto::decode, Auto::encode);
        }
        _ => rule_state(bytes),
    }
}

/// Demand records: a value longer than the encoder writes (it cuts at
/// `MAX_VALUE_LEN`) may be read back; re-encoded, it is cut.
fn wants(bytes: &[u8]) {
    let Ok(wants) = global::decode_wants(bytes) else {
        return;
    };
    let (again, left_out) = global::encode_wants(wants.iter());
    let fits = |w: &global::Want| {
        w.values.len() <= 255 && w.values.iter().all(|v| v.len() <= global::MAX_VALUE_LEN)
    };
    let decoded = global::decode_wants(&again).expect("encoded wants decode");
    if left_out.is_empty() && wants.iter().all(fits) {
        assert_eq!(decoded, wants, "wants re-encoded differ");
        assert_eq!(again, bytes, "wants that decode are not canonical");
    }
}

/// A shed entry: `None` for anything not one.
fn shed(bytes: &[u8]) {
    use sluice::shed::codec::{decode_shared, encode_shared};
    let Some(v) = decode_shared(bytes) else {
        return;
    };
    let again = encode_shared(&v);
    assert_eq!(
        decode_shared(&again),
        Some(v),
        "shed entry re-encoded differs"
    );
}

fn u128_of(bytes: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    for (d, s) in b.iter_mut().zip(bytes) {
        *d = *s;
    }
    u128::from_le_bytes(b)
}

fn u64_of(bytes: &[u8]) -> u64 {
    u128_of(bytes) as u64
}

/// A global pool's state: any 128 bits decode; re-encoded, the same pool.
fn pool(bytes: &[u8]) {
    let p = Pool::decode(u128_of(bytes));
    assert_eq!(Pool::decode(p.encode()), p, "pool re-encoded differs");
    let now = u64_of(bytes.get(16..).unwrap_or_default());
    let _ = p.live(now);
}

/// The rules whose algorithms decide on states read back.
const RULES: &str = r#"{"rate_limits":[
 {"name":"b","bucket":{"rate":7,"period":"3s","burst":5},"cost":{"max":5}},
 {"name":"s","bucket":{"rate":200,"period":"1s","burst":1},"on_limit":"delay","max_delay":"20ms"},
 {"name":"w","algorithm":"sliding_window","window":{"limit":9,"period":"1m"},"cost":{"max":9}},
 {"name":"h","algorithm":"sliding_window","window":{"limit":4294967295,"period":"8784h"}},
 {"name":"g","key":["path"],"algorithm":"sliding_window","window":{"limit":100,"period":"1h"},
  "global":{"cluster":"rls","instances":2}}]}"#;

/// A rule's state of any value (a slot whose check passed, or a state
/// forged by a writer of another version) at any time, any cost: the
/// algorithm decides without panicking, and what it would write decodes.
fn rule_state(bytes: &[u8]) {
    let config = sluice::wiring::parse(RULES.as_bytes()).expect("RULES load");
    let state = u128_of(bytes).min(sluice::ratelimit::codec::MAX_TAT);
    let rest = bytes.get(16..).unwrap_or_default();
    let now = u64_of(rest);
    let cost = u64_of(rest.get(8..).unwrap_or_default()) % 16;
    let slack = u64_of(rest.get(16..).unwrap_or_default()) % 100_000_000;
    let mut algorithms: Vec<Algorithm> = config.rules.iter().map(|r| r.algorithm).collect();
    for r in &config.rules {
        if let Some(g) = &r.global {
            algorithms.extend([g.limit, g.backstop]);
        }
    }
    for a in algorithms {
        let answer = a.decide(state, now, cost, slack);
        let _ = (answer.allowed(), answer.remaining(), answer.full_in_ns());
        let _ = (a.level(state, now), a.busy(state, now), a.exhausted(now));
        let _ = a.merge(state, a.exhausted(now));
        if !matches!(a, Algorithm::Pool(_)) {
            wait_is_when_it_passes(a, state, now, 1 + cost % a.quota().clamp(1, 16));
        }
        let slot = Slot {
            fingerprint: 7,
            tat: state,
        };
        assert_eq!(Slot::decode(&slot.encode()), Ok(slot));
    }
}

/// Refused, a request of the same cost is admitted once the wait it was
/// told has passed (and the state it was refused on is unchanged).
fn wait_is_when_it_passes(a: Algorithm, state: u128, now: u64, cost: u64) {
    use sluice::ratelimit::bucket::BucketAnswer;
    let BucketAnswer::Deny { wait_ns, .. } = a.decide(state, now, cost, 0) else {
        return;
    };
    // A wait past what a u64 of ns holds is told as the most it can be.
    let Some(then) = now.checked_add(wait_ns).filter(|_| wait_ns < u64::MAX) else {
        return;
    };
    let answer = a.decide(state, then, cost, 0);
    assert!(
        answer.allowed(),
        "{a:?} state {state} at {now}: cost {cost} told to wait {wait_ns} ns, then {answer:?}"
    );
}
