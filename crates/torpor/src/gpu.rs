//! `torpor gpu …`: the GPU engine's operator commands. They read local files (or NVML) and
//! call `torpor_gpu`; none of them talks to a daemon.
//!
//! - `ls`: the node's GPUs, their modes and free capacity (NVML when a driver loads, else the
//!   declared `--inventory` file; an explicit `--inventory` always wins).
//! - `plan`: applies a JSON-lines stream of requests in order and prints one line per request.
//! - `extender`: a Kubernetes scheduler extender (`POST /filter`, `/prioritize`, `/bind`), every
//!   route behind the scheduler's bearer token (`--extender-token-file`, compared in constant
//!   time) unless the operator says `--no-auth`; pod names and namespaces are validated as
//!   Kubernetes names and percent-encoded before they go into API server URLs.
//!
//! Exit codes: 0 done (a `plan` whose requests were refused still exits 0: the refusals are
//! its answer), 1 cannot run (NVML and no file, cannot listen), 2 usage (clap), 3 bad input
//! (inventory, requests or quota file). Errors print `error[CODE]: message` on stderr, or with
//! `--json` one line `{"error": {"code": ..., "message": ...}}`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::{Subcommand, ValueEnum};
use serde::Serialize;
use torpor_gpu::extender::{
    Extender, ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::Ledger;
use torpor_gpu::planner::{Policy, Strategy};
use torpor_gpu::pod_watch;
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::report;

/// Exit code for bad input files.
pub const EXIT_BAD_INPUT: i32 = 3;
/// Exit code when the command cannot run at all.
pub const EXIT_CANNOT_RUN: i32 = 1;
/// Largest requests file `plan` reads.
const MAX_REQUESTS_BYTES: u64 = 64 * 1024 * 1024;
/// Largest extender request body (a NodeList of a large cluster).
const MAX_EXTENDER_BODY: usize = 64 * 1024 * 1024;

#[derive(Subcommand)]
pub enum GpuCmd {
    /// The node's GPUs: model, memory, NUMA node, MIG geometry, mode, shares, free capacity.
    Ls {
        /// A declared inventory (TOML); without it, NVML is asked.
        #[arg(long)]
        inventory: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Apply GPU requests (one JSON object a line) in order and print where each lands.
    Plan {
        #[arg(long)]
        inventory: PathBuf,
        /// JSON lines: {count, mode, profile?, compute_pct?, memory_mib?, same_nvlink_domain?,
        /// numa_local?, tenant?}.
        #[arg(long)]
        requests: PathBuf,
        #[arg(long, value_enum, default_value_t = PolicyArg::Binpack)]
        policy: PolicyArg,
        /// Tenant quotas (TOML); without it, no quota is enforced.
        #[arg(long)]
        quotas: Option<PathBuf>,
        /// One JSON line per request (the default prints a line of text per request).
        #[arg(long)]
        json: bool,
    },
    /// Serve a Kubernetes scheduler extender (filter, prioritize, bind) over HTTP.
    Extender {
        #[arg(long)]
        listen: SocketAddr,
        /// One declared inventory per node (repeat the flag or list several files).
        #[arg(long, required = true, num_args = 1..)]
        inventory: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = PolicyArg::Binpack)]
        policy: PolicyArg,
        #[arg(long)]
        quotas: Option<PathBuf>,
        /// Kubernetes API base URL (plain HTTP, e.g. `kubectl proxy` at http://127.0.0.1:8001):
        /// after a successful bind the extender posts the pod's Binding there. Without it,
        /// /bind only commits the GPU shares.
        #[arg(long)]
        kube_api: Option<String>,
        /// Bearer token file for --kube-api (e.g. a service account token).
        #[arg(long, requires = "kube_api")]
        kube_token_file: Option<PathBuf>,
        /// A file holding the token callers must send as `Authorization: Bearer TOKEN` on every
        /// route (at least 16 characters; surrounding whitespace ignored). Required unless
        /// `--no-auth`.
        #[arg(long)]
        extender_token_file: Option<PathBuf>,
        /// Serve every route to anyone who reaches `--listen`, without a token (a loopback
        /// address, or a network only the scheduler reaches).
        #[arg(long, conflicts_with = "extender_token_file")]
        no_auth: bool,
        /// With --kube-api: how often each node's pods are listed again (seconds); between
        /// lists a watch delivers pod ends at once. Bound pods that ended or were deleted
        /// give their GPU shares back.
        #[arg(long, requires = "kube_api", default_value_t = 30)]
        kube_resync_secs: u64,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PolicyArg {
    Binpack,
    Spread,
}

impl PolicyArg {
    fn policy(self) -> Policy {
        match self {
            PolicyArg::Binpack => Policy {
                strategy: Strategy::Binpack,
                ..Policy::default()
            },
            PolicyArg::Spread => Policy::spread(),
        }
    }
}

/// A failure with its stable code and exit code.
#[derive(Debug)]
pub struct GpuCliError {
    pub code: &'static str,
    pub message: String,
    pub exit: i32,
}

impl GpuCliError {
    fn bad_input(code: &'static str, message: impl Into<String>) -> Self {
        GpuCliError {
            code,
            message: message.into(),
            exit: EXIT_BAD_INPUT,
        }
    }

    fn cannot_run(code: &'static str, message: impl Into<String>) -> Self {
        GpuCliError {
            code,
            message: message.into(),
            exit: EXIT_CANNOT_RUN,
        }
    }
}

#[derive(Serialize)]
struct ErrorLine<'a> {
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: &'a str,
}

/// Runs a `torpor gpu` command and returns the process exit code.
pub async fn run(cmd: GpuCmd) -> i32 {
    let json = match &cmd {
        GpuCmd::Ls { json, .. } | GpuCmd::Plan { json, .. } => *json,
        GpuCmd::Extender { .. } => false,
    };
    match dispatch(cmd).await {
        Ok(()) => 0,
        Err(e) => {
            if json {
                let line = ErrorLine {
                    error: ErrorBody {
                        code: e.code,
                        message: &e.message,
                    },
                };
                eprintln!(
                    "{}",
                    serde_json::to_string(&line).unwrap_or_else(|_| e.message.clone())
                );
            } else {
                eprintln!("error[{}]: {}", e.code, e.message);
            }
            e.exit
        }
    }
}

async fn dispatch(cmd: GpuCmd) -> Result<(), GpuCliError> {
    match cmd {
        GpuCmd::Ls { inventory, json } => {
            let (inventory, source) = node_inventory(inventory.as_deref())?;
            let ledger = Ledger::new(&inventory);
            if json {
                #[derive(Serialize)]
                struct Ls<'a> {
                    node: &'a str,
                    source: &'a str,
                    gpus: Vec<report::GpuRow>,
                }
                crate::common::print_json(&Ls {
                    node: inventory.node.as_str(),
                    source: &source,
                    gpus: report::gpu_rows(&inventory, &ledger),
                });
            } else {
                println!("node {} ({source})", inventory.node);
                print!("{}", report::inventory_table(&inventory, &ledger));
            }
            Ok(())
        }
        GpuCmd::Plan {
            inventory,
            requests,
            policy,
            quotas,
            json,
        } => {
            let inventory = load_inventory(&inventory)?;
            let quotas = load_quotas(quotas.as_deref())?;
            let text = read_requests(&requests)?;
            let mut ledger = Ledger::new(&inventory);
            let lines =
                report::plan_lines(&inventory, &mut ledger, &text, &policy.policy(), &quotas);
            let mut out = String::new();
            for line in &lines {
                if json {
                    out.push_str(&serde_json::to_string(line).map_err(|e| {
                        GpuCliError::cannot_run("internal", format!("cannot encode a line: {e}"))
                    })?);
                } else {
                    out.push_str(&plan_text(line));
                }
                out.push('\n');
            }
            print!("{out}");
            Ok(())
        }
        GpuCmd::Extender {
            listen,
            inventory,
            policy,
            quotas,
            kube_api,
            kube_token_file,
            kube_resync_secs,
            extender_token_file,
            no_auth,
        } => {
            let token = match (&extender_token_file, no_auth) {
                (Some(p), _) => Some(read_extender_token(p)?),
                (None, true) => None,
                (None, false) => {
                    return Err(GpuCliError::bad_input(
                        "extender_auth_missing",
                        "give --extender-token-file FILE (callers send `Authorization: Bearer TOKEN`), or --no-auth to serve /filter, /prioritize and /bind to anyone who reaches --listen",
                    ))
                }
            };
            let kube = match kube_api {
                None => None,
                Some(base) => {
                    if !base.starts_with("http://") {
                        return Err(GpuCliError::bad_input(
                            "kube_api_not_http",
                            format!("--kube-api {base}: only http:// is supported (run `kubectl proxy` next to the extender)"),
                        ));
                    }
                    let token = match &kube_token_file {
                        None => None,
                        Some(p) => Some(
                            std::fs::read_to_string(p)
                                .map_err(|e| {
                                    GpuCliError::bad_input(
                                        "kube_token_read",
                                        format!("{}: {e}", p.display()),
                                    )
                                })?
                                .trim()
                                .to_owned(),
                        ),
                    };
                    Some(KubeApi {
                        base: base.trim_end_matches('/').to_owned(),
                        token,
                        http: reqwest::Client::new(),
                        resync: std::time::Duration::from_secs(kube_resync_secs.max(1)),
                    })
                }
            };
            let mut inventories = Vec::with_capacity(inventory.len());
            for path in &inventory {
                let inv = load_inventory(path)?;
                if inventories.iter().any(|i: &Inventory| i.node == inv.node) {
                    return Err(GpuCliError::bad_input(
                        "inventory_duplicate_node",
                        format!("{}: node {} is declared twice", path.display(), inv.node),
                    ));
                }
                inventories.push(inv);
            }
            let quotas = load_quotas(quotas.as_deref())?;
            serve_extender(
                listen,
                Extender::new(inventories, policy.policy(), quotas),
                kube,
                token,
                shutdown_signal(),
            )
            .await
        }
    }
}

fn plan_text(line: &report::PlanLine) -> String {
    match (&line.devices, &line.reason) {
        (Some(devices), _) => {
            let parts: Vec<String> = devices
                .iter()
                .map(|d| {
                    let mut s = format!("gpu {} {}", d.gpu_index, d.mode);
                    if let (Some(p), Some(start)) = (&d.profile, d.start) {
                        s.push_str(&format!(" {p}@{start}"));
                    }
                    if let Some(pct) = d.compute_pct {
                        s.push_str(&format!(" {pct}%"));
                    }
                    if let Some(mib) = d.memory_mib {
                        s.push_str(&format!(" {mib} MiB"));
                    }
                    s
                })
                .collect();
            format!("{}: placed on {}", line.request, parts.join(", "))
        }
        (None, Some(reason)) => format!(
            "{}: refused [{}] {}",
            line.request, reason.code, reason.message
        ),
        (None, None) => format!("{}: refused", line.request),
    }
}

/// Reads a declared inventory; its errors carry the file, line and column.
pub fn load_inventory(path: &Path) -> Result<Inventory, GpuCliError> {
    Inventory::load(path).map_err(|e| GpuCliError::bad_input(e.code(), error_chain(&e)))
}

fn load_quotas(path: Option<&Path>) -> Result<QuotaBook, GpuCliError> {
    match path {
        None => Ok(QuotaBook::unlimited()),
        Some(p) => {
            QuotaBook::load(p).map_err(|e| GpuCliError::bad_input(e.code(), error_chain(&e)))
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let inner_text = inner.to_string();
        // Some errors already print their source; do not say it twice.
        if !s.contains(&inner_text) {
            s.push_str(": ");
            s.push_str(&inner_text);
        }
        source = inner.source();
    }
    s
}

fn read_requests(path: &Path) -> Result<String, GpuCliError> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| GpuCliError::bad_input("requests_read", format!("{}: {e}", path.display())))?;
    let mut text = String::new();
    file.take(MAX_REQUESTS_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| GpuCliError::bad_input("requests_read", format!("{}: {e}", path.display())))?;
    if text.len() as u64 > MAX_REQUESTS_BYTES {
        return Err(GpuCliError::bad_input(
            "requests_too_large",
            format!("{}: larger than {MAX_REQUESTS_BYTES} bytes", path.display()),
        ));
    }
    Ok(text)
}

/// This machine's host name (the node name of an NVML inventory).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The node's inventory: the declared file when given, else NVML. Returns it with its source
/// (`nvml` or the file's path).
pub fn node_inventory(declared: Option<&Path>) -> Result<(Inventory, String), GpuCliError> {
    if let Some(path) = declared {
        return Ok((load_inventory(path)?, path.display().to_string()));
    }
    match nvml_inventory() {
        Ok(inv) => Ok((inv, torpor_gpu::nvml::SOURCE.to_owned())),
        Err(e) => Err(GpuCliError::cannot_run(
            "gpu_no_inventory",
            format!(
                "{}; pass --inventory FILE to use a declared inventory",
                e.message
            ),
        )),
    }
}

/// The inventory NVML reports, when a driver loads at run time.
pub fn nvml_inventory() -> Result<Inventory, GpuCliError> {
    let node = torpor_gpu::ids::NodeName::new(host_name()).map_err(|e| {
        GpuCliError::cannot_run(e.code(), format!("host name is not a node name: {e}"))
    })?;
    let nvml = torpor_gpu::nvml::driver::open()
        .map_err(|e| GpuCliError::cannot_run(e.code(), error_chain(&e)))?;
    torpor_gpu::nvml::driver::read_inventory(&nvml, node)
        .map_err(|e| GpuCliError::cannot_run(e.code(), error_chain(&e)))
}

/// Parses `--gpu JSON` of `create` and `template add`.
pub fn parse_gpu_json(s: &str) -> Result<serde_json::Value, String> {
    let v: serde_json::Value =
        serde_json::from_str(s).map_err(|e| format!("not a JSON GPU request: {e}"))?;
    if !v.is_object() {
        return Err(
            "a GPU request is a JSON object, e.g. {\"mode\":\"mps\",\"compute_pct\":25}".into(),
        );
    }
    Ok(v)
}

/// The daemon's GPUs: the declared file when given, else NVML when a driver loads, else none.
pub fn daemon_gpus(
    inventory: Option<PathBuf>,
    quotas: Option<PathBuf>,
    cuda_checkpoint: Option<PathBuf>,
    data_dir: &Path,
) -> anyhow::Result<Option<torpor_control::gpu::NodeGpus>> {
    let nvml_inventory = match &inventory {
        Some(_) => None,
        None => match nvml_inventory() {
            Ok(inv) => Some(inv),
            Err(e) => {
                tracing::info!(code = e.code, reason = %e.message, "no GPUs on this node");
                None
            }
        },
    };
    let from_nvml = nvml_inventory.is_some();
    let mut gpus = torpor_control::gpu::NodeGpus::open(
        torpor_control::gpu::GpuConfig {
            inventory,
            quotas,
            nvml_inventory,
            cuda_checkpoint,
        },
        data_dir,
    )
    .map_err(|e| anyhow::anyhow!("GPU setup: {e} ({})", e.code()))?;
    if let (true, Some(gpus)) = (from_nvml, gpus.as_mut()) {
        // Telemetry under DCGM exporter's names on every scrape of /metrics.
        match torpor_gpu::nvml::driver::open() {
            Ok(nvml) => {
                // One NVML handle for the life of the daemon: the XID watcher thread waits on
                // it, so it is never dropped.
                let nvml: &'static torpor_gpu::nvml::driver::Nvml = Box::leak(Box::new(nvml));
                // MIG placements become GPU and compute instances through NVML.
                gpus.set_mig_driver(Box::new(torpor_gpu::nvml::driver::NvmlMigDriver::new(nvml)));
                let xids = torpor_gpu::nvml::driver::watch_xids(nvml);
                gpus.set_sampler(Box::new(move || {
                    let tensor = torpor_gpu::nvml::driver::tensor_active(
                        nvml,
                        std::time::Duration::from_millis(100),
                    );
                    torpor_gpu::nvml::driver::sample_with(nvml, Some(&xids), &tensor)
                        .map_err(|e| error_chain(&e))
                }))
            }
            Err(e) => tracing::warn!(error = %error_chain(&e), "no GPU telemetry"),
        }
    }
    Ok(gpus)
}

/// Where bound pods' Binding objects are posted.
#[derive(Clone)]
pub struct KubeApi {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
    resync: std::time::Duration,
}

impl KubeApi {
    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let mut request = self.http.get(format!("{}{path}", self.base));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        request
    }

    /// `GET /api/v1/pods?fieldSelector=spec.nodeName=NODE`.
    async fn list_pods(&self, node: &str) -> Result<pod_watch::PodList, String> {
        let path = pod_watch::list_path(node);
        let response = self
            .get(&path)
            .timeout(std::time::Duration::from_secs(60))
            .send()
            .await
            .map_err(|e| format!("kube_api_unreachable: {path}: {e}"))?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| format!("kube_api_unreachable: {path}: {e}"))?;
        if !status.is_success() {
            return Err(format!(
                "kube_api_list_refused: {path}: HTTP {status}: {}",
                String::from_utf8_lossy(&body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
        serde_json::from_slice(&body).map_err(|e| format!("kube_api_bad_pod_list: {path}: {e}"))
    }

    /// Watches a node's pods from `resource_version` until the server ends the watch
    /// (`timeoutSeconds`), an `ERROR` event comes, or the connection drops; releases the
    /// shares of bound pods that end. Returns the last resource version seen.
    async fn watch_pods(
        &self,
        state: &ExtenderState,
        node: &str,
        mut resource_version: String,
    ) -> Result<String, String> {
        let path = pod_watch::watch_path(node, &resource_version, self.resync.as_secs());
        let mut response = self
            .get(&path)
            .send()
            .await
            .map_err(|e| format!("kube_api_unreachable: {path}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!(
                "kube_api_watch_refused: {path}: HTTP {}",
                response.status()
            ));
        }
        let mut buffer: Vec<u8> = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("kube_api_watch_broken: {path}: {e}"))?
        {
            buffer.extend_from_slice(&chunk);
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                let event: pod_watch::WatchEvent = serde_json::from_slice(line)
                    .map_err(|e| format!("kube_api_bad_watch_event: {e}"))?;
                let bound: std::collections::BTreeSet<String> =
                    lock(state).bound_on(node).into_keys().collect();
                match pod_watch::watch_action(&event, &bound) {
                    pod_watch::WatchAction::Release {
                        uid,
                        resource_version: rv,
                    } => {
                        if lock(state).release_pod(&uid) {
                            tracing::info!(pod = %uid, %node, event = %event.kind, "pod ended: GPU shares released");
                        }
                        if !rv.is_empty() {
                            resource_version = rv;
                        }
                    }
                    pod_watch::WatchAction::Continue {
                        resource_version: rv,
                    } => {
                        if !rv.is_empty() {
                            resource_version = rv;
                        }
                    }
                    pod_watch::WatchAction::Relist { reason } => return Err(reason),
                }
            }
        }
        Ok(resource_version)
    }

    /// Keeps `node`'s bound pods in step with the API server: list, release what ended,
    /// watch until the resync period is over, and again.
    async fn reconcile_node(self, state: ExtenderState, node: String) {
        loop {
            let started = lock(&state).begin_list();
            let begun = std::time::Instant::now();
            match self.list_pods(&node).await {
                Ok(list) => {
                    let ended =
                        pod_watch::ended_in_list(&lock(&state).bound_on(&node), &list, started);
                    for uid in ended {
                        if lock(&state).release_pod(&uid) {
                            tracing::info!(pod = %uid, %node, "pod ended or gone: GPU shares released");
                        }
                    }
                    if let Err(e) = self
                        .watch_pods(&state, &node, list.metadata.resource_version)
                        .await
                    {
                        tracing::info!(%node, reason = %e, "pod watch ended; listing again");
                    }
                }
                Err(e) => {
                    tracing::warn!(%node, error = %e, "cannot list the node's pods");
                    tokio::time::sleep(self.resync.min(std::time::Duration::from_secs(5))).await;
                }
            }
            // At least a second between lists.
            let floor = std::time::Duration::from_secs(1);
            if let Some(rest) = floor.checked_sub(begun.elapsed()) {
                tokio::time::sleep(rest).await;
            }
        }
    }

    /// `POST /api/v1/namespaces/{ns}/pods/{name}/binding`, what kube-scheduler itself does;
    /// the names are validated Kubernetes names, percent-encoded.
    async fn post_binding(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        let path = args
            .binding_path()
            .map_err(|e| format!("{}: {e}", e.code()))?;
        let url = format!("{}{path}", self.base);
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        });
        let mut request = self.http.post(&url).json(&body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .map_err(|e| format!("kube_api_unreachable: {url}: {e}"))?;
        if response.status().is_success() {
            return Ok(());
        }
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        Err(format!(
            "kube_api_binding_refused: {url}: HTTP {status}: {}",
            text.chars().take(500).collect::<String>()
        ))
    }
}

#[derive(Clone)]
struct ExtenderState {
    extender: Arc<Mutex<Extender>>,
    kube: Option<KubeApi>,
    /// The bearer token every route needs; `None`: `--no-auth`.
    token: Option<Arc<str>>,
}

/// Reads `--extender-token-file`: one token, at least 16 characters.
fn read_extender_token(path: &Path) -> Result<String, GpuCliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        GpuCliError::bad_input(
            "extender_token_read",
            format!("--extender-token-file {}: {e}", path.display()),
        )
    })?;
    let token = text.trim();
    if token.len() < 16 || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(GpuCliError::bad_input(
            "extender_token_weak",
            format!(
                "--extender-token-file {}: the token must be one word of at least 16 characters",
                path.display()
            ),
        ));
    }
    Ok(token.to_owned())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Every route, unknown ones included, answers 401 without the scheduler's token.
async fn require_token(
    State(state): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(expected) = &state.token else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if given.is_some_and(|t| constant_time_eq(t.as_bytes(), expected.as_bytes())) {
        return next.run(request).await;
    }
    tracing::warn!(path = %request.uri().path(), "extender call without the scheduler's token refused");
    (
        StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
        Json(PlainError {
            code: "unauthorized",
            message: "this extender needs `Authorization: Bearer TOKEN` (the token of --extender-token-file)".into(),
        }),
    )
        .into_response()
}

type Shared = ExtenderState;

/// Serves the extender until `shutdown` completes.
pub async fn serve_extender(
    listen: SocketAddr,
    extender: Extender,
    kube: Option<KubeApi>,
    token: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), GpuCliError> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        GpuCliError::cannot_run("listen_failed", format!("cannot listen on {listen}: {e}"))
    })?;
    let addr = listener.local_addr().unwrap_or(listen);
    // Tests and scripts read this line to learn the port of `--listen 127.0.0.1:0`.
    println!("listening on {addr}");
    let state = ExtenderState {
        extender: Arc::new(Mutex::new(extender)),
        kube,
        token: token.map(Arc::from),
    };
    let mut watchers = Vec::new();
    if let Some(kube) = &state.kube {
        let nodes = lock(&state).node_names();
        for node in nodes {
            watchers.push(tokio::spawn(
                kube.clone().reconcile_node(state.clone(), node),
            ));
        }
    }
    let app = extender_router(state);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| GpuCliError::cannot_run("serve_failed", e.to_string()));
    for w in watchers {
        w.abort();
    }
    served
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn extender_router(state: Shared) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .layer(DefaultBodyLimit::max(MAX_EXTENDER_BODY))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .with_state(state)
}

/// A body that is not the extender's JSON: 400 with the route's own result type carrying the
/// error, so the scheduler shows it.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("extender_bad_request: {e}"))
}

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, Extender> {
    // A panic while holding the lock cannot leave the extender half-updated: every method
    // computes on copies and commits at the end; keep serving.
    state.extender.lock().unwrap_or_else(|p| p.into_inner())
}

async fn filter(State(state): State<Shared>, body: Bytes) -> Response {
    match parse::<ExtenderArgs>(&body) {
        Ok(args) => {
            let result = lock(&state).filter(&args);
            tracing::info!(
                passed = result.node_names.as_ref().map_or(0, Vec::len),
                failed = result.failed_nodes.len(),
                unknown = result.failed_and_unresolvable_nodes.len(),
                "filter"
            );
            Json(result).into_response()
        }
        Err(error) => (
            StatusCode::BAD_REQUEST,
            Json(ExtenderFilterResult {
                error,
                ..ExtenderFilterResult::default()
            }),
        )
            .into_response(),
    }
}

#[derive(Serialize)]
struct PlainError {
    code: &'static str,
    message: String,
}

async fn prioritize(State(state): State<Shared>, body: Bytes) -> Response {
    match parse::<ExtenderArgs>(&body) {
        Ok(args) => Json(lock(&state).prioritize(&args)).into_response(),
        Err(message) => (
            StatusCode::BAD_REQUEST,
            Json(PlainError {
                code: "extender_bad_request",
                message,
            }),
        )
            .into_response(),
    }
}

async fn bind(State(state): State<Shared>, body: Bytes) -> Response {
    match parse::<ExtenderBindingArgs>(&body) {
        Ok(args) => {
            // The names go into API server URLs: only what Kubernetes itself would make.
            if let Err(e) = args.validate() {
                tracing::warn!(pod = %args.pod_uid, error = %e, "bind refused: not Kubernetes names");
                let error = format!("{}: {e}", e.code());
                return (
                    StatusCode::BAD_REQUEST,
                    Json(ExtenderBindingResult { error }),
                )
                    .into_response();
            }
            let mut result = lock(&state).bind(&args);
            if let (true, Some(kube)) = (result.error.is_empty(), &state.kube) {
                if let Err(error) = kube.post_binding(&args).await {
                    // The pod is not bound: give its GPU shares back.
                    lock(&state).release_pod(&args.pod_uid);
                    result.error = error;
                } else {
                    // Lists sent before now may not show it on its node yet.
                    lock(&state).touch_bound(&args.pod_uid);
                }
            }
            tracing::info!(pod = %args.pod_uid, node = %args.node, error = %result.error, "bind");
            Json(result).into_response()
        }
        Err(error) => (
            StatusCode::BAD_REQUEST,
            Json(ExtenderBindingResult { error }),
        )
            .into_response(),
    }
}
