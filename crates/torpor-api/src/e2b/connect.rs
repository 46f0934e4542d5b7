//! Connect-RPC with the JSON codec: unary calls (`application/json`) and server streams
//! (`application/connect+json`, enveloped: 1 flag byte, 4-byte big-endian length, JSON).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tokio::sync::mpsc;

/// A request message may be at most this large (envd's requests are small JSON).
pub const MAX_MESSAGE: usize = 1 << 20;
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";
pub const UNARY_CONTENT_TYPE: &str = "application/json";
/// Flag of the last frame of a stream (its JSON holds `error` and/or `metadata`).
pub const END_STREAM: u8 = 0x02;
const COMPRESSED: u8 = 0x01;

/// Connect's error codes: the one table of kinds, statuses and codes is crate::errors.
pub use crate::errors::ConnectCode as Code;

#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl From<torpor_control::ControlError> for RpcError {
    fn from(e: torpor_control::ControlError) -> Self {
        // The code from the error's kind, the message clients may read (internal details go
        // to the log with the request id): both crate::errors.
        let api = crate::errors::ApiError::from(e);
        RpcError::new(api.connect_code(), api.message())
    }
}

/// Reads the body of a call with one message: at most one envelope of [`MAX_MESSAGE`]
/// (`resource_exhausted` past it, told from `Content-Length` before anything is read).
pub async fn read_message_body(headers: &HeaderMap, body: Body) -> Result<Bytes, RpcError> {
    let limit = MAX_MESSAGE + 5;
    let too_large = || {
        RpcError::new(
            Code::ResourceExhausted,
            format!("message exceeds the limit of {MAX_MESSAGE} bytes"),
        )
    };
    crate::body::read_body_capped(headers, body, limit)
        .await
        .map_err(|e| match e {
            crate::body::BodyError::TooLarge => too_large(),
            crate::body::BodyError::Read(m) => RpcError::new(Code::Canceled, m),
        })
}

/// How a call was framed, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Unary,
    Stream,
}

pub fn framing(headers: &HeaderMap) -> Result<Framing, RpcError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match ct.as_str() {
        UNARY_CONTENT_TYPE => Ok(Framing::Unary),
        STREAM_CONTENT_TYPE => Ok(Framing::Stream),
        other => Err(RpcError::new(
            Code::InvalidArgument,
            format!("content type {other:?} is not served: use the JSON codec (application/json or application/connect+json)"),
        )),
    }
}

/// The one message of a server-stream request: exactly one uncompressed envelope.
pub fn decode_envelope(body: &[u8]) -> Result<&[u8], RpcError> {
    if body.len() < 5 {
        return Err(short_prefix(body.len()));
    }
    let (_, len) = check_prefix(body, false)?;
    if body.len() - 5 != len {
        return Err(wrong_length(len, body.len() - 5));
    }
    Ok(&body[5..])
}

fn short_prefix(have: usize) -> RpcError {
    RpcError::new(
        Code::InvalidArgument,
        format!("envelope of {have} bytes is shorter than its 5-byte prefix"),
    )
}

fn wrong_length(len: usize, carried: usize) -> RpcError {
    RpcError::new(
        Code::InvalidArgument,
        format!("envelope announces {len} bytes but carries {carried}"),
    )
}

/// Checks an envelope's 5-byte prefix (`prefix.len() >= 5`): its flags (compressed is
/// `unimplemented`, any other flag but [`END_STREAM`] where `end_allowed` is
/// `invalid_argument`) and its announced length (over [`MAX_MESSAGE`] is `resource_exhausted`,
/// refused before anything is buffered). Answers (flags, length).
fn check_prefix(prefix: &[u8], end_allowed: bool) -> Result<(u8, usize), RpcError> {
    let flags = prefix[0];
    if flags & COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if flags != 0 && !(end_allowed && flags == END_STREAM) {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("unknown envelope flags {flags:#04x}"),
        ));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes exceeds the limit of {MAX_MESSAGE}"),
        ));
    }
    Ok((flags, len))
}

/// One envelope of a client stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Envelope {
    /// A message (flags 0): its JSON.
    Message(Bytes),
    /// An end-of-stream envelope (flag [`END_STREAM`]): no message follows it.
    End(Bytes),
}

/// Decodes the envelopes of a client stream as its bytes arrive, in chunks of any size: each
/// envelope is answered as soon as it is complete, each prefix checked like
/// [`decode_envelope`]'s as soon as its 5 bytes are there (so an oversized announcement is
/// refused before its message is buffered: at most one message of [`MAX_MESSAGE`] is held).
#[derive(Debug, Default)]
pub struct EnvelopeDecoder {
    buf: bytes::BytesMut,
}

impl EnvelopeDecoder {
    /// Adds bytes received.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, `None` until more bytes are pushed; an error for a bad
    /// prefix (after which the decoder should not be used further).
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, RpcError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let (flags, len) = check_prefix(&self.buf, true)?;
        if self.buf.len() - 5 < len {
            return Ok(None);
        }
        let mut frame = self.buf.split_to(5 + len);
        let json = frame.split_off(5).freeze();
        Ok(Some(if flags == END_STREAM {
            Envelope::End(json)
        } else {
            Envelope::Message(json)
        }))
    }

    /// At the end of the body: an error when an incomplete envelope is left (wrong length).
    pub fn finish(&self) -> Result<(), RpcError> {
        match self.buf.len() {
            0 => Ok(()),
            n if n < 5 => Err(short_prefix(n)),
            n => {
                let (_, len) = check_prefix(&self.buf, true)?;
                Err(wrong_length(len, n - 5))
            }
        }
    }
}

/// The messages of a whole client-stream body: envelopes back to back, up to the end of the
/// body or an end-of-stream envelope (what follows one is not read), checked by
/// [`EnvelopeDecoder`].
pub fn decode_envelopes(body: &[u8]) -> Result<Vec<Bytes>, RpcError> {
    decode_chunks([body])
}

/// The messages of a body that arrives in `chunks`, as [`decode_envelopes`].
fn decode_chunks<'a>(chunks: impl IntoIterator<Item = &'a [u8]>) -> Result<Vec<Bytes>, RpcError> {
    let mut d = EnvelopeDecoder::default();
    let mut out = Vec::new();
    for chunk in chunks {
        d.push(chunk);
        while let Some(e) = d.next_envelope()? {
            match e {
                Envelope::Message(m) => out.push(m),
                Envelope::End(_) => return Ok(out),
            }
        }
    }
    d.finish()?;
    Ok(out)
}

pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(json);
    Bytes::from(out)
}

pub fn message_frame<T: Serialize>(msg: &T) -> Bytes {
    envelope(0, &serde_json::to_vec(msg).expect("messages serialise"))
}

pub fn end_frame(err: Option<&RpcError>) -> Bytes {
    let v = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.json()}),
    };
    envelope(END_STREAM, &serde_json::to_vec(&v).expect("json"))
}

/// Checks a call against its service: an unknown method is `unimplemented`, a known one
/// framed the wrong way (unary vs stream content type) `invalid_argument`.
pub fn check_method(
    service: &str,
    method: &str,
    known: bool,
    streaming: bool,
    framing: Framing,
) -> Result<(), RpcError> {
    if !known {
        return Err(RpcError::new(
            Code::Unimplemented,
            format!("{service}/{method} is not implemented"),
        ));
    }
    if streaming != (framing == Framing::Stream) {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("{service}/{method} is called with the wrong content type"),
        ));
    }
    Ok(())
}

/// Parses the request message of a call framed as `framing`.
pub fn parse_request<T: for<'de> serde::Deserialize<'de>>(
    framing: Framing,
    body: &[u8],
) -> Result<T, RpcError> {
    let json = match framing {
        Framing::Unary => {
            if body.len() > MAX_MESSAGE {
                return Err(RpcError::new(
                    Code::ResourceExhausted,
                    format!("message of {} bytes exceeds the limit", body.len()),
                ));
            }
            body
        }
        Framing::Stream => decode_envelope(body)?,
    };
    let json = if json.is_empty() { &b"{}"[..] } else { json };
    serde_json::from_slice(json)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("request message: {e}")))
}

/// A unary answer.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(UNARY_CONTENT_TYPE),
        )],
        serde_json::to_vec(msg).expect("messages serialise"),
    )
        .into_response()
}

pub fn unary_err(e: &RpcError) -> Response {
    (
        e.code.http_status(),
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(UNARY_CONTENT_TYPE),
        )],
        serde_json::to_vec(&e.json()).expect("json"),
    )
        .into_response()
}

/// An error answered in the framing the call used (a stream's errors travel in its end frame,
/// under status 200).
pub fn error_response(framing: Framing, e: &RpcError) -> Response {
    match framing {
        Framing::Unary => unary_err(e),
        Framing::Stream => stream_response_from(vec![end_frame(Some(e))]),
    }
}

fn stream_headers(resp: &mut Response) {
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(STREAM_CONTENT_TYPE),
    );
}

/// A server stream known whole when it is answered (its frames, the end frame last): one
/// body with its length, which goes out with the headers in one write, where a stream fed
/// frame by frame costs a write (and a wake of the client) per flush.
pub fn stream_response_from(frames: Vec<Bytes>) -> Response {
    let mut resp = Response::new(Body::from(frames.concat()));
    stream_headers(&mut resp);
    resp
}

/// What a stream's producer sends: messages, then (implicitly) the end frame.
pub enum Item {
    Message(Bytes),
    End(Option<RpcError>),
}

/// A server stream fed by a producer task. Each frame is written as soon as it is produced;
/// when the producer stops without an `End`, the stream still ends properly.
pub fn stream_response<F, Fut>(producer: F) -> Response
where
    F: FnOnce(mpsc::Sender<Item>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Item>(32);
    tokio::spawn(producer(tx));
    let mut done = false;
    let body = futures::stream::poll_fn(move |cx| {
        if done {
            return std::task::Poll::Ready(None);
        }
        match rx.poll_recv(cx) {
            std::task::Poll::Ready(Some(Item::Message(b))) => {
                std::task::Poll::Ready(Some(Ok::<_, std::convert::Infallible>(b)))
            }
            std::task::Poll::Ready(Some(Item::End(e))) => {
                done = true;
                std::task::Poll::Ready(Some(Ok(end_frame(e.as_ref()))))
            }
            std::task::Poll::Ready(None) => {
                done = true;
                std::task::Poll::Ready(Some(Ok(end_frame(None))))
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    stream_headers(&mut resp);
    resp
}

/// The deadline a client set with `Connect-Timeout-Ms`.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let f = envelope(0, br#"{"a":1}"#);
        assert_eq!(&f[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(decode_envelope(&f).unwrap(), br#"{"a":1}"#);
        // wrong length, both ways
        let mut long = f.to_vec();
        long.push(b' ');
        assert_eq!(
            decode_envelope(&long).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            decode_envelope(&f[..8]).unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            decode_envelope(&f[..3]).unwrap_err().code,
            Code::InvalidArgument
        );
        // oversized announcement: refused before anything is allocated
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            decode_envelope(&huge).unwrap_err().code,
            Code::ResourceExhausted
        );
        // compressed, unknown flag
        assert_eq!(
            decode_envelope(&envelope(1, b"{}")).unwrap_err().code,
            Code::Unimplemented
        );
        assert_eq!(
            decode_envelope(&envelope(0x80, b"{}")).unwrap_err().code,
            Code::InvalidArgument
        );
        let end = end_frame(Some(&RpcError::new(Code::NotFound, "gone")));
        assert_eq!(end[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "gone");
    }

    #[test]
    fn unary_errors_carry_connect_codes_and_statuses() {
        let r = unary_err(&RpcError::new(Code::Unimplemented, "no"));
        assert_eq!(r.status(), StatusCode::NOT_IMPLEMENTED);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            Code::Unauthenticated.http_status(),
            StatusCode::UNAUTHORIZED
        );
        let mut h = HeaderMap::new();
        assert!(framing(&h).is_err());
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+json"),
        );
        assert_eq!(framing(&h).unwrap(), Framing::Stream);
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/proto"),
        );
        assert!(framing(&h).is_err());
    }

    /// Feeds `body` to a decoder in chunks of `step` bytes; answers the messages up to the end.
    fn decode_in_chunks(body: &[u8], step: usize) -> Result<Vec<Bytes>, RpcError> {
        decode_chunks(body.chunks(step.max(1)))
    }

    #[test]
    fn the_incremental_decoder_answers_each_envelope_once_complete() {
        let a = envelope(0, br#"{"start":{}}"#);
        let b = envelope(0, b"");
        let mut d = EnvelopeDecoder::default();
        assert_eq!(d.next_envelope().unwrap(), None);
        // Byte by byte: nothing until the last byte of the first envelope.
        for (i, byte) in a.iter().enumerate() {
            d.push(&[*byte]);
            let got = d.next_envelope().unwrap();
            if i + 1 < a.len() {
                assert_eq!(got, None, "after {} bytes", i + 1);
                assert!(d.finish().is_err(), "an incomplete envelope is left");
            } else {
                assert_eq!(got, Some(Envelope::Message(a.slice(5..))));
            }
        }
        d.finish().unwrap();
        // Two in one chunk, then an end-of-stream envelope.
        d.push(&[&b[..], &b[..], &end_frame(None)[..]].concat());
        assert_eq!(
            d.next_envelope().unwrap(),
            Some(Envelope::Message(Bytes::new()))
        );
        assert_eq!(
            d.next_envelope().unwrap(),
            Some(Envelope::Message(Bytes::new()))
        );
        assert_eq!(
            d.next_envelope().unwrap(),
            Some(Envelope::End(Bytes::from_static(b"{}")))
        );
        assert_eq!(d.next_envelope().unwrap(), None);
        // What follows an end-of-stream envelope is not read.
        let after_end = [&a[..], &end_frame(None)[..], &a[..], &[9u8][..]].concat();
        assert_eq!(decode_envelopes(&after_end).unwrap(), vec![a.slice(5..)]);
    }

    #[test]
    fn the_incremental_decoder_refuses_bad_prefixes_as_soon_as_they_arrive() {
        let code = |bytes: &[u8]| {
            let mut d = EnvelopeDecoder::default();
            d.push(bytes);
            d.next_envelope().unwrap_err().code
        };
        // Oversized: refused from the prefix alone, before its message arrives.
        assert_eq!(code(&[0, 0xff, 0xff, 0xff, 0xff]), Code::ResourceExhausted);
        assert_eq!(code(&[2, 0x7f, 0xff, 0xff, 0xff]), Code::ResourceExhausted);
        assert_eq!(code(&[1, 0, 0, 0, 2]), Code::Unimplemented);
        assert_eq!(code(&[3, 0, 0, 0, 2]), Code::Unimplemented);
        assert_eq!(code(&[0x40, 0, 0, 0, 2]), Code::InvalidArgument);
        assert_eq!(code(&[0x80, 0, 0, 0, 2]), Code::InvalidArgument);
        // Wrong length: the body ends inside an envelope (its prefix, or its message).
        let f = envelope(0, br#"{"a":1}"#);
        for cut in [1, 3, 5, 8] {
            let e = decode_envelopes(&f[..cut]).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{cut}: {e:?}");
        }
        let e = decode_envelopes(&f[..8]).unwrap_err();
        assert_eq!(e.message, "envelope announces 7 bytes but carries 3");
        assert_eq!(decode_envelopes(&[]).unwrap(), Vec::<Bytes>::new());
        // A single-message request (Start, Connect) still refuses the end-of-stream flag.
        assert_eq!(
            decode_envelope(&envelope(END_STREAM, b"{}"))
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
    }

    proptest::proptest! {
        #[test]
        fn envelope_decoder_never_panics(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = decode_envelope(&body);
            let _ = parse_request::<serde_json::Value>(Framing::Stream, &body);
        }

        /// However the body is cut into chunks, the incremental decoder answers what decoding
        /// it whole answers (the same messages, or an error with the same code and message).
        #[test]
        fn chunking_does_not_change_what_is_decoded(
            msgs in proptest::collection::vec(
                (proptest::sample::select(vec![0u8, 0, 0, 1, 2, 0x40]),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 0..12)),
                0..5),
            cut in 0usize..4,
            step in 1usize..9,
        ) {
            let mut body: Vec<u8> = msgs.iter().flat_map(|(f, m)| envelope(*f, m).to_vec()).collect();
            body.truncate(body.len().saturating_sub(cut));
            let whole = decode_envelopes(&body);
            let chunked = decode_in_chunks(&body, step);
            proptest::prop_assert_eq!(whole, chunked);
        }
    }
}
