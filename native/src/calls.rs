//! Calls out of the filter (the global rules' token requests): a unary
//! gRPC call is an HTTP/2 stream to the cluster that Envoy's
//! configuration starts (`http_filter_config_start_http_stream`) and whose
//! events come back on the main thread, with gRPC's framing done here (the
//! ABI has no gRPC client): a POST to `/{service}/{method}` with
//! `content-type: application/grpc` and `te: trailers`, the message behind
//! a 5-byte prefix (not compressed, its length big-endian); the answer is
//! good only with `:status` 200, `grpc-status` 0 (in the trailers, or in
//! the headers of a trailers-only answer) and exactly one uncompressed
//! message. Anything else, a reset or the timeout, is a failed call
//! (`None`), as the wasm build's gRPC client reports one.

use crate::abi::{self, Buffer, ConfigEnvoyPtr, Header};
use crate::adapter::Call;
use std::collections::HashMap;

/// The largest answer read: a `RateLimitResponse` is a few hundred bytes.
pub const MAX_ANSWER: usize = 64 * 1024;

/// The gRPC frame of one uncompressed message.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len() + 5);
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out
}

/// The one message of a framed answer, if it is exactly one uncompressed
/// frame.
pub fn unframe(body: &[u8]) -> Option<&[u8]> {
    let (&[flag, a, b, c, d], message) = body.split_first_chunk::<5>()?;
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    (flag == 0 && message.len() == len).then_some(message)
}

/// Calls a pipeline asked for where none is started (a worker's pipeline,
/// which never leads; the answer to a call): said in the log. The core
/// asks for calls only from the leader's tick, which starts them; a call
/// asked for and never started would leave its key waiting for it.
pub fn not_started(calls: &[Call], from: &str) {
    if !calls.is_empty() {
        log::warn!(
            "sluice: {} call(s) asked for by {from} not started",
            calls.len()
        );
    }
}

/// The request headers of a call.
pub fn headers(c: &Call) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".to_string()),
        (":path", format!("/{}/{}", c.service, c.method)),
        (":authority", c.cluster.clone()),
        ("content-type", "application/grpc".to_string()),
        ("te", "trailers".to_string()),
        ("grpc-timeout", format!("{}m", c.timeout.as_ms().max(1))),
    ]
}

/// Starts call `c` from Envoy's configuration `config` (on the main
/// thread); Envoy's id of its stream, or `None` if it could not start (no
/// event follows then).
pub fn start(config: ConfigEnvoyPtr, c: &Call) -> Option<u64> {
    let pairs = headers(c);
    let hs: Vec<Header> = pairs.iter().map(|(k, v)| Header::of(k, v)).collect();
    let body = frame(&c.message);
    let mut id = 0;
    // SAFETY: `config` is Envoy's live configuration and this is the main
    // thread; every buffer describes a live slice for the call (Envoy
    // copies them).
    let started = unsafe {
        abi::envoy_dynamic_module_callback_http_filter_config_start_http_stream(
            config,
            &mut id,
            Buffer::of(c.cluster.as_bytes()),
            hs.as_ptr(),
            hs.len(),
            Buffer::of(&body),
            true,
            c.timeout.as_ms().max(1),
        )
    };
    (started == abi::CALLOUT_STARTED).then_some(id)
}

/// What has come back of one call so far.
#[derive(Default)]
struct Answer {
    /// The pipeline's id of the call.
    call: u64,
    status: Option<Vec<u8>>,
    grpc_status: Option<Vec<u8>>,
    body: Vec<u8>,
    too_big: bool,
}

impl Answer {
    /// Takes `:status` and a trailers-only answer's `grpc-status`.
    fn headers(&mut self, headers: &[(Vec<u8>, Vec<u8>)]) {
        for (k, v) in headers {
            match k.as_slice() {
                b":status" => self.status = Some(v.clone()),
                b"grpc-status" => self.grpc_status = Some(v.clone()),
                _ => {}
            }
        }
    }

    /// The message, if the call succeeded.
    fn message(self) -> Option<Vec<u8>> {
        let ok = self.status.as_deref() == Some(b"200")
            && self.grpc_status.as_deref() == Some(b"0")
            && !self.too_big;
        if !ok {
            return None;
        }
        unframe(&self.body).map(<[u8]>::to_vec)
    }
}

/// The calls under way, by Envoy's stream id (one configuration's, on the
/// main thread), and the one being started.
///
/// Envoy may end a stream inside `start_http_stream` itself, before it
/// returns the stream's id (a cluster without a healthy host answers 503
/// at once): every event for a stream not known then belongs to the call
/// being started ([`InFlight::begin`]), and its end is handed back when
/// the start returns ([`InFlight::started`]). Without that, such a call
/// never ended for the pipeline, and its key was never asked for again.
#[derive(Default)]
pub struct InFlight {
    calls: HashMap<u64, Answer>,
    starting: Option<Starting>,
}

/// A call being started, and how its stream ended if it did meanwhile
/// (`Some(true)`: complete; `Some(false)`: reset).
struct Starting {
    answer: Answer,
    ended: Option<bool>,
}

impl InFlight {
    /// Call `call` is being started: events until [`InFlight::started`]
    /// for a stream not known are its.
    pub fn begin(&mut self, call: u64) {
        let answer = Answer {
            call,
            ..Answer::default()
        };
        self.starting = Some(Starting {
            answer,
            ended: None,
        });
    }

    /// The start returned: its stream's id (`None`: it did not start). The
    /// call goes on as that stream, or, if its stream already ended (or it
    /// did not start), the call's id and its message (`None`: failed).
    pub fn started(&mut self, stream: Option<u64>) -> Option<(u64, Option<Vec<u8>>)> {
        let s = self.starting.take()?;
        match (stream, s.ended) {
            (Some(stream), None) => {
                self.calls.insert(stream, s.answer);
                None
            }
            (_, Some(true)) => Some((s.answer.call, s.answer.message())),
            (_, Some(false)) | (None, None) => Some((s.answer.call, None)),
        }
    }

    /// How many are under way.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// The answer of stream `stream` so far: a call under way, or the one
    /// being started.
    fn answer(&mut self, stream: u64) -> Option<&mut Answer> {
        match self.calls.get_mut(&stream) {
            Some(a) => Some(a),
            None => self
                .starting
                .as_mut()
                .filter(|s| s.ended.is_none())
                .map(|s| &mut s.answer),
        }
    }

    /// The answer's headers.
    pub fn headers(&mut self, stream: u64, headers: &[(Vec<u8>, Vec<u8>)]) {
        if let Some(a) = self.answer(stream) {
            a.headers(headers);
        }
    }

    /// A piece of the answer's body.
    pub fn data(&mut self, stream: u64, bytes: &[u8]) {
        if let Some(a) = self.answer(stream) {
            if a.body.len() + bytes.len() > MAX_ANSWER {
                a.too_big = true;
            } else {
                a.body.extend_from_slice(bytes);
            }
        }
    }

    /// The answer's trailers (`grpc-status`).
    pub fn trailers(&mut self, stream: u64, trailers: &[(Vec<u8>, Vec<u8>)]) {
        if let Some(a) = self.answer(stream) {
            for (k, v) in trailers {
                if k.as_slice() == b"grpc-status" {
                    a.grpc_status = Some(v.clone());
                }
            }
        }
    }

    /// The stream ended (`complete`) or was reset: the call's id and its
    /// message, `None` for a failed call; nothing for a stream not known
    /// (the call being started's end is kept for [`InFlight::started`]).
    pub fn end(&mut self, stream: u64, complete: bool) -> Option<(u64, Option<Vec<u8>>)> {
        let Some(a) = self.calls.remove(&stream) else {
            if let Some(s) = self.starting.as_mut().filter(|s| s.ended.is_none()) {
                s.ended = Some(complete);
            }
            return None;
        };
        let call = a.call;
        Some((call, if complete { a.message() } else { None }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
        list.iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_message_is_framed_and_unframed() {
        let f = frame(b"abc");
        assert_eq!(f, [0, 0, 0, 0, 3, b'a', b'b', b'c']);
        assert_eq!(unframe(&f), Some(&b"abc"[..]));
        assert_eq!(unframe(&frame(b"")), Some(&b""[..]));
        // Compressed, cut short, two messages, no prefix: not read.
        assert_eq!(unframe(&[1, 0, 0, 0, 1, b'a']), None);
        assert_eq!(unframe(&[0, 0, 0, 0, 2, b'a']), None);
        assert_eq!(unframe(&[0, 0, 0, 0, 1, b'a', 0]), None);
        assert_eq!(unframe(&[0, 0]), None);
    }

    #[test]
    fn an_answer_counts_only_with_status_200_grpc_status_0_and_one_message() {
        let mut f = InFlight::default();
        let go = |f: &mut InFlight, stream, call| {
            f.begin(call);
            assert_eq!(f.started(Some(stream)), None);
        };
        let ok = |f: &mut InFlight, stream, trailers: &[(&str, &str)]| {
            go(f, stream, 7);
            f.headers(stream, &pairs(&[(":status", "200")]));
            f.data(stream, &frame(b"hi")[..3]);
            f.data(stream, &frame(b"hi")[3..]);
            f.trailers(stream, &pairs(trailers));
            f.end(stream, true)
        };
        assert_eq!(
            ok(&mut f, 1, &[("grpc-status", "0")]),
            Some((7, Some(b"hi".to_vec())))
        );
        assert_eq!(ok(&mut f, 2, &[("grpc-status", "14")]), Some((7, None)));
        assert_eq!(ok(&mut f, 3, &[]), Some((7, None)), "no grpc-status");
        // A trailers-only answer: grpc-status in the headers, no message.
        go(&mut f, 4, 8);
        f.headers(4, &pairs(&[(":status", "200"), ("grpc-status", "0")]));
        assert_eq!(f.end(4, true), Some((8, None)));
        go(&mut f, 5, 9);
        f.headers(5, &pairs(&[(":status", "503"), ("grpc-status", "14")]));
        assert_eq!(f.end(5, true), Some((9, None)));
        // A reset, an unknown stream, a body past the bound.
        go(&mut f, 6, 10);
        f.headers(6, &pairs(&[(":status", "200")]));
        assert_eq!(f.end(6, false), Some((10, None)));
        assert_eq!(f.end(99, true), None);
        go(&mut f, 7, 11);
        f.headers(7, &pairs(&[(":status", "200")]));
        f.data(7, &vec![0; MAX_ANSWER + 1]);
        f.trailers(7, &pairs(&[("grpc-status", "0")]));
        assert_eq!(f.end(7, true), Some((11, None)));
        assert_eq!(f.len(), 0);
    }

    /// Envoy ends a call's stream inside `start_http_stream` (a cluster
    /// without a healthy host answers at once): the events, for a stream
    /// not known yet, are the call being started's, and its end comes back
    /// when the start returns, once.
    #[test]
    fn a_call_that_ends_while_it_starts_is_handed_back_when_the_start_returns() {
        let mut f = InFlight::default();
        // Answered and complete before the id is known.
        f.begin(3);
        f.headers(40, &pairs(&[(":status", "200")]));
        f.data(40, &frame(b"ok"));
        f.trailers(40, &pairs(&[("grpc-status", "0")]));
        assert_eq!(f.end(40, true), None);
        assert_eq!(f.started(Some(40)), Some((3, Some(b"ok".to_vec()))));
        assert_eq!(f.end(40, true), None, "not twice");
        // Reset (Envoy's 503 with no healthy host) before the id is known.
        f.begin(4);
        f.headers(41, &pairs(&[(":status", "503")]));
        assert_eq!(f.end(41, false), None);
        assert_eq!(f.started(Some(41)), Some((4, None)));
        // Not started: a failed call; a normal start: nothing yet.
        f.begin(5);
        assert_eq!(f.started(None), Some((5, None)));
        f.begin(6);
        assert_eq!(f.started(Some(42)), None);
        assert_eq!(f.end(42, false), Some((6, None)));
        assert_eq!(f.len(), 0);
        // Nothing being started: an unknown stream's events are dropped.
        f.end(43, true);
        assert_eq!(f.started(Some(43)), None);
    }
}
