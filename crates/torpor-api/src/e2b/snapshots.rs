//! E2B's named snapshots on torpor's snapshot store: `sbx.create_snapshot(name)` /
//! `Sandbox.create_snapshot(id, name)` (`POST /sandboxes/{id}/snapshots`),
//! `list_snapshots` (`GET /snapshots?sandboxID=&name=&limit=&nextToken=`),
//! `Sandbox.delete_snapshot(id)` (`DELETE /templates/{id}`) and `Sandbox.create(snapshot_id)`.
//!
//! A snapshot is held by a sandbox of its own, made with torpor's fork: the source is
//! checkpointed once (parked, then woken again with its id and deadline, as E2B pauses it only
//! for the snapshot), and the holder is a Suspended sandbox whose image is a manifest sharing
//! that checkpoint's chunks in the store. It is marked [`META_SNAPSHOT_OF`] (the source's id)
//! and never shown, woken or routed to as a sandbox through E2B; deleting the source leaves it.
//! A sandbox made from a snapshot is a fork of the holder (no copy), given the create call's
//! E2B lifecycle, metadata and egress, then woken. The holder counts against its tenant's
//! `sandboxes` quota, as the space it holds.
//!
//! Ids follow E2B's: a named snapshot is `{tenant}/{name}:default` (a new snapshot under an
//! existing name replaces it), an unnamed one `{holder}:default`. A lookup takes the id, the
//! name, with or without the tenant and the `:default` tag; only the caller's own are found.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_control::SandboxRecord;
use torpor_core::{SandboxId, TenantId};

use super::control::{authenticate, e2b_sandbox, sandbox_json, CreatePlan, SandboxJson};
use super::{e2b_running, is_snapshot, E2b, E2bError, META_SNAPSHOT_NAME, META_SNAPSHOT_OF};

/// The only tag a torpor snapshot has.
pub const TAG: &str = "default";
/// Longest snapshot name.
const MAX_NAME: usize = 128;
/// Snapshots one list page holds at most (and by default).
const MAX_PAGE: usize = 100;

#[derive(Debug, Default, Deserialize)]
pub struct SnapshotBody {
    pub name: Option<String>,
    /// `false` asks for a filesystem-only snapshot; torpor's always hold memory too.
    pub memory: Option<bool>,
}

/// E2B's `SnapshotInfo`.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct SnapshotJson {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// Checks a snapshot name: 1–128 letters, digits, `-`, `_` or `.`, not starting with `.`.
pub fn check_name(name: &str) -> Result<(), E2bError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(E2bError::bad_request(format!(
            "snapshot name {name:?}: 1-{MAX_NAME} letters, digits, '-', '_' or '.'"
        )))
    }
}

/// A holder's E2B form.
pub fn snapshot_json(rec: &SandboxRecord) -> SnapshotJson {
    match rec.metadata.get(META_SNAPSHOT_NAME) {
        Some(name) => {
            let full = format!("{}/{name}:{TAG}", rec.tenant);
            SnapshotJson {
                snapshot_id: full.clone(),
                names: vec![full],
            }
        }
        None => SnapshotJson {
            snapshot_id: format!("{}:{TAG}", rec.id),
            names: Vec::new(),
        },
    }
}

/// What a lookup string names, once its tenant and tag are taken off: `None` when they name
/// another tenant or another tag (nothing of the caller's).
pub fn bare<'a>(tenant: &TenantId, s: &'a str) -> Option<&'a str> {
    let s = match s.rsplit_once(':') {
        Some((rest, tag)) if tag == TAG => rest,
        Some(_) => return None,
        None => s,
    };
    match s.split_once('/') {
        Some((ns, rest)) if ns == tenant.as_str() => Some(rest),
        Some(_) => None,
        None => Some(s),
    }
}

/// Whether `rec` (a holder) is what `s` names: its holder id or its name.
fn names(tenant: &TenantId, rec: &SandboxRecord, s: &str) -> bool {
    let Some(b) = bare(tenant, s) else {
        return false;
    };
    b == rec.id.as_str() || rec.metadata.get(META_SNAPSHOT_NAME).map(String::as_str) == Some(b)
}

/// The caller's snapshot holders, newest first.
fn holders(st: &E2b, tenant: &TenantId) -> Result<Vec<SandboxRecord>, E2bError> {
    let mut all: Vec<SandboxRecord> = st
        .api
        .engine
        .sandboxes(tenant)?
        .into_iter()
        .filter(|r| is_snapshot(r) && &r.tenant == tenant)
        .collect();
    all.sort_by(|a, b| (b.created_at, b.id.as_str()).cmp(&(a.created_at, a.id.as_str())));
    Ok(all)
}

/// The caller's snapshot that `s` names (its newest, for a name), if any.
pub fn find(st: &E2b, tenant: &TenantId, s: &str) -> Result<Option<SandboxRecord>, E2bError> {
    Ok(holders(st, tenant)?
        .into_iter()
        .find(|r| names(tenant, r, s)))
}

/// POST /sandboxes/{id}/snapshots → 201 `{snapshotID, names}`.
pub async fn create(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Result<(StatusCode, Json<SnapshotJson>), E2bError> {
    let tenant = authenticate(&st, &headers)?;
    let sid =
        SandboxId::new(&id).map_err(|_| E2bError::not_found(format_args!("sandbox {id:?}")))?;
    let raw = super::read_body(&headers, body, crate::body::MAX_JSON_BODY).await?;
    let body: SnapshotBody = if raw.is_empty() {
        SnapshotBody::default()
    } else {
        serde_json::from_slice(&raw)
            .map_err(|e| E2bError::bad_request(format!("request body: {e}")))?
    };
    if let Some(n) = &body.name {
        check_name(n)?;
    }
    let source = e2b_sandbox(&st, &tenant, &sid)?;
    let was_running = e2b_running(&source);
    let forks = st.api.engine.fork(&source.tenant, &sid, 1).await?;
    if was_running {
        // As on E2B, the source goes on running.
        if let Err(e) = st.api.engine.resume(&source.tenant, &sid).await {
            tracing::warn!(sandbox = %sid, error = %e, "the snapshot's source did not wake");
        }
    }
    let holder = forks.into_iter().next().ok_or_else(|| {
        E2bError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "snapshot limit reached (quota)",
        )
    })?;
    // The holder keeps nothing of the source's E2B life (deadline, traffic token, metadata):
    // only what makes it a snapshot.
    let mut patch: BTreeMap<String, Option<String>> =
        holder.metadata.keys().map(|k| (k.clone(), None)).collect();
    patch.insert(META_SNAPSHOT_OF.into(), Some(sid.to_string()));
    if let Some(n) = &body.name {
        patch.insert(META_SNAPSHOT_NAME.into(), Some(n.clone()));
    }
    let holder = st
        .api
        .engine
        .patch_sandbox_metadata(&source.tenant, &holder.id, &patch)?;
    // A new snapshot under a name takes the name from the one before it.
    if let Some(n) = &body.name {
        for old in holders(&st, &source.tenant)? {
            if old.id != holder.id && old.metadata.get(META_SNAPSHOT_NAME) == Some(n) {
                if let Err(e) = st.api.engine.delete_sandbox(&source.tenant, &old.id).await {
                    tracing::warn!(snapshot = %old.id, error = %e, "a replaced snapshot stays");
                }
            }
        }
    }
    tracing::info!(sandbox = %sid, snapshot = %holder.id, name = ?body.name, memory = ?body.memory, "e2b snapshot");
    Ok((StatusCode::CREATED, Json(snapshot_json(&holder))))
}

/// GET /snapshots → 200 `[{snapshotID, names}]`, newest first, `x-next-token` when more.
pub async fn list(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, E2bError> {
    let tenant = authenticate(&st, &headers)?;
    let limit = match q.get("limit") {
        None => MAX_PAGE,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(E2bError::bad_request(format!(
                    "limit must be between 1 and {MAX_PAGE}"
                )))
            }
        },
    };
    let all = holders(&st, &tenant)?;
    let mut selected: Vec<&SandboxRecord> = all
        .iter()
        .filter(|r| {
            q.get("sandboxID")
                .is_none_or(|s| r.metadata.get(META_SNAPSHOT_OF) == Some(s))
        })
        .filter(|r| q.get("name").is_none_or(|n| names(&tenant, r, n)))
        .collect();
    if let Some(token) = q.get("nextToken") {
        // The holder id the previous page ended with: the page goes on after it.
        match selected.iter().position(|r| r.id.as_str() == token) {
            Some(i) => selected.drain(..=i),
            None => return Err(E2bError::bad_request("nextToken is not valid")),
        };
    }
    let next = (selected.len() > limit).then(|| selected[limit - 1].id.to_string());
    selected.truncate(limit);
    let body: Vec<SnapshotJson> = selected.into_iter().map(snapshot_json).collect();
    let mut resp = Json(body).into_response();
    if let Some(v) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// DELETE /templates/{id} → 204 for a snapshot of the caller's; 404 for nothing. (Deleting a
/// template through E2B is not served: 501.)
pub async fn delete(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let tenant = authenticate(&st, &headers)?;
    if let Some(holder) = find(&st, &tenant, &id)? {
        st.api.engine.delete_sandbox(&tenant, &holder.id).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    let is_template = torpor_core::TemplateName::new(&id)
        .ok()
        .is_some_and(|n| st.api.engine.template(&tenant, &n).is_ok());
    if is_template {
        return Err(E2bError::new(
            StatusCode::NOT_IMPLEMENTED,
            "deleting a template through E2B's API is not supported by torpor (use torpor template rm)",
        ));
    }
    Err(E2bError::not_found(format_args!("snapshot {id:?}")))
}

/// `Sandbox.create(snapshot_id)`: a fork of the snapshot's holder with the create call's
/// E2B lifecycle, metadata and egress (`plan`), woken.
pub(crate) async fn create_from(
    st: &E2b,
    tenant: &TenantId,
    holder: &SandboxRecord,
    plan: CreatePlan,
) -> Result<(StatusCode, Json<SandboxJson>), E2bError> {
    if !plan.env.is_empty() {
        return Err(E2bError::bad_request(
            "envVars cannot be set on a sandbox created from a snapshot: it keeps the \
             environment of the sandbox the snapshot was taken from",
        ));
    }
    let fork = st
        .api
        .engine
        .fork(tenant, &holder.id, 1)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "sandbox limit reached (quota)",
            )
        })?;
    let made = async {
        let mut patch: BTreeMap<String, Option<String>> =
            fork.metadata.keys().map(|k| (k.clone(), None)).collect();
        for (k, v) in &plan.metadata {
            patch.insert(k.clone(), Some(v.clone()));
        }
        st.api
            .engine
            .patch_sandbox_metadata(tenant, &fork.id, &patch)?;
        st.api
            .engine
            .set_network(tenant, &fork.id, plan.network)
            .await?;
        let rec = st.api.engine.resume(tenant, &fork.id).await?;
        Ok::<_, E2bError>(rec)
    }
    .await;
    match made {
        Ok(rec) => Ok((StatusCode::CREATED, Json(sandbox_json(st, &rec)))),
        Err(e) => {
            let _ = st.api.engine.delete_sandbox(tenant, &fork.id).await;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::META_PREFIX;
    use super::*;

    #[test]
    fn lookups_take_ids_names_tenants_and_tags() {
        let t = TenantId::new("team-a").unwrap();
        assert_eq!(bare(&t, "snap"), Some("snap"));
        assert_eq!(bare(&t, "snap:default"), Some("snap"));
        assert_eq!(bare(&t, "team-a/snap:default"), Some("snap"));
        assert_eq!(
            bare(&t, "team-b/snap"),
            None,
            "another tenant's is never named"
        );
        assert_eq!(bare(&t, "snap:v2"), None, "no other tag exists");
        assert!(check_name("my-snap_1.0").is_ok());
        for bad in ["", ".x", "a/b", "a:b", &"x".repeat(129)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(META_SNAPSHOT_OF.starts_with(META_PREFIX));
    }
}
