//! The E2B-compatible API: the wire protocol of E2B's SDKs mapped onto torpor's sandboxes,
//! tenants and sleep ladder, served on torpor's own listener.
//!
//! Two surfaces, told apart by path:
//! - the control plane (`/sandboxes`, `/v2/sandboxes`, authenticated by `X-API-KEY`, a torpor
//!   tenant token or the admin token), in [`control`];
//! - the sandbox agent (envd): Connect-RPC `process.Process/*` and `filesystem.Filesystem/*`
//!   plus HTTP `/files` and `/health`, demultiplexed by the `E2b-Sandbox-Id` header and
//!   authorised by `X-Access-Token`, in [`envd`] and [`fs`], with the Connect framing in
//!   [`connect`].
//!
//! E2B's lifecycle lives in a sandbox's metadata under [`META_PREFIX`]: the deadline
//! (`end_at`, ms) and what happens at it (`on_timeout`). A [`timeout_task`] puts a sandbox past
//! its deadline to sleep (parked), or deletes it when `on_timeout` is `kill`.

pub mod base;
pub mod connect;
pub mod control;
pub mod egress;
pub mod envd;
pub mod files;
pub mod fork;
pub mod fs;
pub mod listing;
pub mod metrics;
pub mod multipart;
pub mod owners;
pub mod paths;
pub mod ports;
pub mod signed;
pub mod snapshots;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::{Json, Router};
use serde::Serialize;
use torpor_core::{SandboxId, TenantId, Tier};

use crate::state::ApiState;

/// The envd version advertised: envd 0.6.4's features are what this adapter implements
/// (octet-stream uploads, CloseStdin, default user, file metadata as `user.e2b.*` xattrs
/// (0.6.2, [`fs::metadata`]), entry info on watch events (0.6.3), and the network-mounts watch
/// option (0.6.4): accepted, and moot, since a sandbox has no network mounts).
pub const ENVD_VERSION: &str = "0.6.4";
/// Metadata keys the adapter keeps for itself; hidden from E2B responses and filters.
/// Reserved by the engine too: no tenant sets them at create (torpor's API or E2B's) or reads
/// them, so only this adapter writes them ([`torpor_control::Engine::patch_sandbox_metadata`]).
pub const META_PREFIX: &str = torpor_control::Engine::E2B_PREFIX;
const META_END_AT: &str = "torpor.e2b.end_at";
const META_ON_TIMEOUT: &str = "torpor.e2b.on_timeout";
/// Set while a sandbox is paused the E2B way (`pause`, or its timeout): it is not running to
/// E2B, and an envd call does not wake it unless [`META_AUTO_RESUME`]; `connect` clears it.
const META_PAUSED: &str = "torpor.e2b.paused";
/// `1` when the sandbox was created with `autoResume.enabled` (lifecycle `auto_resume`): a
/// call to a paused sandbox wakes it, with a new deadline of [`META_TIMEOUT`] seconds.
const META_AUTO_RESUME: &str = "torpor.e2b.auto_resume";
/// The timeout (s) given at create or the last connect: the deadline an auto-resume sets.
pub(crate) const META_TIMEOUT: &str = "torpor.e2b.timeout";
/// `0` when the sandbox's timeout pauses it without memory (`autoPauseMemory: false`,
/// lifecycle `keep_memory: false` / `mode: "filesystem"`): its next wake reboots it.
const META_PAUSE_MEMORY: &str = "torpor.e2b.pause_memory";
/// Set on the sandbox that holds an E2B named snapshot ([`snapshots`]): the id of the sandbox
/// it was taken from. Such a sandbox is never shown or woken as a sandbox through E2B.
pub const META_SNAPSHOT_OF: &str = "torpor.e2b.snapshot_of";
/// The name of an E2B named snapshot (absent: unnamed).
pub const META_SNAPSHOT_NAME: &str = "torpor.e2b.snapshot_name";
/// E2B's default sandbox timeout.
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest timeout accepted (E2B's own ceiling is 24 h).
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// State shared by the adapter's handlers.
pub struct E2b {
    pub api: Arc<ApiState>,
    /// Key of the envd access tokens (derived from the admin token: stable across restarts).
    pub(crate) token_key: [u8; 32],
    /// The domain advertised to SDKs (`{port}-{sandboxID}.{domain}`): the proxy's domain, so
    /// `get_host(port)` names what host-based routing serves.
    pub domain: String,
    /// Filesystem watchers made by CreateWatcher, by id.
    pub watchers: Mutex<HashMap<String, fs::Watcher>>,
    /// Sandboxes whose agent predates `ListChanged` (restored from older snapshots).
    pub legacy_agents: Mutex<std::collections::HashSet<SandboxId>>,
    /// Sandboxes whose agent keeps file metadata ([`fs::metadata`]).
    pub metadata_agents: fs::metadata::MetadataAgents,
    /// Sandboxes whose E2B timeout action is running (see [`enforce_timeouts`]).
    timeouts_in_flight: Mutex<std::collections::HashSet<SandboxId>>,
    /// Where E2B's `base` template stands ([`base::ensure`]); held while it is built.
    base_state: tokio::sync::Mutex<base::BaseState>,
}

impl E2b {
    pub fn new(api: Arc<ApiState>) -> E2b {
        let token_key = blake3::derive_key(
            "torpor e2b envd access token v1",
            api.admin_token.as_bytes(),
        );
        let domain = crate::domain::proxy_domain().to_string();
        E2b {
            api,
            token_key,
            domain,
            watchers: Mutex::new(HashMap::new()),
            legacy_agents: Mutex::new(Default::default()),
            metadata_agents: Default::default(),
            timeouts_in_flight: Mutex::new(Default::default()),
            base_state: Default::default(),
        }
    }

    /// The envd access token of a sandbox: a keyed hash of its id.
    pub fn access_token(&self, id: &SandboxId) -> String {
        blake3::keyed_hash(&self.token_key, id.as_str().as_bytes())
            .to_hex()
            .to_string()
    }
}

/// An E2B control-plane error: `{"code": <status>, "message": "..."}`.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

#[derive(Serialize)]
struct ErrorJson<'a> {
    code: u16,
    message: &'a str,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
        }
    }
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("{what} not found"))
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorJson {
                code: self.status.as_u16(),
                message: &self.message,
            }),
        )
            .into_response()
    }
}

impl From<torpor_control::ControlError> for E2bError {
    fn from(e: torpor_control::ControlError) -> Self {
        crate::errors::ApiError::from(e).into()
    }
}

/// The API's errors (a refused rate, a sanitised domain error) in E2B's shape; the headers of
/// a refused rate are added by crate::request_id.
impl From<crate::errors::ApiError> for E2bError {
    fn from(api: crate::errors::ApiError) -> Self {
        E2bError::new(api.status(), api.message().to_string())
    }
}

/// Reads a request body of at most `limit` bytes: refused (413) from its `Content-Length`
/// before anything is read, or as soon as more arrived. Called once the caller is known.
pub async fn read_body(
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    limit: usize,
) -> Result<axum::body::Bytes, E2bError> {
    let too_large = || {
        E2bError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body too large (at most {limit} bytes)"),
        )
    };
    crate::body::read_body_capped(headers, body, limit)
        .await
        .map_err(|e| match e {
            crate::body::BodyError::TooLarge => too_large(),
            crate::body::BodyError::Read(m) => E2bError::bad_request(m),
        })
}

/// Whether a sandbox is resident rather than asleep.
pub fn is_running(tier: Tier) -> bool {
    matches!(tier, Tier::Running | Tier::Frozen)
}

/// Whether E2B sees a sandbox running: not paused through E2B (pause, timeout), and either
/// resident or put to sleep by torpor's own idle policy before its E2B deadline (any call
/// wakes it, so to E2B it never stopped). A sandbox without E2B lifecycle (made through
/// torpor's own API) is running when resident.
pub fn e2b_running(rec: &torpor_control::SandboxRecord) -> bool {
    if rec.metadata.contains_key(META_PAUSED) {
        return false;
    }
    is_running(rec.tier) || rec.metadata.contains_key(META_END_AT)
}

/// Whether a metadata key is reserved: E2B's own ([`META_PREFIX`]) and the engine's marks for
/// a sandbox's next wake. A tenant neither sets nor sees them.
pub fn is_reserved_key(key: &str) -> bool {
    torpor_control::Engine::is_reserved_metadata(key)
}

/// The metadata patch that pauses a sandbox to E2B (`kind`: `pause` or `timeout`): the mark,
/// no deadline while it sleeps, and what its next wake does, by whatever call it comes (a
/// connect, an auto-resume, traffic to its ports, or torpor's own API): it is no longer
/// paused, and gets a new deadline of its timeout (unless the waking call set one, as
/// `connect` does).
pub fn paused_patch(
    rec: &torpor_control::SandboxRecord,
    kind: &str,
) -> std::collections::BTreeMap<String, Option<String>> {
    let timeout_ms = timeout_of(rec).saturating_mul(1000);
    [
        (META_PAUSED.to_string(), Some(kind.to_string())),
        (META_END_AT.to_string(), None),
        (
            torpor_control::Engine::wake_unset_key(META_PAUSED),
            Some(String::new()),
        ),
        (
            torpor_control::Engine::wake_deadline_key(META_END_AT),
            Some(timeout_ms.to_string()),
        ),
    ]
    .into()
}

/// The patch entries that take back what [`paused_patch`] told the next wake.
fn resumed_entries() -> [(String, Option<String>); 2] {
    [
        (torpor_control::Engine::wake_unset_key(META_PAUSED), None),
        (torpor_control::Engine::wake_deadline_key(META_END_AT), None),
    ]
}

/// The patch that makes a sandbox running to E2B with the deadline `end` (Unix ms).
pub fn resumed_patch(end: i64) -> std::collections::BTreeMap<String, Option<String>> {
    let mut patch: std::collections::BTreeMap<_, _> = resumed_entries().into();
    patch.insert(META_PAUSED.to_string(), None);
    patch.insert(META_END_AT.to_string(), Some(end.to_string()));
    patch
}

/// The timeout (s) a sandbox was given at create or its last connect.
fn timeout_of(rec: &torpor_control::SandboxRecord) -> u64 {
    rec.metadata
        .get(META_TIMEOUT)
        .and_then(|t| t.parse().ok())
        .unwrap_or(DEFAULT_TIMEOUT_S)
}

/// Whether a sandbox is the holder of an E2B named snapshot rather than a sandbox.
pub fn is_snapshot(rec: &torpor_control::SandboxRecord) -> bool {
    rec.metadata.contains_key(META_SNAPSHOT_OF)
}

/// Whether a sandbox paused through E2B wakes on a call to it (`autoResume`).
pub fn auto_resumes(rec: &torpor_control::SandboxRecord) -> bool {
    rec.metadata.get(META_AUTO_RESUME).map(String::as_str) == Some("1")
}

/// Records that a sandbox paused through E2B is being woken (by `connect`, an auto-resume or
/// traffic to its ports): no longer paused, with a new deadline of `timeout_s` (default: the
/// timeout it was given).
pub fn mark_resumed(
    engine: &torpor_control::Engine,
    rec: &torpor_control::SandboxRecord,
    timeout_s: Option<u64>,
) -> Result<(), torpor_control::ControlError> {
    let timeout = timeout_s.unwrap_or_else(|| timeout_of(rec));
    let end = torpor_core::now_millis() + timeout as i64 * 1000;
    engine.patch_sandbox_metadata(&TenantId::admin(), &rec.id, &resumed_patch(end))?;
    Ok(())
}

/// The E2B routes, to be merged into torpor's router.
pub fn router(api: Arc<ApiState>) -> Router<Arc<ApiState>> {
    let st = Arc::new(E2b::new(api));
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(timeout_task(Arc::downgrade(&st)));
        rt.spawn(metrics::sampler_task(Arc::downgrade(&st)));
    }
    Router::new()
        .route("/sandboxes", post(control::create).get(listing::list_v1))
        .route("/v2/sandboxes", post(control::create).get(listing::list_v2))
        .route(
            "/sandboxes/{id}",
            get(control::get_one).delete(control::kill),
        )
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/resume", post(control::resume))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/network", put(control::set_network))
        .route("/sandboxes/{id}/fork", post(fork::fork))
        .route("/sandboxes/{id}/metrics", get(metrics::get_metrics))
        // E2B routes torpor does not serve: answered in E2B's error shape, so the SDKs raise
        // their own exception rather than failing to read the error.
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/snapshots", get(snapshots::list))
        .route("/templates/{id}", axum::routing::delete(snapshots::delete))
        .route("/sandboxes/{id}/logs", get(unsupported))
        .route("/v2/sandboxes/{id}/logs", get(unsupported))
        .route("/sandboxes/metrics", get(unsupported))
        .route("/sandboxes/{id}/refreshes", post(unsupported))
        // Volumes, secrets and template builds: E2B's shape, so the SDK raises its own
        // exception (not a parse error on torpor's own error body).
        .route("/volumes", any(unsupported))
        .route("/volumes/{id}", any(unsupported))
        .route("/secrets", any(unsupported))
        .route("/secrets/{id}", any(unsupported))
        .route("/default-templates", any(unsupported))
        .route("/templates", any(unsupported))
        .route("/templates/tags", any(unsupported))
        .route("/templates/aliases/{alias}", any(unsupported))
        .route("/templates/{id}/{*rest}", any(unsupported))
        .route("/v2/templates", any(unsupported))
        .route("/v2/templates/{id}", any(unsupported))
        .route("/v2/templates/{id}/{*rest}", any(unsupported))
        .route("/v3/templates", any(unsupported))
        .route("/process.Process/{method}", post(envd::process_rpc))
        .route("/filesystem.Filesystem/{method}", post(fs::filesystem_rpc))
        .route("/files", get(files::download).post(files::upload))
        .route("/health", get(envd::health))
        .with_state(st)
}

/// An E2B route torpor does not serve: 501 in E2B's `{code, message}` shape, once the caller
/// is authenticated (401 before that, as for every E2B route).
async fn unsupported(
    axum::extract::State(st): axum::extract::State<Arc<E2b>>,
    headers: axum::http::HeaderMap,
    uri: axum::http::Uri,
) -> E2bError {
    if let Err(e) = control::authenticate(&st, &headers) {
        return e;
    }
    E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!(
            "{} is not supported by torpor's E2B API (see docs/E2B.md)",
            uri.path()
        ),
    )
}

/// Every second: sandboxes past their E2B deadline go to sleep (or are deleted for
/// `on_timeout: kill`). Stops when the router is dropped.
async fn timeout_task(st: std::sync::Weak<E2b>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(st) = st.upgrade() else { return };
        let expired = fs::expire_watchers(&st);
        if expired > 0 {
            tracing::info!(expired, "e2b watchers unpolled for 60 s removed");
        }
        if let Err(e) = enforce_timeouts(&st).await {
            tracing::warn!(error = %e.message, "e2b timeout sweep failed");
        }
    }
}

/// Puts every running sandbox past its E2B deadline to sleep (or deletes it). Each action runs
/// in its own task: one sandbox whose calls hold its suspend (up to the drain bound) does not
/// hold the sweep, nor any other tenant's deadlines; a sandbox already being acted on is skipped.
pub async fn enforce_timeouts(st: &Arc<E2b>) -> Result<(), E2bError> {
    let now = torpor_core::now_millis();
    // Only sandboxes with a deadline are read (not every sandbox, every second).
    for rec in st.api.engine.sandboxes_with_metadata(META_END_AT)? {
        if is_snapshot(&rec) {
            continue;
        }
        let Some(end_at) = rec
            .metadata
            .get(META_END_AT)
            .and_then(|v| v.parse::<i64>().ok())
        else {
            continue;
        };
        if end_at > now {
            continue;
        }
        if !is_running(rec.tier) {
            // Asleep already (torpor's idle policy): only E2B's view changes, at once.
            timeout_asleep(st, &rec).await;
            continue;
        }
        if !st
            .timeouts_in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.id.clone())
        {
            continue;
        }
        let kill = rec.metadata.get(META_ON_TIMEOUT).map(String::as_str) == Some("kill");
        let reboot = timeout_reboots(&rec);
        tracing::info!(sandbox = %rec.id, kill, reboot, "e2b timeout reached");
        let st = st.clone();
        tokio::spawn(async move {
            let result = timeout_action(&st, &rec.id, kill, reboot).await;
            if let Err(e) = result {
                tracing::warn!(sandbox = %rec.id, error = %e, "e2b timeout action failed");
            }
            st.timeouts_in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&rec.id);
        });
    }
    Ok(())
}

/// Whether a sandbox's timeout pauses it without memory ([`META_PAUSE_MEMORY`]).
fn timeout_reboots(rec: &torpor_control::SandboxRecord) -> bool {
    rec.metadata.get(META_PAUSE_MEMORY).map(String::as_str) == Some("0")
}

/// The deadline of a sandbox already asleep passed: deleted (`kill`) or marked paused.
async fn timeout_asleep(st: &E2b, rec: &torpor_control::SandboxRecord) {
    let admin = TenantId::admin();
    let result = if rec.metadata.get(META_ON_TIMEOUT).map(String::as_str) == Some("kill") {
        st.api.engine.delete_sandbox(&admin, &rec.id).await
    } else if timeout_reboots(rec)
        && st
            .api
            .engine
            .reboot_on_next_wake(&admin, &rec.id, true)
            .is_err()
    {
        Ok(()) // logged by the engine; E2B's view stays running, so the next sweep retries
    } else {
        st.api
            .engine
            .patch_sandbox_metadata(&admin, &rec.id, &paused_patch(rec, "timeout"))
            .map(|_| ())
    };
    if let Err(e) = result {
        tracing::warn!(sandbox = %rec.id, error = %e, "e2b timeout of a sleeping sandbox failed");
    }
}

async fn timeout_action(
    st: &E2b,
    id: &SandboxId,
    kill: bool,
    reboot: bool,
) -> Result<(), torpor_control::ControlError> {
    let admin = TenantId::admin();
    if kill {
        return st.api.engine.delete_sandbox(&admin, id).await;
    }
    let rec = st.api.engine.sandbox(&admin, id)?;
    // A filesystem-only pause: the next wake reboots it.
    st.api.engine.reboot_on_next_wake(&admin, id, reboot)?;
    // Paused to E2B from now on (is_running answers false while it checkpoints), and the
    // deadline cleared: a later wake must not be put back to sleep at once; `connect` (or
    // an auto-resume) sets a new one.
    st.api
        .engine
        .patch_sandbox_metadata(&admin, id, &paused_patch(&rec, "timeout"))?;
    let slept = st.api.engine.suspend(&admin, id, Tier::Parked).await;
    if let Err(e) = &slept {
        // Still resident: no wake is coming that the mark is for (a race lost to the idle
        // policy leaves it asleep, and marked).
        if reboot && !matches!(e, torpor_control::ControlError::InvalidTransition { .. }) {
            let _ = st.api.engine.reboot_on_next_wake(&admin, id, false);
        }
    }
    slept.map(|_| ())
}
