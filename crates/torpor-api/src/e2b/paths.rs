//! Paths and users as envd names them: resolving an SDK path against the user's home, and the
//! user a request acts as (HTTP Basic user name). A leaf: `envd` and `fs` both use it and
//! neither imports the other for it.

use axum::http::{header, HeaderMap};

use super::connect::{Code, RpcError};

/// E2B's default user home: commands start there, relative paths resolve against it.
pub const HOME: &str = "/home/user";

/// Resolves an envd path: relative paths are against the user's home; `.` and `..` are
/// resolved lexically, and a path climbing above `/` is refused.
pub fn resolve(path: &str, user: Option<&str>) -> Result<String, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "path must not hold NUL bytes",
        ));
    }
    let home = match user {
        Some("root") => "/root",
        _ => HOME,
    };
    let joined = if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() {
        home.to_string()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if path == "~" {
        home.to_string()
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for p in joined.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        format!("path {path:?} escapes the sandbox's root"),
                    ));
                }
            }
            p => parts.push(p),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// The user named by envd's `Authorization: Basic base64(user:)`.
pub(crate) fn basic_user(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v.strip_prefix("Basic ")?.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    Some(s.split(':').next()?.to_string())
}
