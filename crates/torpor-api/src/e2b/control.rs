//! E2B's control plane: create, connect, pause, kill, get, timeout, list.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_control::{CreateSandbox, SandboxRecord};
use torpor_core::{SandboxId, TemplateName, TenantId, Tier};

use super::egress::{Egress, META_EGRESS};
use super::{
    e2b_running, is_running, E2b, E2bError, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, META_AUTO_RESUME,
    META_END_AT, META_ON_TIMEOUT, META_PAUSED, META_PAUSE_MEMORY, META_PREFIX, META_TIMEOUT,
};
use crate::auth::constant_time_eq;
use crate::types::rfc3339;

type E2bResult<T> = Result<T, E2bError>;

/// `X-API-KEY` → tenant (admin token or a tenant token, the same check as bearer auth).
pub fn authenticate(st: &E2b, headers: &HeaderMap) -> E2bResult<TenantId> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "missing X-API-KEY header"))?;
    let tenant = if constant_time_eq(key.as_bytes(), st.api.admin_token.as_bytes()) {
        TenantId::admin()
    } else {
        st.api
            .engine
            .tenant_for_token(key)?
            .ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "invalid API key"))?
    };
    crate::request_id::set_caller(&tenant);
    crate::ratelimit::check(&st.api, &tenant, crate::ratelimit::RouteClass::Lifecycle)?;
    Ok(tenant)
}

/// A sandbox of the caller's, as E2B sees sandboxes: the holder of a named snapshot is not
/// one (404, as for nothing).
pub fn e2b_sandbox(st: &E2b, tenant: &TenantId, id: &SandboxId) -> E2bResult<SandboxRecord> {
    let rec = st.api.engine.sandbox(tenant, id)?;
    if super::is_snapshot(&rec) {
        return Err(E2bError::not_found(format_args!(
            "sandbox {:?}",
            id.as_str()
        )));
    }
    Ok(rec)
}

fn sandbox_id(raw: &str) -> E2bResult<SandboxId> {
    SandboxId::new(raw).map_err(|_| E2bError::not_found(format_args!("sandbox {raw:?}")))
}

/// Reads a JSON body (after the caller was authenticated: nothing is read before) and parses
/// it leniently (unknown fields are ignored: SDKs send many we do not use); an empty body is
/// the default.
async fn parse_body<T: for<'de> Deserialize<'de> + Default>(
    headers: &HeaderMap,
    body: Body,
) -> E2bResult<T> {
    let body = super::read_body(headers, body, crate::body::MAX_JSON_BODY).await?;
    if body.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(&body).map_err(|e| E2bError::bad_request(format!("request body: {e}")))
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    /// `false`: the timeout's pause keeps no memory (a filesystem-only pause).
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<serde_json::Value>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub lifecycle: Option<serde_json::Value>,
    pub network: Option<NetworkBody>,
    /// Snake case on the wire, unlike the other fields.
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    pub allow_internet_access: Option<bool>,
}

/// E2B's `network` at create: egress options (mapped onto a torpor policy by
/// [`super::egress`]), whether ports are public, and the Host the sandbox's servers see.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkBody {
    pub allow_public_traffic: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub mask_request_host: Option<String>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    pub https_ports: Option<serde_json::Value>,
}

/// `PUT /sandboxes/{id}/network`: replaces the egress options as a whole.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    pub allow_internet_access: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    pub timeout: Option<i64>,
    /// Connect's `memory: false` (`on_resume="reboot"`): a paused sandbox wakes rebooted.
    pub memory: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`'s body: `memory: false` is a filesystem-only pause.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseBody {
    pub memory: Option<bool>,
    /// Refuse the pause while the agent does not answer: torpor's pause always needs it.
    pub require_healthy_guest: Option<bool>,
}

/// The create/connect answer (E2B's `Sandbox`).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct SandboxJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(rename = "envdAccessToken")]
    pub envd_access_token: String,
    pub domain: String,
    pub alias: String,
    /// Present when the sandbox's ports are private (`allowPublicTraffic: false`).
    #[serde(rename = "trafficAccessToken", skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
}

/// The detail and list entry (E2B's `SandboxDetail` / `ListedSandbox`).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct SandboxDetailJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: String,
    pub metadata: BTreeMap<String, String>,
    /// What a paused sandbox's pause kept: `full` (memory and files) or `filesystem`.
    #[serde(rename = "pauseMode", skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<String>,
    #[serde(
        rename = "allowInternetAccess",
        skip_serializing_if = "Option::is_none"
    )]
    pub allow_internet_access: Option<bool>,
    pub network: NetworkInfoJson,
}

/// The `network` of a detail answer (E2B's `SandboxNetworkConfig`).
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInfoJson {
    pub allow_public_traffic: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
}

fn client_id() -> String {
    "torpor".into()
}

fn user_metadata(rec: &SandboxRecord) -> BTreeMap<String, String> {
    rec.metadata
        .iter()
        .filter(|(k, _)| !super::is_reserved_key(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

pub fn sandbox_json(st: &E2b, rec: &SandboxRecord) -> SandboxJson {
    let tpl = rec.template.to_string();
    SandboxJson {
        template_id: tpl.clone(),
        sandbox_id: rec.id.to_string(),
        client_id: client_id(),
        envd_version: super::ENVD_VERSION.into(),
        envd_access_token: st.access_token(&rec.id),
        domain: st.domain.clone(),
        alias: tpl,
        traffic_access_token: rec
            .metadata
            .get(super::ports::META_TRAFFIC)
            .filter(|t| *t != "public")
            .cloned(),
    }
}

pub fn detail_json(st: &E2b, rec: &SandboxRecord, with_token: bool) -> SandboxDetailJson {
    let tpl = rec.template.to_string();
    let egress = egress_of(rec);
    let end_at = rec
        .metadata
        .get(META_END_AT)
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(rec.last_active_at.max(rec.created_at));
    SandboxDetailJson {
        template_id: tpl.clone(),
        sandbox_id: rec.id.to_string(),
        client_id: client_id(),
        alias: tpl,
        started_at: rfc3339(rec.created_at),
        end_at: rfc3339(end_at),
        envd_version: super::ENVD_VERSION.into(),
        envd_access_token: with_token.then(|| st.access_token(&rec.id)),
        domain: st.domain.clone(),
        cpu_count: (rec.limits.cpus.ceil() as u32).max(1),
        memory_mb: rec.limits.memory_mib,
        disk_size_mb: 0,
        state: if e2b_running(rec) {
            "running"
        } else {
            "paused"
        }
        .into(),
        metadata: user_metadata(rec),
        pause_mode: (!e2b_running(rec)).then(|| {
            let fs_only = st.api.engine.reboots_on_next_wake(rec);
            if fs_only { "filesystem" } else { "full" }.to_string()
        }),
        allow_internet_access: egress.allow_internet_access,
        network: NetworkInfoJson {
            allow_public_traffic: rec
                .metadata
                .get(super::ports::META_TRAFFIC)
                .is_none_or(|t| t == "public"),
            allow_out: egress.allow_out,
            deny_out: egress.deny_out,
            dns_servers: egress.dns_servers,
            mask_request_host: rec.metadata.get(super::ports::META_MASK_HOST).cloned(),
        },
    }
}

/// The E2B egress options a sandbox was given (kept in its metadata).
fn egress_of(rec: &SandboxRecord) -> Egress {
    rec.metadata
        .get(META_EGRESS)
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default()
}

/// The network policy of a template (`None`: it has none); 404 if it does not exist.
fn template_network(
    st: &E2b,
    tenant: &TenantId,
    template: &TemplateName,
) -> E2bResult<Option<torpor_core::NetworkPolicy>> {
    match st.api.engine.template(tenant, template) {
        Ok(t) => Ok(t.spec.network),
        Err(torpor_control::ControlError::NotFound { .. }) => Err(E2bError::not_found(
            format_args!("template {:?}", template.as_str()),
        )),
        Err(e) => Err(e.into()),
    }
}

fn timeout_seconds(raw: Option<i64>) -> E2bResult<u64> {
    match raw {
        None => Ok(DEFAULT_TIMEOUT_S),
        Some(t) if t < 0 => Err(E2bError::bad_request("timeout must not be negative")),
        Some(t) => Ok((t as u64).min(MAX_TIMEOUT_S)),
    }
}

fn deadline(timeout_s: u64) -> String {
    (torpor_core::now_millis() + (timeout_s as i64) * 1000).to_string()
}

/// Whether a paused sandbox wakes on a call to it: `autoResume: {"enabled": true}` (what the
/// SDKs send for `lifecycle={"auto_resume": True}`), `autoResume: true`, or the lifecycle's
/// own `auto_resume` / `autoResume`.
fn auto_resume(body: &NewSandbox) -> E2bResult<bool> {
    let flag = |v: &serde_json::Value, what: &str| match v {
        serde_json::Value::Bool(b) => Ok(*b),
        serde_json::Value::Null => Ok(false),
        serde_json::Value::Object(o) => match o.get("enabled") {
            Some(serde_json::Value::Bool(b)) => Ok(*b),
            None | Some(serde_json::Value::Null) => Ok(false),
            Some(_) => Err(E2bError::bad_request(format!(
                "{what}.enabled must be a boolean"
            ))),
        },
        _ => Err(E2bError::bad_request(format!(
            "{what} must be a boolean or {{\"enabled\": boolean}}"
        ))),
    };
    if let Some(v) = &body.auto_resume {
        return flag(v, "autoResume");
    }
    match body
        .lifecycle
        .as_ref()
        .and_then(|l| l.get("autoResume").or_else(|| l.get("auto_resume")))
    {
        Some(v) => flag(v, "lifecycle.autoResume"),
        None => Ok(false),
    }
}

/// What a timed-out sandbox does: `kill` only when asked for explicitly (`autoPause: false`
/// or `lifecycle.onTimeout: "kill"`); otherwise it is put to sleep.
fn on_timeout(body: &NewSandbox) -> E2bResult<&'static str> {
    if let Some(l) = &body.lifecycle {
        let action = l
            .get("onTimeout")
            .or_else(|| l.get("on_timeout"))
            .map(|a| a.get("action").unwrap_or(a));
        match action.and_then(|a| a.as_str()) {
            Some("kill") => return Ok("kill"),
            Some("pause") | None => {}
            Some(other) => {
                return Err(E2bError::bad_request(format!(
                    "lifecycle on_timeout must be pause or kill, got {other:?}"
                )))
            }
        }
    }
    Ok(match body.auto_pause {
        Some(false) => "kill",
        _ => "pause",
    })
}

/// Whether the timeout's pause keeps memory: not for `autoPauseMemory: false`, nor for a
/// lifecycle `onTimeout` object with `keepMemory` / `keep_memory: false` or
/// `mode: "filesystem"` (those are filesystem-only pauses: the sandbox wakes rebooted).
fn pause_keeps_memory(body: &NewSandbox) -> E2bResult<bool> {
    if let Some(o) = body
        .lifecycle
        .as_ref()
        .and_then(|l| l.get("onTimeout").or_else(|| l.get("on_timeout")))
        .filter(|o| o.is_object())
    {
        if let Some(mode) = o.get("mode").filter(|m| !m.is_null()) {
            return match mode.as_str() {
                Some("full") => Ok(true),
                Some("filesystem") => Ok(false),
                _ => Err(E2bError::bad_request(format!(
                    "lifecycle on_timeout mode must be full or filesystem, got {mode}"
                ))),
            };
        }
        if let Some(keep) = o.get("keepMemory").or_else(|| o.get("keep_memory")) {
            return match keep {
                serde_json::Value::Bool(b) => Ok(*b),
                serde_json::Value::Null => Ok(true),
                _ => Err(E2bError::bad_request(
                    "lifecycle on_timeout keep_memory must be a boolean",
                )),
            };
        }
    }
    Ok(body.auto_pause_memory != Some(false))
}

/// What `POST /sandboxes` asks of the engine, decided from its body alone: the template, the
/// metadata that keeps E2B's lifecycle and egress, the env and the network policy. The fuzz
/// entry point drives this same function.
pub(crate) struct CreatePlan {
    pub template: TemplateName,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub network: torpor_core::NetworkPolicy,
}

/// Checks a create body and plans the sandbox. `template_network` gives the named template's
/// network policy (its ceiling); `traffic_token` makes the token of a private sandbox.
pub(crate) fn plan_create(
    body: NewSandbox,
    template_network: impl FnOnce(&TemplateName) -> E2bResult<Option<torpor_core::NetworkPolicy>>,
    traffic_token: impl FnOnce() -> String,
) -> E2bResult<CreatePlan> {
    let tpl = body.template_id.as_deref().unwrap_or(super::base::BASE);
    let template = TemplateName::new(tpl)
        .map_err(|_| E2bError::not_found(format_args!("template {tpl:?}")))?;
    let timeout = timeout_seconds(body.timeout)?;
    let mut metadata = body.metadata.clone().unwrap_or_default();
    if metadata.keys().any(|k| super::is_reserved_key(k)) {
        return Err(E2bError::bad_request(format!(
            "metadata keys starting with {META_PREFIX:?} or {:?} are reserved",
            torpor_control::Engine::WAKE_PREFIX
        )));
    }
    metadata.insert(META_END_AT.into(), deadline(timeout));
    metadata.insert(META_TIMEOUT.into(), timeout.to_string());
    metadata.insert(META_ON_TIMEOUT.into(), on_timeout(&body)?.into());
    if !pause_keeps_memory(&body)? {
        metadata.insert(META_PAUSE_MEMORY.into(), "0".into());
    }
    if auto_resume(&body)? {
        metadata.insert(META_AUTO_RESUME.into(), "1".into());
    }
    // Reachable on its ports (get_host): always an interface. Egress: the template's policy,
    // narrowed (or, under a `full` template, set) by E2B's egress options.
    let tpl_network = template_network(&template)?;
    let net = body.network.unwrap_or_default();
    super::egress::refuse_unsupported(
        net.egress_proxy.as_ref(),
        net.rules.as_ref(),
        net.https_ports.as_ref(),
    )?;
    let egress = Egress {
        allow_out: net.allow_out,
        deny_out: net.deny_out,
        dns_servers: net.dns_servers,
        allow_internet_access: body.allow_internet_access,
    };
    let network = super::egress::policy(tpl, tpl_network.as_ref(), &egress)?;
    if egress != Egress::default() {
        metadata.insert(
            META_EGRESS.into(),
            serde_json::to_string(&egress).expect("json"),
        );
    }
    if let Some(mask) = net.mask_request_host {
        super::ports::check_mask_host(&mask).map_err(E2bError::bad_request)?;
        metadata.insert(super::ports::META_MASK_HOST.into(), mask);
    }
    let public = net.allow_public_traffic.unwrap_or(true);
    metadata.insert(
        super::ports::META_TRAFFIC.into(),
        if public {
            "public".into()
        } else {
            traffic_token()
        },
    );
    Ok(CreatePlan {
        template,
        metadata,
        env: body.env_vars.unwrap_or_default(),
        network,
    })
}

/// POST /sandboxes and /v2/sandboxes → 201.
pub async fn create(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    body: Body,
) -> E2bResult<(StatusCode, Json<SandboxJson>)> {
    let tenant = authenticate(&st, &headers)?;
    let mut body: NewSandbox = parse_body(&headers, body).await?;
    let requested = body
        .template_id
        .clone()
        .unwrap_or_else(|| super::base::BASE.to_string());
    // A named snapshot (`Sandbox.create(snapshot_id)`): by its id or name, unless a template
    // of that name is there.
    let is_template =
        || TemplateName::new(&requested).is_ok_and(|n| st.api.engine.template(&tenant, &n).is_ok());
    let holder =
        if requested != super::base::BASE && (requested.contains([':', '/']) || !is_template()) {
            super::snapshots::find(&st, &tenant, &requested)?
        } else {
            None
        };
    match &holder {
        Some(h) => body.template_id = Some(h.template.to_string()),
        None if requested == super::base::BASE => super::base::ensure(&st).await?,
        None => {}
    }
    let plan = plan_create(
        body,
        |template| template_network(&st, &tenant, template),
        || super::ports::new_traffic_token(&st),
    )?;
    if let Some(h) = holder {
        return super::snapshots::create_from(&st, &tenant, &h, plan).await;
    }
    // E2B's lifecycle keys are reserved (no tenant sets them through torpor's API): they go
    // to the engine as this layer's metadata, written in the same insert as the sandbox.
    let (layer_metadata, metadata): (BTreeMap<_, _>, BTreeMap<_, _>) = plan
        .metadata
        .into_iter()
        .partition(|(k, _)| k.starts_with(META_PREFIX));
    let rec = st
        .api
        .engine
        .create_sandbox(
            &tenant,
            CreateSandbox {
                template: plan.template,
                env: plan.env,
                metadata,
                limits: Default::default(),
                gpu: None,
                network: Some(plan.network),
                layer_metadata,
            },
        )
        .await
        .map_err(|e| match e {
            torpor_control::ControlError::NotFound {
                kind: "template",
                id,
            } => E2bError::not_found(format_args!("template {id:?}")),
            e => e.into(),
        })?;
    // E2B's commands start in the user's home.
    super::envd::ensure_home(&st, &tenant, &rec.id).await;
    Ok((StatusCode::CREATED, Json(sandbox_json(&st, &rec))))
}

/// POST /sandboxes/{id}/connect and /v2/sandboxes/{id}/connect: 200 if it was running, 201 if
/// it was woken.
pub async fn connect(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> E2bResult<(StatusCode, Json<SandboxJson>)> {
    let tenant = authenticate(&st, &headers)?;
    let id = sandbox_id(&id)?;
    let body: TimeoutBody = parse_body(&headers, body).await?;
    let timeout = timeout_seconds(body.timeout)?;
    let before = e2b_sandbox(&st, &tenant, &id)?;
    let was_running = is_running(before.tier) && !before.metadata.contains_key(META_PAUSED);
    // `on_resume="reboot"`: a paused sandbox wakes without its memory, whatever its pause kept
    // (a running one is left as it is).
    if body.memory == Some(false) && !was_running {
        st.api.engine.reboot_on_next_wake(&tenant, &id, true)?;
    }
    // A running sandbox's deadline only moves later; a woken one gets a fresh one.
    let new_end = torpor_core::now_millis() + timeout as i64 * 1000;
    let old_end = before
        .metadata
        .get(META_END_AT)
        .and_then(|v| v.parse::<i64>().ok());
    if !was_running || old_end.is_none_or(|old| old < new_end) {
        st.api
            .engine
            .patch_sandbox_metadata(&tenant, &id, &super::resumed_patch(new_end))?;
    }
    let rec = st.api.engine.resume(&tenant, &id).await?;
    let status = if was_running {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((status, Json(sandbox_json(&st, &rec))))
}

/// POST /sandboxes/{id}/resume (E2B's older API): 201, or 409 if it is running.
pub async fn resume(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> E2bResult<(StatusCode, Json<SandboxJson>)> {
    let tenant = authenticate(&st, &headers)?;
    let sid = sandbox_id(&id)?;
    if e2b_running(&e2b_sandbox(&st, &tenant, &sid)?) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        ));
    }
    connect(State(st), headers, Path(id), body).await
}

/// POST /sandboxes/{id}/pause: 204; 409 if it is already asleep.
pub async fn pause(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> E2bResult<StatusCode> {
    let tenant = authenticate(&st, &headers)?;
    let sid = sandbox_id(&id)?;
    let body: PauseBody = parse_body(&headers, body).await?;
    let rec = e2b_sandbox(&st, &tenant, &sid)?;
    if !e2b_running(&rec) {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    // `memory: false`: the image is still taken whole, and the next wake reboots it. A memory
    // pause takes back any such mark (there is none unless a pause without memory failed).
    let fs_only = body.memory == Some(false);
    st.api.engine.reboot_on_next_wake(&tenant, &sid, fs_only)?;
    // Paused to E2B from now on (is_running answers false while it checkpoints). A sandbox
    // torpor's idle policy already put to sleep only changes its E2B state.
    st.api
        .engine
        .patch_sandbox_metadata(&tenant, &sid, &super::paused_patch(&rec, "pause"))?;
    if !is_running(rec.tier) {
        return Ok(StatusCode::NO_CONTENT);
    }
    match st.api.engine.suspend(&tenant, &sid, Tier::Parked).await {
        // Lost a race with the idle policy: it is asleep, which is what was asked.
        Ok(_) | Err(torpor_control::ControlError::InvalidTransition { .. }) => {
            Ok(StatusCode::NO_CONTENT)
        }
        Err(e) => {
            // Not paused after all: E2B's view goes back to running, with its deadline, and
            // its next wake (it did not sleep) reboots nothing.
            let _ = super::mark_resumed(&st.api.engine, &rec, None);
            let _ = st.api.engine.reboot_on_next_wake(&tenant, &sid, false);
            Err(e.into())
        }
    }
}

/// DELETE /sandboxes/{id}: 204; 404.
pub async fn kill(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let tenant = authenticate(&st, &headers)?;
    let sid = sandbox_id(&id)?;
    e2b_sandbox(&st, &tenant, &sid)?;
    st.api.engine.delete_sandbox(&tenant, &sid).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// GET /sandboxes/{id}.
pub async fn get_one(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> E2bResult<Json<SandboxDetailJson>> {
    let tenant = authenticate(&st, &headers)?;
    let rec = e2b_sandbox(&st, &tenant, &sandbox_id(&id)?)?;
    Ok(Json(detail_json(&st, &rec, true)))
}

/// PUT /sandboxes/{id}/network: 204. The egress options are replaced as a whole (an omitted
/// field is cleared), and a running sandbox gets the new rules at once.
pub async fn set_network(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> E2bResult<StatusCode> {
    let tenant = authenticate(&st, &headers)?;
    let sid = sandbox_id(&id)?;
    let body: NetworkUpdate = parse_body(&headers, body).await?;
    let rec = e2b_sandbox(&st, &tenant, &sid)?;
    super::egress::refuse_unsupported(body.egress_proxy.as_ref(), body.rules.as_ref(), None)?;
    let egress = Egress {
        allow_out: body.allow_out,
        deny_out: body.deny_out,
        dns_servers: body.dns_servers,
        allow_internet_access: body.allow_internet_access,
    };
    let tpl_network = template_network(&st, &tenant, &rec.template)?;
    let tpl = rec.template.as_str();
    let policy = super::egress::policy(tpl, tpl_network.as_ref(), &egress)?;
    st.api.engine.set_network(&tenant, &sid, policy).await?;
    let kept = (egress != Egress::default()).then(|| serde_json::to_string(&egress).expect("json"));
    st.api.engine.patch_sandbox_metadata(
        &tenant,
        &sid,
        &[(META_EGRESS.to_string(), kept)].into(),
    )?;
    Ok(StatusCode::NO_CONTENT)
}

/// POST /sandboxes/{id}/timeout: 204. The deadline is set to now + timeout.
pub async fn set_timeout(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> E2bResult<StatusCode> {
    let tenant = authenticate(&st, &headers)?;
    let sid = sandbox_id(&id)?;
    let body: TimeoutBody = parse_body(&headers, body).await?;
    let Some(t) = body.timeout else {
        return Err(E2bError::bad_request("timeout is required"));
    };
    let timeout = timeout_seconds(Some(t))?;
    st.api.engine.patch_sandbox_metadata(
        &tenant,
        &sid,
        &[(META_END_AT.to_string(), Some(deadline(timeout)))].into(),
    )?;
    Ok(StatusCode::NO_CONTENT)
}

pub use super::listing::{
    list_v1, list_v2, page, parse_list_query, percent_decode, ListFilter, MAX_PAGE,
};

#[doc(hidden)]
pub mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[test]
    fn errors_have_the_e2b_shape() {
        let resp = E2bError::not_found("sandbox \"x\"").into_response();
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        let body =
            futures::executor::block_on(axum::body::to_bytes(resp.into_body(), 1 << 16)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["code"], 404);
        assert_eq!(v["message"], "sandbox \"x\" not found");
    }

    #[test]
    fn on_timeout_kills_only_when_asked() {
        let mut b = NewSandbox::default();
        assert_eq!(on_timeout(&b).unwrap(), "pause");
        b.auto_pause = Some(false);
        assert_eq!(on_timeout(&b).unwrap(), "kill");
        b.auto_pause = Some(true);
        assert_eq!(on_timeout(&b).unwrap(), "pause");
        b.lifecycle = Some(serde_json::json!({"onTimeout": {"action": "kill"}}));
        assert_eq!(on_timeout(&b).unwrap(), "kill");
        b.lifecycle = Some(serde_json::json!({"onTimeout": "nap"}));
        assert!(on_timeout(&b).is_err());
        // What the timeout's pause keeps: memory, unless told otherwise in any of E2B's forms.
        let mut b = NewSandbox::default();
        assert!(pause_keeps_memory(&b).unwrap());
        b.auto_pause_memory = Some(false);
        assert!(!pause_keeps_memory(&b).unwrap());
        b.auto_pause_memory = None;
        for (lifecycle, keeps) in [
            (serde_json::json!({"onTimeout": "pause"}), true),
            (
                serde_json::json!({"on_timeout": {"action": "pause", "keep_memory": false}}),
                false,
            ),
            (
                serde_json::json!({"onTimeout": {"action": "pause", "keepMemory": true}}),
                true,
            ),
            (
                serde_json::json!({"onTimeout": {"action": "pause", "mode": "filesystem"}}),
                false,
            ),
            (
                serde_json::json!({"onTimeout": {"action": "pause", "mode": "full"}}),
                true,
            ),
        ] {
            b.lifecycle = Some(lifecycle.clone());
            assert_eq!(pause_keeps_memory(&b).unwrap(), keeps, "{lifecycle}");
        }
        b.lifecycle = Some(serde_json::json!({"onTimeout": {"action": "pause", "mode": "disk"}}));
        assert!(pause_keeps_memory(&b).is_err());
        assert!(timeout_seconds(Some(-1)).is_err());
        assert_eq!(
            timeout_seconds(Some(10 * MAX_TIMEOUT_S as i64)).unwrap(),
            MAX_TIMEOUT_S
        );
    }
}
