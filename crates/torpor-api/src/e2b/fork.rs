//! `POST /sandboxes/{id}/fork` (E2B's `sbx.fork(timeout, count)`), on torpor's fork: the
//! source is checkpointed once (torpor parks it), `count` sandboxes share that snapshot, and
//! each is woken. A source that was running is woken again with its id and deadline kept.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use torpor_core::{SandboxId, TenantId};

use super::control::{authenticate, sandbox_json};
use super::{
    e2b_running, E2b, E2bError, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, META_END_AT, META_PAUSED,
    META_TIMEOUT,
};

/// E2B's limit on forks per call.
pub const MAX_FORK_COUNT: usize = 20;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForkBody {
    pub timeout: Option<i64>,
    pub count: Option<i64>,
}

/// Checks a fork body: (timeout s, count).
pub fn check_fork(body: &ForkBody) -> Result<(u64, usize), E2bError> {
    let timeout = match body.timeout {
        None => DEFAULT_TIMEOUT_S,
        Some(t) if t < 0 => return Err(E2bError::bad_request("timeout must not be negative")),
        Some(t) => (t as u64).min(MAX_TIMEOUT_S),
    };
    let count = match body.count {
        None => 1,
        Some(c) if (1..=MAX_FORK_COUNT as i64).contains(&c) => c as usize,
        Some(_) => {
            return Err(E2bError::bad_request(format!(
                "count must be between 1 and {MAX_FORK_COUNT}"
            )))
        }
    };
    Ok((timeout, count))
}

/// POST /sandboxes/{id}/fork → 201 `[{"sandbox": …} | {"error": {code, message}}]`.
pub async fn fork(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Result<(StatusCode, Json<Vec<Value>>), E2bError> {
    let tenant = authenticate(&st, &headers)?;
    let sid =
        SandboxId::new(&id).map_err(|_| E2bError::not_found(format_args!("sandbox {id:?}")))?;
    let body = super::read_body(&headers, body, crate::body::MAX_JSON_BODY).await?;
    let body: ForkBody = if body.is_empty() {
        ForkBody::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| E2bError::bad_request(format!("request body: {e}")))?
    };
    let (timeout, count) = check_fork(&body)?;
    let source = super::control::e2b_sandbox(&st, &tenant, &sid)?;
    if !e2b_running(&source) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is paused; connect to it before forking it"),
        ));
    }
    let forks = st.api.engine.fork(&tenant, &sid, count).await?;
    // The source goes on running (E2B pauses it only for the snapshot).
    if let Err(e) = st.api.engine.resume(&tenant, &sid).await {
        tracing::warn!(sandbox = %sid, error = %e, "the fork's source did not wake");
    }
    let mut out = Vec::with_capacity(count);
    for rec in forks {
        out.push(
            match start_fork(&st, &tenant, &source, &rec.id, timeout).await {
                Ok(v) => json!({ "sandbox": v }),
                Err(e) => json!({"error": {"code": e.status.as_u16(), "message": e.message}}),
            },
        );
    }
    // Forks the engine could not make (a quota reached part way) are reported one by one.
    while out.len() < count {
        out.push(json!({"error": {"code": 429, "message": "fork limit reached (quota)"}}));
    }
    Ok((StatusCode::CREATED, Json(out)))
}

/// Gives a fork its own E2B lifecycle (deadline, not paused, its own traffic token when
/// private, no `forked_from` the source did not have) and wakes it.
async fn start_fork(
    st: &E2b,
    tenant: &TenantId,
    source: &torpor_control::SandboxRecord,
    id: &SandboxId,
    timeout: u64,
) -> Result<Value, E2bError> {
    let end = torpor_core::now_millis() + timeout as i64 * 1000;
    let mut patch: std::collections::BTreeMap<String, Option<String>> = [
        (META_END_AT.to_string(), Some(end.to_string())),
        (META_TIMEOUT.to_string(), Some(timeout.to_string())),
        (META_PAUSED.to_string(), None),
    ]
    .into();
    if !source.metadata.contains_key("forked_from") {
        patch.insert("forked_from".into(), None);
    }
    if source
        .metadata
        .get(super::ports::META_TRAFFIC)
        .is_some_and(|t| t != "public")
    {
        patch.insert(
            super::ports::META_TRAFFIC.into(),
            Some(super::ports::new_traffic_token(st)),
        );
    }
    st.api.engine.patch_sandbox_metadata(tenant, id, &patch)?;
    let rec = st.api.engine.resume(tenant, id).await?;
    Ok(serde_json::to_value(sandbox_json(st, &rec)).expect("json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_bodies_are_checked_as_e2b_does() {
        assert_eq!(
            check_fork(&ForkBody::default()).unwrap(),
            (DEFAULT_TIMEOUT_S, 1)
        );
        let b = ForkBody {
            timeout: Some(60),
            count: Some(20),
        };
        assert_eq!(check_fork(&b).unwrap(), (60, 20));
        for bad in [0, 21, -1] {
            let b = ForkBody {
                timeout: None,
                count: Some(bad),
            };
            assert_eq!(check_fork(&b).unwrap_err().status, StatusCode::BAD_REQUEST);
        }
        let b = ForkBody {
            timeout: Some(-5),
            count: None,
        };
        assert!(check_fork(&b).is_err());
    }
}
