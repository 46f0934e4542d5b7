//! Authentication: a bearer token resolved to a tenant (the admin token to the admin), the
//! middleware that does it for every `/v1` route and takes the tenant's rate-limit token, and
//! the guard of the operator's routes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use torpor_control::error::ErrorKind;
use torpor_core::TenantId;

use crate::errors::{ApiError, ApiResult};
use crate::state::ApiState;

/// Resolves the bearer token to a tenant, takes its rate-limit token for the route's class and
/// hands the tenant to the handler (an `Extension<TenantId>`).
pub async fn authenticate(
    State(state): State<Arc<ApiState>>,
    mut req: Request,
    next: Next,
) -> Response {
    match tenant_of(&state, req.headers()) {
        Ok(tenant) => {
            let class = crate::ratelimit::RouteClass::of_v1_path(req.uri().path());
            if let Err(e) = crate::ratelimit::check(&*state, &tenant, class) {
                return e.into_response();
            }
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

/// The token of an `Authorization: Bearer TOKEN` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The tenant whose bearer token the request carries (recorded as the request's caller).
pub fn tenant_of(state: &ApiState, headers: &HeaderMap) -> ApiResult<TenantId> {
    let tenant = match bearer(headers) {
        Some(t) if constant_time_eq(t.as_bytes(), state.admin_token.as_bytes()) => {
            TenantId::admin()
        }
        Some(t) => match state.engine.tenant_for_token(t) {
            Ok(Some(tenant)) => tenant,
            Ok(None) => {
                return Err(ApiError::new(
                    ErrorKind::Unauthenticated,
                    "unauthorized",
                    "the bearer token is not valid",
                ))
            }
            Err(e) => return Err(ApiError::from(e)),
        },
        None => {
            return Err(ApiError::new(
                ErrorKind::Unauthenticated,
                "unauthorized",
                "missing `Authorization: Bearer TOKEN` header",
            ))
        }
    };
    crate::request_id::set_caller(&tenant);
    Ok(tenant)
}

/// Compares secrets in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses (`403 forbidden`) anyone but the operator (the admin token); `what` says what the
/// operator's token is needed for.
pub fn operator_only(tenant: &TenantId, what: &str) -> ApiResult<()> {
    if *tenant == TenantId::admin() {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorKind::Forbidden,
            "forbidden",
            format!("only the operator's (admin) token {what}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header_only() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer  tok ".parse().unwrap());
        assert_eq!(bearer(&h), Some("tok"));
    }

    #[test]
    fn only_the_admin_passes_the_operator_guard() {
        assert!(operator_only(&TenantId::admin(), "manages tenants").is_ok());
        let e = operator_only(&TenantId::new("t1").unwrap(), "manages tenants").unwrap_err();
        assert_eq!((e.status().as_u16(), e.code()), (403, "forbidden"));
        assert_eq!(
            e.message(),
            "only the operator's (admin) token manages tenants"
        );
    }
}
