//! envd's signed file URLs (`sbx.download_url(path, …)`, `sbx.upload_url(path, …)`): a
//! `GET`/`POST /files` without `X-Access-Token` is let through when its query carries
//! `signature` (and optionally `signature_expiration`, Unix seconds) made with the sandbox's
//! envd access token, exactly as envd checks it:
//!
//! `signature = "v1_" + base64(sha256("{path}:{operation}:{username}:{token}[:{expiration}]"))`
//! (standard alphabet, no padding), where `path` and `username` are the query's values as sent
//! (`""` when absent) and `operation` is `read` for a download, `write` for an upload. So a
//! signature is bound to one sandbox (its token), one path, one user, one operation and one
//! expiry. The signature is compared in constant time first (`invalid signature`), then the
//! expiry (`signature is already expired`); either is 401.
//!
//! Which sandbox: `E2b-Sandbox-Id` when the request names it; otherwise (the SDK's URL on
//! torpor's single listener names none: `E2B_SANDBOX_URL` is shared by every sandbox) the one
//! sandbox whose token makes the signature, found by computing it for each sandbox. That search
//! reveals nothing (a signature matches at most one sandbox, and guessing one is guessing a
//! 256-bit hash), and it is bounded: [`MAX_SEARCHES`] at once, 429 past that.

use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;
use sha2::{Digest, Sha256};
use torpor_core::{SandboxId, TenantId};

use super::envd::{ctx, ctx_for, Ctx, CtxError};
use super::files::FilesQuery;
use super::{E2b, E2bError};
use crate::auth::constant_time_eq;

/// What a signature allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// Searches for the sandbox of an unaddressed signed request that may run at once.
pub const MAX_SEARCHES: usize = 4;
static SEARCHES: AtomicUsize = AtomicUsize::new(0);

/// envd's v1 signature of (`path`, `op`, `user`) with the sandbox's access `token`, expiring
/// at `expiration` (Unix seconds) if given.
pub fn signature(
    path: &str,
    op: Operation,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let raw = match expiration {
        None => format!("{path}:{}:{user}:{token}", op.as_str()),
        Some(exp) => format!("{path}:{}:{user}:{token}:{exp}", op.as_str()),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Why a signed request is refused (all 401, envd's messages).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignError {
    #[error("invalid signature")]
    Invalid,
    #[error("signature is already expired")]
    Expired,
}

/// The signature parameters of a `/files` query.
#[derive(Debug, Clone, PartialEq)]
pub struct Signed<'a> {
    pub signature: &'a str,
    pub expiration: Option<i64>,
    pub path: &'a str,
    pub user: &'a str,
}

impl<'a> Signed<'a> {
    /// `None` when the query carries no signature.
    pub fn from_query(q: &'a FilesQuery) -> Option<Signed<'a>> {
        Some(Signed {
            signature: q.signature.as_deref()?,
            expiration: q.signature_expiration,
            path: q.path.as_deref().unwrap_or(""),
            user: q.username.as_deref().unwrap_or(""),
        })
    }

    fn matches(&self, op: Operation, token: &str) -> bool {
        let want = signature(self.path, op, self.user, token, self.expiration);
        constant_time_eq(want.as_bytes(), self.signature.as_bytes())
    }

    /// envd's check: the signature first, then its expiry against `now` (Unix seconds).
    pub fn check(&self, op: Operation, token: &str, now: i64) -> Result<(), SignError> {
        if !self.matches(op, token) {
            return Err(SignError::Invalid);
        }
        match self.expiration {
            Some(exp) if exp < now => Err(SignError::Expired),
            _ => Ok(()),
        }
    }
}

fn unauthorized(e: SignError) -> E2bError {
    E2bError::new(StatusCode::UNAUTHORIZED, e.to_string())
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The sandbox a `/files` call acts on: by `X-Access-Token` as every envd call, or, without
/// one, by a signature in its query valid for `op` (see the module docs).
pub fn files_ctx(
    st: &E2b,
    headers: &HeaderMap,
    q: &FilesQuery,
    op: Operation,
) -> Result<Ctx, E2bError> {
    let class = crate::ratelimit::RouteClass::Files;
    let signed = Signed::from_query(q);
    let (Some(signed), false) = (signed, headers.contains_key("x-access-token")) else {
        return ctx(st, headers, class).map_err(|e| e.http());
    };
    let named = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    let rec = match named {
        Some(raw) => {
            let rec = sandbox(st, raw).map_err(|e| e.http())?;
            signed
                .check(op, &st.access_token(&rec.id), now_unix())
                .map_err(unauthorized)?;
            rec
        }
        None => search(st, &signed, op)?,
    };
    let raw = rec.id.as_str().to_string();
    ctx_for(st, rec, &raw, class).map_err(|e| e.http())
}

fn sandbox(st: &E2b, raw: &str) -> Result<torpor_control::SandboxRecord, CtxError> {
    let id = SandboxId::new(raw).map_err(|_| CtxError::UnknownSandbox(raw.to_string()))?;
    match st.api.engine.sandbox(&TenantId::admin(), &id) {
        Ok(rec) if !super::is_snapshot(&rec) => Ok(rec),
        Ok(_) | Err(torpor_control::ControlError::NotFound { .. }) => {
            Err(CtxError::UnknownSandbox(raw.to_string()))
        }
        Err(e) => Err(CtxError::Internal(E2bError::from(e).message)),
    }
}

/// The sandbox whose token makes `signed`'s signature, then its expiry checked.
fn search(
    st: &E2b,
    signed: &Signed<'_>,
    op: Operation,
) -> Result<torpor_control::SandboxRecord, E2bError> {
    struct Slot;
    impl Drop for Slot {
        fn drop(&mut self) {
            SEARCHES.fetch_sub(1, Ordering::AcqRel);
        }
    }
    if SEARCHES.fetch_add(1, Ordering::AcqRel) >= MAX_SEARCHES {
        SEARCHES.fetch_sub(1, Ordering::AcqRel);
        return Err(E2bError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too many signed requests without E2b-Sandbox-Id at once; retry",
        ));
    }
    let _slot = Slot;
    let all = st
        .api
        .engine
        .sandboxes(&TenantId::admin())
        .map_err(E2bError::from)?;
    let found = all
        .into_iter()
        .filter(|rec| !super::is_snapshot(rec))
        .find(|rec| signed.matches(op, &st.access_token(&rec.id)))
        .ok_or_else(|| unauthorized(SignError::Invalid))?;
    signed
        .check(op, &st.access_token(&found.id), now_unix())
        .map_err(unauthorized)?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_envds_v1() {
        // Python: "v1_" + base64.b64encode(sha256(b"a.txt:read::tok").digest()).rstrip(b"=")
        assert_eq!(
            signature("a.txt", Operation::Read, "", "tok", None),
            "v1_gDv73H8R9a10OdCSX0/JNMqMYLPpmCQAYJY+U68oQjM"
        );
        let s = signature("/x", Operation::Write, "user", "tok", Some(1_700_000_000));
        assert!(s.starts_with("v1_") && !s.ends_with('='));
    }

    #[test]
    fn a_signature_binds_path_user_operation_token_and_expiry() {
        let sig = signature("/f", Operation::Read, "user", "tok", Some(100));
        let ok = Signed {
            signature: &sig,
            expiration: Some(100),
            path: "/f",
            user: "user",
        };
        assert_eq!(ok.check(Operation::Read, "tok", 100), Ok(()));
        assert_eq!(
            ok.check(Operation::Read, "tok", 101),
            Err(SignError::Expired)
        );
        assert_eq!(
            ok.check(Operation::Write, "tok", 0),
            Err(SignError::Invalid)
        );
        assert_eq!(
            ok.check(Operation::Read, "other", 0),
            Err(SignError::Invalid)
        );
        for bad in [
            Signed {
                path: "/g",
                ..ok.clone()
            },
            Signed {
                user: "root",
                ..ok.clone()
            },
            Signed {
                expiration: Some(10_000),
                ..ok.clone()
            },
            Signed {
                expiration: None,
                ..ok.clone()
            },
        ] {
            assert_eq!(
                bad.check(Operation::Read, "tok", 0),
                Err(SignError::Invalid)
            );
        }
    }
}
