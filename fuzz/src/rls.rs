//! Target `rls`: a rate-limit service's responses as bytes, decoded and
//! handed to a global rule's leader as the filter's host would.

use crate::harness::{Host, Input, MemStore, Req};
use crate::headers::{check_rejection, everything};
use sluice::ratelimit::global::proto::{self, Code, Response, Status};

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn int(out: &mut Vec<u8>, field: u64, v: u64) {
    varint(out, field << 3);
    varint(out, v);
}

fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A `RateLimitResponse` of an overall code and one status, as a service
/// writes it (proto3: zeros left out).
pub fn encode(
    overall: u64,
    code: u64,
    per: u64,
    unit: u64,
    remaining: u64,
    reset: (u64, u64),
) -> Vec<u8> {
    let mut status = Vec::new();
    int(&mut status, 1, code);
    let mut limit = Vec::new();
    int(&mut limit, 1, per);
    int(&mut limit, 2, unit);
    bytes(&mut status, 2, &limit);
    if remaining != 0 {
        int(&mut status, 3, remaining);
    }
    let mut duration = Vec::new();
    int(&mut duration, 1, reset.0);
    int(&mut duration, 2, reset.1);
    bytes(&mut status, 4, &duration);
    let mut out = Vec::new();
    int(&mut out, 1, overall);
    bytes(&mut out, 2, &status);
    out
}

fn code_of(v: u64) -> Code {
    match v {
        1 => Code::Ok,
        2 => Code::OverLimit,
        _ => Code::Unknown,
    }
}

/// Fields read off the input, encoded as a service would: they decode to
/// what was written (the unit as its length, the reset rounded up to ms).
fn structured(input: &mut Input<'_>) -> Vec<u8> {
    let mut n = || u64::from_le_bytes(std::array::from_fn(|_| input.byte()));
    let (overall, code, per, unit) = (n() % 4, n() % 4, n(), n() % 9);
    let (remaining, secs, nanos) = (n(), n() % (1 << 41), n() % 1_100_000_000);
    let body = encode(overall, code, per, unit, remaining, (secs, nanos));
    let unit_ms = match unit {
        1 => 1_000,
        2 => 60_000,
        3 => 3_600_000,
        4 => 86_400_000,
        7 => 604_800_000,
        _ => 0,
    };
    let reset_ms =
        (secs < 1 << 40 && nanos < 1_000_000_000).then(|| secs * 1_000 + nanos.div_ceil(1_000_000));
    let want = Response {
        overall: code_of(overall),
        status: Status {
            code: Some(code_of(code)),
            limit: Some((per, unit_ms)),
            remaining: Some(remaining),
            reset_ms,
        },
    };
    assert_eq!(proto::response(&body), Ok(want), "{body:?}");
    body
}

/// The first byte: odd, a response built from fields; even, any bytes.
/// Either is decoded (never a panic) and answers the leader's calls; the
/// requests after it are decided, each refusal well formed.
pub fn rls(data: &[u8]) {
    let mut input = Input(data);
    let body = if input.byte() % 2 == 1 {
        structured(&mut input)
    } else {
        input.0.to_vec()
    };
    let decoded = proto::response(&body);
    assert_eq!(decoded, proto::response(&body), "decode is not a function");
    if let Ok(r) = decoded {
        assert!(r
            .status
            .reset_ms
            .is_none_or(|ms| ms <= (1 << 40) * 1_000 + 1_000));
    }
    let config = everything();
    let store = MemStore::default();
    let mut host = Host::new(config, &store, 1);
    let req = Req::new("GET", "/").with("x-g", b"tenant");
    for round in 0..4 {
        for _ in 0..3 {
            let (id, _) = host.arrive(req.clone());
            host.finish(id, 200, Vec::new());
        }
        host.advance_ms(5);
        host.tick();
        while host.answer_call(Some(&body)) {}
        host.advance_ms(if round == 2 { 2_000 } else { 1 });
        host.tick();
    }
    host.wind_down();
    host.refusals.iter().for_each(check_rejection);
}
