//! `GET /v1/usage?tenant=&from=&to=&group_by=`: the usage records of
//! [`torpor_control::usage`], summed per tenant (and per sandbox and hourly interval on
//! request). A tenant sees its own (naming another tenant is `403 forbidden`); the admin sees
//! every tenant's, or one with `tenant=`. `from` and `to` are Unix seconds (default: the last
//! 30 days up to now); intervals that start in `[from, to)` count.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::{Extension, Json};
use serde::Deserialize;
use torpor_control::error::ErrorKind;
use torpor_control::usage::{GroupBy, UsageError, UsageQuery, UsageReport, UsageStore};
use torpor_core::{now_millis, TenantId};

use crate::errors::{ApiError, ApiResult};
use crate::state::ApiState;

/// The default window when `from` is not given.
const DEFAULT_WINDOW_S: i64 = 30 * 24 * 3600;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageParams {
    tenant: Option<String>,
    from: Option<i64>,
    to: Option<i64>,
    group_by: Option<String>,
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidArgument, "invalid_request", message)
}

/// Checks the parameters against the caller: who may see what, and a well-formed window.
pub fn plan_query(caller: &TenantId, p: UsageParams, now_s: i64) -> ApiResult<UsageQuery> {
    let admin = *caller == TenantId::admin();
    let tenant = match p.tenant.as_deref().filter(|t| !t.is_empty()) {
        None if admin => None,
        None => Some(caller.clone()),
        Some(name) => {
            let t = TenantId::new(name).map_err(|_| invalid("tenant: not a valid tenant name"))?;
            if !admin && t != *caller {
                return Err(ApiError::new(
                    ErrorKind::Forbidden,
                    "forbidden",
                    "a tenant sees only its own usage",
                ));
            }
            Some(t)
        }
    };
    let to = p.to.unwrap_or(now_s + 1);
    let from = p.from.unwrap_or(to - DEFAULT_WINDOW_S);
    if from >= to {
        return Err(invalid("from must be before to (Unix seconds)"));
    }
    let group_by =
        GroupBy::parse(p.group_by.as_deref().unwrap_or("")).map_err(|e| invalid(e.to_string()))?;
    Ok(UsageQuery {
        tenant,
        from_s: from,
        to_s: to,
        group_by,
    })
}

pub async fn usage(
    State(state): State<Arc<ApiState>>,
    Extension(caller): Extension<TenantId>,
    params: Result<Query<UsageParams>, QueryRejection>,
) -> ApiResult<Json<UsageReport>> {
    let Query(params) = params.map_err(|_| {
        invalid("query: tenant, from, to (Unix seconds) and group_by (tenant,sandbox,interval)")
    })?;
    let query = plan_query(&caller, params, now_millis() / 1000)?;
    let engine = state.engine.clone();
    let answer = tokio::task::spawn_blocking(move || {
        UsageStore::of(&engine).and_then(|store| store.query(&query))
    })
    .await;
    match answer {
        Ok(Ok(report)) => Ok(Json(report)),
        Ok(Err(UsageError::BadRange { .. } | UsageError::BadGroupBy(_))) => {
            Err(invalid("bad range or group_by"))
        }
        Ok(Err(e)) => {
            state.engine.metrics.store_error("usage");
            tracing::error!(error = %e, "usage query failed");
            Err(ApiError::new(
                ErrorKind::Internal,
                "internal",
                "cannot read the usage records",
            ))
        }
        Err(e) => {
            tracing::error!(error = %e, "usage query task failed");
            Err(ApiError::new(
                ErrorKind::Internal,
                "internal",
                "cannot read the usage records",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(
        tenant: Option<&str>,
        from: Option<i64>,
        to: Option<i64>,
        g: Option<&str>,
    ) -> UsageParams {
        UsageParams {
            tenant: tenant.map(Into::into),
            from,
            to,
            group_by: g.map(Into::into),
        }
    }

    #[test]
    fn a_tenant_sees_its_own_usage_and_no_other() {
        let a = TenantId::new("team-a").unwrap();
        let q = plan_query(&a, params(None, None, None, None), 1_000_000).unwrap();
        assert_eq!(q.tenant, Some(a.clone()));
        let q = plan_query(&a, params(Some("team-a"), None, None, None), 1_000_000).unwrap();
        assert_eq!(q.tenant, Some(a.clone()));
        let e = plan_query(&a, params(Some("team-b"), None, None, None), 1_000_000).unwrap_err();
        assert_eq!((e.status().as_u16(), e.code()), (403, "forbidden"));
    }

    #[test]
    fn the_admin_sees_every_tenant_or_one() {
        let admin = TenantId::admin();
        let q = plan_query(
            &admin,
            params(None, Some(0), Some(10), Some("sandbox,interval")),
            5,
        )
        .unwrap();
        assert_eq!(q.tenant, None);
        assert!(q.group_by.sandbox && q.group_by.interval);
        let q = plan_query(&admin, params(Some("team-b"), None, None, None), 5).unwrap();
        assert_eq!(q.tenant.unwrap().as_str(), "team-b");
    }

    #[test]
    fn bad_windows_and_groupings_are_invalid_requests() {
        let admin = TenantId::admin();
        for p in [
            params(None, Some(10), Some(10), None),
            params(None, None, None, Some("colour")),
            params(Some("../x"), None, None, None),
        ] {
            let e = plan_query(&admin, p, 100).unwrap_err();
            assert_eq!((e.status().as_u16(), e.code()), (400, "invalid_request"));
        }
    }
}
