//! Path and query parameters: ids parsed into their newtypes, and a rejected query string, in
//! the API's error shape. A malformed id cannot name anything: it answers as an unknown one.

use axum::extract::rejection::QueryRejection;
use torpor_control::error::ErrorKind;
use torpor_core::{SandboxId, TemplateName, TenantId};

use crate::errors::{ApiError, ApiResult};

fn not_found(what: &str, raw: &str) -> ApiError {
    ApiError::new(
        ErrorKind::NotFound,
        "not_found",
        format!("{what} {raw:?} not found"),
    )
}

pub fn sandbox_id(raw: &str) -> ApiResult<SandboxId> {
    SandboxId::new(raw).map_err(|_| not_found("sandbox", raw))
}

pub fn template_name(raw: &str) -> ApiResult<TemplateName> {
    TemplateName::new(raw).map_err(|_| not_found("template", raw))
}

pub fn tenant_name(raw: &str) -> ApiResult<TenantId> {
    TenantId::new(raw).map_err(|_| not_found("tenant", raw))
}

/// A query string that does not parse: `400 invalid_request` with axum's explanation.
pub fn bad_query(e: QueryRejection) -> ApiError {
    ApiError::new(ErrorKind::InvalidArgument, "invalid_request", e.body_text())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_ids_answer_as_unknown_ones() {
        for e in [
            sandbox_id("../etc").unwrap_err(),
            template_name("a/b").unwrap_err(),
            tenant_name("").unwrap_err(),
        ] {
            assert_eq!((e.status().as_u16(), e.code()), (404, "not_found"));
        }
    }
}
