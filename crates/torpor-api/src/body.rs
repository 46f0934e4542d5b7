//! Request bodies: the size caps, reading a body without ever holding more than its cap, and
//! strict JSON parsing, every refusal in the API's error shape with a stable code. Bodies are
//! parsed here (not by axum's extractors) so that every malformed input answers the same way.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap};
use serde::de::DeserializeOwned;
use torpor_control::error::ErrorKind;
use torpor_core::TemplateSpec;
use torpor_runtime::proto;

use crate::errors::{ApiError, ApiResult};
use crate::types::{CreateSandboxBody, CreateTenantBody, ExecBody, ForkBody, SuspendBody};

/// Bodies of JSON requests are small; file uploads have their own, larger cap.
pub const MAX_JSON_BODY: usize = 1 << 20;
pub const MAX_FILE_BODY: usize = proto::MAX_BODY;

/// The raw request body of a JSON route: at most [`MAX_JSON_BODY`] bytes are read (a larger
/// body is refused as soon as it is known to be larger), answered in the API's error shape.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        read_capped(req, MAX_JSON_BODY).await.map(RawBody)
    }
}

/// The declared `Content-Length` of a request, if any.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        ErrorKind::PayloadTooLarge,
        "body_too_large",
        format!("this route takes bodies of at most {limit} bytes"),
    )
}

/// Reads a request's body, refusing it (`413 body_too_large`) from its `Content-Length` before
/// anything is read, or as soon as more than `limit` bytes arrived.
pub async fn read_capped(req: Request, limit: usize) -> ApiResult<Bytes> {
    let (parts, body) = req.into_parts();
    read_body_capped(&parts.headers, body, limit)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge => too_large(limit),
            BodyError::Read(m) => ApiError::new(
                ErrorKind::InvalidArgument,
                "invalid_request",
                format!("cannot read the request body: {m}"),
            ),
        })
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the body is over its route's limit")]
    TooLarge,
    #[error("cannot read the request body: {0}")]
    Read(String),
}

/// Reads a body chunk by chunk, stopping as soon as it passes `limit` bytes; a
/// `Content-Length` over the limit is refused before anything is read.
pub async fn read_body_capped(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, BodyError> {
    use futures::StreamExt as _;
    if content_length(headers).is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut stream = body.into_data_stream();
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(e.to_string()))?;
        if out.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// Parses a JSON body strictly, with errors in the API's shape.
pub fn parse_json<T: DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    if body.len() > MAX_JSON_BODY {
        return Err(ApiError::new(
            ErrorKind::PayloadTooLarge,
            "body_too_large",
            format!("JSON bodies are limited to {MAX_JSON_BODY} bytes"),
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let code = if e.is_syntax() || e.is_eof() {
            "invalid_json"
        } else {
            "invalid_request"
        };
        ApiError::new(
            ErrorKind::InvalidArgument,
            code,
            format!("request body: {e}"),
        )
    })
}

/// Runs every request-body decoder of API v1 on `body`. The fuzz target and the property
/// test call this: any input must give a value or an [`ApiError`], never a panic.
pub fn decode_all_bodies(body: &[u8]) -> usize {
    let body = Bytes::copy_from_slice(body);
    [
        parse_json::<TemplateSpec>(&body).is_ok(),
        parse_json::<CreateSandboxBody>(&body).is_ok(),
        parse_json::<ExecBody>(&body).is_ok(),
        parse_json::<SuspendBody>(&body).is_ok(),
        parse_json::<CreateTenantBody>(&body).is_ok(),
        parse_json::<ForkBody>(&body).is_ok(),
    ]
    .into_iter()
    .filter(|ok| *ok)
    .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn body_decoders_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            decode_all_bodies(&body);
        }

        #[test]
        fn json_shaped_bodies_never_panic(
            keys in proptest::collection::vec("[a-z_]{1,12}", 0..6),
            vals in proptest::collection::vec(prop_oneof![
                Just("null".to_string()), Just("[]".to_string()), Just("{}".to_string()),
                "-?[0-9]{1,20}(\\.[0-9]{1,5})?", "\"[^\"\\\\]{0,20}\"",
                Just("[\"sh\",\"-c\"]".to_string()), Just("{\"kind\":\"host\"}".to_string()),
            ], 0..6),
        ) {
            let fields: Vec<String> = keys.iter().zip(vals.iter()).map(|(k, v)| format!("\"{k}\":{v}")).collect();
            decode_all_bodies(format!("{{{}}}", fields.join(",")).as_bytes());
        }
    }

    #[test]
    fn decoders_accept_their_own_shapes() {
        assert_eq!(decode_all_bodies(br#"{"template":"host"}"#), 1);
        assert_eq!(decode_all_bodies(br#"{"cmd":["true"]}"#), 1);
        assert_eq!(decode_all_bodies(br#"{}"#), 2); // suspend (default tier), fork (count 1)
        assert_eq!(
            decode_all_bodies(br#"{"name":"t","source":{"kind":"host"}}"#),
            1
        );
    }

    #[test]
    fn malformed_json_and_wrong_shapes_have_their_own_codes() {
        let syntax = parse_json::<ForkBody>(&Bytes::from_static(b"{")).unwrap_err();
        assert_eq!(
            (syntax.status().as_u16(), syntax.code()),
            (400, "invalid_json")
        );
        let shape = parse_json::<ForkBody>(&Bytes::from_static(br#"{"count":"x"}"#)).unwrap_err();
        assert_eq!(
            (shape.status().as_u16(), shape.code()),
            (400, "invalid_request")
        );
    }
}
