//! Fuzz entry points for envd's `filesystem.Filesystem/*` request messages and the `/files`
//! upload (query, `Authorization: Basic` user, multipart body), decoded the way
//! [`super::filesystem_rpc`] and [`super::upload`] decode them. Reached through
//! `crate::fuzzing`; not part of the API.

use super::connect::Framing;
use super::*;
use crate::e2b::files::FilesQuery;
use axum::body::Bytes;
use axum::extract::Query;

/// The methods of `filesystem.Filesystem` that are served, and whether each is a stream.
pub const FILESYSTEM_METHODS: &[(&str, bool)] = &[
    ("WatchDir", true),
    ("Stat", false),
    ("MakeDir", false),
    ("Move", false),
    ("ListDir", false),
    ("Remove", false),
    ("CreateWatcher", false),
    ("GetWatcherEvents", false),
    ("RemoveWatcher", false),
];

/// [`resolve`], with what it promises checked: an absolute path with no empty, `.` or `..`
/// segment and no NUL byte, so that nothing the caller wrote climbs out of `/`.
pub fn resolve_checked(path: &str, user: Option<&str>) -> Result<String, RpcError> {
    let p = resolve(path, user)?;
    assert!(
        p.starts_with('/'),
        "resolved {path:?} to {p:?}: not absolute"
    );
    assert!(!p.contains('\0'), "resolved {path:?} to a path with a NUL");
    if p != "/" {
        assert!(
            p[1..]
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != ".."),
            "resolved {path:?} to {p:?}: an empty, '.' or '..' segment is left"
        );
    }
    Ok(p)
}

/// `body` as the request of `filesystem.Filesystem/{method}` framed as `framing`, its paths
/// resolved as the handler resolves them for `user` (envd's Basic user).
pub fn path_message(
    method: &str,
    framing: Framing,
    body: &[u8],
    user: Option<&str>,
) -> Result<(), RpcError> {
    let streaming = method == "WatchDir";
    let known = FILESYSTEM_METHODS.iter().any(|(m, _)| *m == method);
    connect::check_method("filesystem.Filesystem", method, known, streaming, framing)?;
    let req: PathRequest = connect::parse_request(framing, body)?;
    match method {
        "Stat" | "MakeDir" | "ListDir" | "Remove" | "CreateWatcher" | "WatchDir" => {
            resolve_checked(&req.path, user)?;
            let _ = req.depth.unwrap_or(1).clamp(1, 32);
        }
        "Move" => {
            resolve_checked(&req.source, user)?;
            resolve_checked(&req.destination, user)?;
        }
        _ => {}
    }
    Ok(())
}

/// The `/files` upload's decoding: `query` (the URI's query string) as [`FilesQuery`], the
/// Basic user of `authorization`, and `body` as `multipart/form-data` when `content_type` says
/// so (its parts sliced out of the body as the handler slices them), each target path resolved.
/// Answers how many files the upload would write.
pub fn files_upload(
    query: &str,
    authorization: &[u8],
    content_type: &str,
    body: &[u8],
) -> Result<usize, String> {
    let uri: axum::http::Uri = format!("/files?{query}")
        .parse()
        .map_err(|e| format!("uri: {e}"))?;
    let Query(q) = Query::<FilesQuery>::try_from_uri(&uri).map_err(|e| e.body_text())?;
    let mut headers = HeaderMap::new();
    if let Ok(v) = axum::http::HeaderValue::from_bytes(authorization) {
        headers.insert(header::AUTHORIZATION, v);
    }
    let user = q.username.clone().or_else(|| basic_user(&headers));
    let body = Bytes::copy_from_slice(body);
    let mut targets = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let boundary = super::super::multipart::boundary(content_type)
            .ok_or("multipart body without a boundary")?;
        let parts = super::super::multipart::parse(&body, &boundary)?;
        assert!(parts.len() <= 1001, "{} parts passed the cap", parts.len());
        let single = parts.len() == 1;
        for p in parts {
            let target = match (&q.path, p.filename.as_deref()) {
                (Some(path), _) if single => path.clone(),
                (_, Some(f)) if !f.is_empty() => f.to_string(),
                (Some(path), _) => path.clone(),
                _ => return Err("a part names no file and no path= was given".into()),
            };
            let data = body.slice_ref(p.data);
            assert_eq!(&data[..], p.data);
            targets.push(target);
        }
    } else {
        targets.push(q.path.clone().ok_or("path= is required")?);
    }
    for t in &targets {
        let path = resolve_checked(t, user.as_deref()).map_err(|e| e.message)?;
        let _ = parent_and_name(&path);
    }
    Ok(targets.len())
}

/// The `/files` upload's `X-Metadata-*` headers: `data` as lines `key: value`, each sent as
/// `X-Metadata-<key>` (lines HTTP cannot carry are dropped, as hyper would refuse them), read
/// as the handler reads them. Answers how many keys were accepted.
///
/// Asserted: an accepted set passes envd's rules, and every attribute the agent would name
/// from it is `user.e2b.` followed by the key, NUL-free and within Linux's 255 bytes; a refused
/// one is a 400 that says `invalid metadata`.
pub fn files_metadata(data: &[u8]) -> Result<usize, String> {
    use torpor_runtime::proto::{self, METADATA_XATTR_PREFIX};
    let mut headers = HeaderMap::new();
    for line in data.split(|b| *b == b'\n') {
        let mut kv = line.splitn(2, |b| *b == b':');
        let key = kv.next().unwrap_or_default();
        let value = kv.next().unwrap_or_default().trim_ascii_start();
        let mut name = b"x-metadata-".to_vec();
        name.extend_from_slice(key);
        let (Ok(n), Ok(v)) = (
            axum::http::HeaderName::from_bytes(&name),
            axum::http::HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        headers.append(n, v);
    }
    match super::metadata::from_headers(&headers) {
        Ok(m) => {
            assert_eq!(proto::validate_metadata(&m), Ok(()), "{m:?}");
            for k in m.keys() {
                let attr = format!("{METADATA_XATTR_PREFIX}{k}");
                assert!(
                    attr.starts_with(METADATA_XATTR_PREFIX) && attr.len() <= 255,
                    "{attr:?}"
                );
                assert!(!attr.contains('\0') && !k.is_empty(), "{attr:?}");
                assert_eq!(k.to_ascii_lowercase(), *k, "keys are lowercased");
            }
            Ok(m.len())
        }
        Err(e) => {
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(e.message.starts_with("invalid metadata: "), "{}", e.message);
            Err(e.message)
        }
    }
}
