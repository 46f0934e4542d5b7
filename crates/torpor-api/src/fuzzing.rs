//! Entry points for the fuzz targets (`fuzz/fuzz_targets/`) and the decoder property tests
//! (`tests/fuzz_decoders.rs`): each runs a family of decoders of untrusted input on arbitrary
//! bytes the way the server runs them, before anything reaches the engine or a sandbox. They
//! must never panic on any input; the assertions in them state what the decoders promise (a
//! failing one is a bug, as a panic is). Not part of the API.
//!
//! - [`connect_envelopes`]: Connect envelopes (whole and incremental) and every served
//!   `process.Process/*` and `filesystem.Filesystem/*` request message, both framings.
//! - [`e2b_bodies`]: the E2B control plane's JSON bodies (create, connect, timeout, network)
//!   under each kind of template policy, list queries, and envd's `/files` upload (query,
//!   Basic user, multipart body, `X-Metadata-*` headers).
//! - [`pool_spec`]: `POST /v1/pools`'s body and its validation (the trigger settings and the
//!   broker allow-list are fuzzed in `torpor_triggers::fuzzing`).

use axum::body::Bytes;
use torpor_core::network::{AllowList, AllowRule};
use torpor_core::NetworkPolicy;

use crate::e2b::connect::{self, Envelope, EnvelopeDecoder};
pub use crate::e2b::connect::{Framing, RpcError};
pub use crate::e2b::control::fuzzing::{create_body, list_query, network_body, timeout_body};
pub use crate::e2b::envd::fuzzing::{process_message, PROCESS_METHODS};
pub use crate::e2b::fs::fuzzing::{
    files_metadata, files_upload, path_message, resolve_checked, FILESYSTEM_METHODS,
};

/// The messages of a client stream whose body arrives in chunks of `chunks` bytes (cycled; an
/// empty list or zeros: one chunk), decoded by [`EnvelopeDecoder`] as the handlers decode it.
///
/// Asserted: the answer is [`connect::decode_envelopes`]'s for the whole body (the same
/// messages, or the same error), and no message passes [`connect::MAX_MESSAGE`].
pub fn envelope_stream(body: &[u8], chunks: &[usize]) -> Result<Vec<Bytes>, RpcError> {
    let whole = connect::decode_envelopes(body);
    let mut d = EnvelopeDecoder::default();
    let mut out = Vec::new();
    let mut rest = body;
    let mut sizes = chunks.iter().copied().filter(|n| *n > 0).cycle();
    let chunked = loop {
        match d.next_envelope() {
            Err(e) => break Err(e),
            Ok(Some(Envelope::Message(m))) => out.push(m),
            Ok(Some(Envelope::End(_))) => break Ok(out),
            Ok(None) if rest.is_empty() => break d.finish().map(|()| out),
            Ok(None) => {
                let n = sizes.next().unwrap_or(rest.len()).min(rest.len());
                d.push(&rest[..n]);
                rest = &rest[n..];
            }
        }
    };
    assert_eq!(whole, chunked, "chunks {chunks:?} changed what was decoded");
    if let Ok(msgs) = &chunked {
        assert!(msgs.iter().all(|m| m.len() <= connect::MAX_MESSAGE));
    }
    chunked
}

/// Connect's decoders on arbitrary bytes. The first byte picks the chunk sizes of the
/// incremental decoder and envd's Basic user; the rest is the body.
pub fn connect_envelopes(data: &[u8]) {
    let (sel, body) = data.split_first().map_or((0, data), |(s, b)| (*s, b));
    let chunks = [usize::from(sel & 0x0f) + 1, usize::from(sel >> 4) * 7 + 1];
    if let Ok(m) = connect::decode_envelope(body) {
        assert_eq!(m.len() + 5, body.len());
        assert!(m.len() <= connect::MAX_MESSAGE);
    }
    let _ = envelope_stream(body, &chunks);
    let _ = envelope_stream(body, &[]);
    let user = match sel & 0x03 {
        0 => None,
        1 => Some("root"),
        _ => Some("user"),
    };
    for framing in [Framing::Unary, Framing::Stream] {
        let _ = connect::parse_request::<serde_json::Value>(framing, body);
        for (method, _) in PROCESS_METHODS {
            let _ = process_message(method, framing, body, &chunks);
        }
        for (method, _) in FILESYSTEM_METHODS {
            let _ = path_message(method, framing, body, user);
        }
    }
}

/// The template policies the E2B bodies are checked under: no network, `none`, `full`, and a
/// restricting allow-list.
pub fn template_policies() -> [Option<NetworkPolicy>; 4] {
    let restricted = NetworkPolicy::Allow(AllowList {
        allow: vec![AllowRule {
            cidr: "10.1.0.0/16".into(),
            ports: vec![443],
        }],
        hosts: vec!["example.com".into()],
        ..AllowList::default()
    });
    [
        None,
        Some(serde_json::from_str("\"none\"").expect("a network mode")),
        Some(NetworkPolicy::full()),
        Some(restricted),
    ]
}

/// The E2B control plane's and envd's `/files` decoders on arbitrary bytes. The first byte
/// picks the template policy and the list's version; for the `/files` upload the input is
/// `query \n authorization \n content-type \n body`.
pub fn e2b_bodies(data: &[u8]) {
    let (sel, body) = data.split_first().map_or((0, data), |(s, b)| (*s, b));
    let policies = template_policies();
    let template = policies[usize::from(sel) % policies.len()].as_ref();
    let _ = create_body(body, template);
    let _ = network_body(body, template);
    let _ = timeout_body(body, sel & 0x10 != 0);
    let text = String::from_utf8_lossy(body);
    let _ = list_query(&text, sel & 0x20 != 0);
    let mut fields = body.splitn(4, |b| *b == b'\n');
    let query = String::from_utf8_lossy(fields.next().unwrap_or_default());
    let authorization = fields.next().unwrap_or_default();
    let content_type = String::from_utf8_lossy(fields.next().unwrap_or_default());
    let upload = fields.next().unwrap_or_default();
    let _ = files_upload(&query, authorization, &content_type, upload);
    let _ = files_metadata(body);
    // The multipart reader alone, with a boundary the body cannot have chosen.
    let _ = crate::e2b::multipart::parse(body, "b");
    let _ = crate::e2b::multipart::boundary(&text);
}

/// `POST /v1/pools`'s body, decoded as the route decodes it and validated as the engine
/// validates it before anything connects to a broker.
///
/// Asserted: a valid pool's triggers all have the broker addresses the tenant allow-list
/// checks (so no valid pool escapes the check).
pub fn pool_spec(json: &[u8]) -> Result<(), crate::errors::ApiError> {
    let spec: torpor_control::pools::PoolSpec =
        crate::body::parse_json(&Bytes::copy_from_slice(json))?;
    spec.validate()?;
    for (i, t) in spec.triggers.iter().enumerate() {
        let at = format!("triggers[{i}]");
        let addresses = t
            .broker_addresses(&at)
            .unwrap_or_else(|e| panic!("valid {at} {t:?} has no broker address: {e}"));
        assert!(!addresses.is_empty());
    }
    let back = serde_json::to_vec(&spec).expect("a pool spec serialises");
    let again: torpor_control::pools::PoolSpec =
        serde_json::from_slice(&back).expect("a pool spec reads back");
    assert_eq!(spec, again);
    Ok(())
}
