//! Command-line arguments and the client commands. Tables for people, `--json` for scripts.
//! About 1,000 lines because it is the whole clap command tree in one place (every flag of every
//! sub-command, with its help text); the sub-commands' work lives in their own modules.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use torpor_api::client::UploadKind;
use torpor_api::types::{CreateSandboxBody, ExecBody, ExecEvent, Sandbox, Template};
use torpor_core::{
    IdlePolicy, Limits, LimitsPatch, NetworkPolicy, TemplateName, TemplateSource, TemplateSpec,
    Tier,
};

use crate::common::{
    client, human_bytes, is_admin, print_json, CliError, CliResult, Conn, DEFAULT_LISTEN,
    ENV_DATA_DIR,
};
use crate::daemon;

#[derive(Parser)]
#[command(
    name = "torpor",
    version,
    about = "AI agents in gVisor sandboxes that sleep and wake with their whole state"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
// Parsed once at start: `up`'s many flags make its variant the big one, and that costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the all-in-one daemon: API, workers, state and checkpoints on this machine.
    Up {
        #[arg(long, default_value = DEFAULT_LISTEN)]
        listen: SocketAddr,
        /// Sandboxes that may be resident at once (default: from the machine's memory).
        #[arg(long)]
        workers: Option<usize>,
        #[arg(long, env = ENV_DATA_DIR)]
        data_dir: Option<PathBuf>,
        /// Path of the runsc binary (default: found on PATH).
        #[arg(long)]
        runsc: Option<PathBuf>,
        /// gVisor platform (default: systrap if this runsc has it, else ptrace).
        #[arg(long)]
        platform: Option<String>,
        /// How long a call waits (parked) for a free worker before 503 no_worker_available.
        #[arg(long, default_value_t = 5000)]
        worker_wait_ms: u64,
        /// How long an explicit suspend waits for calls in flight before 409 sandbox_busy.
        #[arg(long, default_value_t = 30_000)]
        drain_timeout_ms: u64,
        /// How many calls may wait for a worker at once; beyond it, 503 lot_full.
        #[arg(long, default_value_t = 1024)]
        lot_size: usize,
        /// Free workers kept for tenants that hold none while another tenant's calls wait, so
        /// that a tenant calling now and then is not queued behind another's flood: `auto` (one
        /// on nodes of 4 workers or more, none below) or a number (0: keep none).
        #[arg(long, default_value = "auto")]
        reserved_workers: torpor_control::Reserve,
        /// Node memory budget for resident sandboxes, e.g. 12G (default: 70% of RAM); over
        /// it, the least recently active sandboxes are parked.
        #[arg(long, value_parser = daemon::parse_size)]
        memory_budget: Option<u64>,
        /// How often the idle policy runs.
        #[arg(long, default_value_t = 500)]
        tick_ms: u64,
        /// Free workers kept prepared (cgroups, bundle directory) so that a wake does only the
        /// restore (default: as many as --workers; 0 prepares every worker at wake time).
        #[arg(long)]
        warm_pool: Option<usize>,
        /// Run each sandbox under a small supervisor (`torpor shim`) that holds its agent
        /// channel, so that running sandboxes survive a crash, a SIGKILL or an upgrade of the
        /// daemon and are taken back as they were at its next start. `false`: a restart sends
        /// every running sandbox back to its last snapshot.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        live_restore: bool,
        /// Rewrite each parked sandbox's checkpoint in the background, and each template's
        /// golden snapshot once, with uncompressed (stored) frames, which a wake or create
        /// restores without inflating: faster for compressible state, at the cost of disk (an
        /// image as large as the memory it holds; skipped while less than 10% or 1 GiB of the
        /// data directory's disk would be left). `false`: images stay as runsc writes them.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        reencode_images: bool,
        /// Declared GPU inventory (TOML); without it NVML is asked when a driver loads.
        #[arg(long)]
        gpu_inventory: Option<PathBuf>,
        /// Tenant GPU quotas (TOML); without it no GPU quota is enforced.
        #[arg(long)]
        gpu_quotas: Option<PathBuf>,
        /// cuda-checkpoint to run inside GPU sandboxes before a checkpoint (else searched in
        /// the sandbox's rootfs, then on PATH).
        #[arg(long, env = "TORPOR_CUDA_CHECKPOINT")]
        cuda_checkpoint: Option<PathBuf>,
        #[command(flatten)]
        store: crate::snapshot::StoreArgs,
        /// Serve KEDA's external scaler (gRPC) on this address, e.g. 0.0.0.0:9090.
        #[arg(long)]
        keda_listen: Option<SocketAddr>,
        /// The only host directory a tenant's template source may name (rootfs or image path);
        /// without it tenants may not name host paths at all and upload images instead.
        #[arg(long)]
        import_dir: Option<PathBuf>,
        /// Brokers event-driven pools may name, as HOST[:PORT] (comma-separated or repeated);
        /// without it tenants' pools may name no broker (the admin's may name any).
        #[arg(long, value_delimiter = ',')]
        broker_allow: Vec<String>,
        /// Serve GET /metrics without a token on this separate address (else /metrics on the
        /// API listener needs the admin token or DATA_DIR/metrics-token).
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
        /// API requests per second for tenants created without `requests_per_s`.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
        default_requests_per_s: u64,
        /// API connections open at once; more are accepted and closed at once (default 4096,
        /// lowered to fit RLIMIT_NOFILE beside the workers' descriptors).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
        max_connections: Option<u64>,
        /// How long a request head may take to arrive, and a connection may sit idle, before
        /// the connection is closed.
        #[arg(long, default_value_t = crate::serve::DEFAULT_HEADER_READ_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(100..))]
        header_read_timeout_ms: u64,
        /// The least time between two batches of the audit log made durable (group commit):
        /// calls never wait for it; a crash loses at most this much of the log. 0: every
        /// batch at once (one fsync or more per call under a steady stream).
        #[arg(long, default_value_t = torpor_api::audit::COMMIT_EVERY.as_millis() as u64, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        audit_commit_ms: u64,
        /// Host-based routing to sandbox ports: `{port}-{id}.<DOMAIN>` (docs/NETWORKING.md).
        #[arg(long)]
        proxy_domain: Option<String>,
        /// Egress ceiling of E2B's `base` template: `none` (ingress only, the default), `full`,
        /// or comma-separated CIDRs; the host's addresses stay closed whatever it says
        /// (docs/E2B.md).
        #[arg(long, value_parser = torpor_api::e2b::base::parse_ceiling)]
        e2b_egress_ceiling: Option<torpor_core::NetworkPolicy>,
        /// Most a networked sandbox may send, in Mbit/s (dropped above; docs/NETWORKING.md).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        egress_mbit: u32,
        /// Most packets per second a networked sandbox may send.
        #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u32).range(1..))]
        egress_pps: u32,
        /// Host destinations sandboxes may reach, as ADDR or ADDR:PORT (comma-separated or
        /// repeated); without it no sandbox reaches any of the host's addresses, link-local,
        /// loopback or the daemon's listeners, whatever its policy (docs/NETWORKING.md).
        #[arg(long, value_delimiter = ',')]
        sandbox_reach_host: Vec<torpor_runtime::net::HostReach>,
        /// Relayed TCP connections one sandbox may have open at once (new ones are reset).
        /// Default 256, lowered to fit RLIMIT_NOFILE beside --workers when that is low.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_sandbox_connections: Option<u32>,
        #[command(flatten)]
        telemetry: crate::telemetry::TelemetryArgs,
        #[command(flatten)]
        tls: crate::tls_listen::TlsArgs,
    },
    /// Inspect, verify and collect the snapshot store (operator only).
    #[command(subcommand)]
    Snapshot(crate::snapshot::SnapshotCmd),
    /// Manage templates.
    #[command(subcommand)]
    Template(TemplateCmd),
    /// Manage tenants (operator only).
    #[command(subcommand)]
    Tenant(TenantCmd),
    /// Event-driven pools: agents scaled from queue depth, to zero and back.
    #[command(subcommand)]
    Pool(crate::pool::PoolCmd),
    /// The audit log on this machine: verify its chain, print its last records.
    #[command(subcommand)]
    Audit(crate::audit::AuditCmd),
    /// Usage per tenant (and sandbox, hour): memory, CPU, GPU, snapshots, wakes, egress.
    Usage(crate::usage::UsageArgs),
    /// What tenants' agents cost (a price sheet over measured usage) against one resident
    /// sandbox and a whole GPU each: a table, --json, or --html FILE.
    Report(crate::finops::ReportArgs),
    /// The cluster's certificate authority (cluster mode, preview; docs/OPERATIONS.md).
    #[command(subcommand)]
    Ca(crate::ca::CaCmd),
    /// Serve this machine's sandboxes to the cluster's controllers (cluster mode, preview).
    Worker(crate::worker::WorkerArgs),
    /// Serve the API over the cluster's workers, state in PostgreSQL (cluster mode, preview;
    /// docs/CLUSTER.md).
    Controller(crate::controller::ControllerArgs),
    /// Kubernetes: print the CRDs, or run the operator that reconciles them into torpor's API.
    #[command(subcommand)]
    K8s(crate::k8s::K8sCmd),
    /// Create a sandbox from a template (a restore of its golden snapshot).
    Create {
        template: String,
        /// Environment for commands run in it (KEY=VALUE, repeatable).
        #[arg(long = "env", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Metadata (KEY=VALUE, repeatable).
        #[arg(long = "meta", value_parser = parse_kv)]
        meta: Vec<(String, String)>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        cpus: Option<f64>,
        #[arg(long)]
        pids: Option<u64>,
        /// GPU request as JSON, e.g. '{"mode":"mps","compute_pct":25}' (overrides the template's).
        #[arg(long, value_parser = crate::gpu::parse_gpu_json)]
        gpu: Option<serde_json::Value>,
        /// Network policy: none, full, or JSON such as '{"allow":[{"cidr":"10.0.0.0/8"}],"hosts":["api.example.com"]}' (docs/NETWORKING.md).
        #[arg(long, value_parser = parse_network)]
        network: Option<NetworkPolicy>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List sandboxes.
    Ls {
        /// Only sandboxes in this state or tier.
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Workers, the parking lot and resident memory.
    Workers {
        #[command(flatten)]
        conn: Conn,
    },
    /// Show one sandbox, or the daemon's health without an id.
    Status {
        id: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Run a command in a sandbox (waking it if it sleeps); exits with its exit code.
    Exec {
        id: String,
        #[arg(long = "env", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Start it in the background and return its pid.
        #[arg(long)]
        detach: bool,
        /// Print output as it comes.
        #[arg(long)]
        stream: bool,
        #[command(flatten)]
        conn: Conn,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Copy a file into or out of a sandbox: `cp LOCAL ID:/path` or `cp ID:/path LOCAL`.
    Cp {
        src: String,
        dest: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Put a sandbox to sleep (default tier: parked).
    Suspend {
        id: String,
        #[arg(long, value_enum)]
        tier: Option<TierArg>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Make N sandboxes from a sandbox's latest snapshot, without copying (parks it if running).
    Fork {
        id: String,
        #[arg(short = 'n', long, default_value_t = 1)]
        count: usize,
        #[command(flatten)]
        conn: Conn,
    },
    /// Wake a sandbox.
    Resume {
        id: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a sandbox and its snapshots.
    Rm {
        id: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// GPU inventory, placement plans and the Kubernetes scheduler extender (no daemon needed).
    #[command(subcommand)]
    Gpu(crate::gpu::GpuCmd),
    /// Start a daemon in a temporary directory (or use --url), run a fleet of agents through
    /// sleep and wake, check their state and print a summary.
    Demo(crate::demo::DemoArgs),
    /// The init process inside every sandbox (internal).
    #[command(hide = true)]
    SandboxAgent {
        #[arg(last = true)]
        main: Vec<String>,
    },
    /// The supervisor of one container's runsc process (internal; see live restore).
    #[command(hide = true)]
    Shim {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        socket: String,
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per run; boxing would only add noise
pub enum TemplateCmd {
    /// Register a template: import its filesystem, boot it once, take its golden snapshot.
    Add {
        name: String,
        /// A root-filesystem directory on the daemon's machine (the admin's, or under the
        /// daemon's --import-dir).
        #[arg(long, conflicts_with = "image")]
        rootfs: Option<String>,
        /// An OCI layout, oci-archive or `docker save` tarball: uploaded from this machine
        /// unless the caller is the admin (then a path on the daemon's machine).
        #[arg(long)]
        image: Option<String>,
        /// A tarball of a root filesystem on this machine, uploaded.
        #[arg(long, conflicts_with_all = ["rootfs", "image"])]
        rootfs_tar: Option<PathBuf>,
        /// Upload the --image file even as the admin.
        #[arg(long, requires = "image")]
        upload: bool,
        /// Which image in the archive (tag or ref name).
        #[arg(long, requires = "image")]
        reference: Option<String>,
        /// The agent's main process, e.g. --cmd python3 --cmd /app/agent.py
        #[arg(long = "cmd", allow_hyphen_values = true)]
        command: Vec<String>,
        #[arg(long = "env", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        cpus: Option<f64>,
        #[arg(long)]
        pids: Option<u64>,
        /// Seconds idle before Frozen / Parked / Suspended; a negative value disables the step.
        #[arg(long)]
        freeze_after: Option<f64>,
        #[arg(long)]
        park_after: Option<f64>,
        #[arg(long)]
        suspend_after: Option<f64>,
        /// Let the main process warm up this long before the golden snapshot.
        #[arg(long, default_value_t = 0)]
        warmup_ms: u64,
        /// GPU request every sandbox of the template gets, as JSON, e.g. '{"mode":"mig","profile":"1g.18gb"}'.
        #[arg(long, value_parser = crate::gpu::parse_gpu_json)]
        gpu: Option<serde_json::Value>,
        /// Network policy of its sandboxes: none, full, or JSON such as '{"allow":[{"cidr":"10.0.0.0/8"}],"hosts":["api.example.com"]}' (docs/NETWORKING.md).
        #[arg(long, value_parser = parse_network)]
        network: Option<NetworkPolicy>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List templates.
    Ls {
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a template (it must have no sandboxes).
    Rm {
        name: String,
        #[command(flatten)]
        conn: Conn,
    },
}

#[derive(Subcommand)]
pub enum TenantCmd {
    /// Create a tenant and print its token (shown once).
    Create {
        name: String,
        #[arg(long)]
        max_sandboxes: Option<u64>,
        #[arg(long)]
        max_running: Option<u64>,
        #[arg(long)]
        max_memory_mib: Option<u64>,
        /// CPU limits of its resident sandboxes, summed.
        #[arg(long)]
        max_cpus: Option<u64>,
        #[arg(long)]
        max_templates: Option<u64>,
        #[arg(long)]
        max_pools: Option<u64>,
        /// Disk its checkpoints, golden snapshots and uploads take, in MiB.
        #[arg(long)]
        max_disk_mib: Option<u64>,
        /// API requests per second (default: the daemon's --default-requests-per-s).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        requests_per_s: Option<u64>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List tenants and their quotas.
    Ls {
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a tenant that owns nothing.
    Rm {
        name: String,
        #[command(flatten)]
        conn: Conn,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum TierArg {
    Frozen,
    Parked,
    Suspended,
}

impl From<TierArg> for Tier {
    fn from(t: TierArg) -> Tier {
        match t {
            TierArg::Frozen => Tier::Frozen,
            TierArg::Parked => Tier::Parked,
            TierArg::Suspended => Tier::Suspended,
        }
    }
}

pub(crate) fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// `--network`: `none`, `full` or a JSON rule list, checked as the daemon checks it.
fn parse_network(s: &str) -> Result<NetworkPolicy, String> {
    let p: NetworkPolicy = match s.trim() {
        "none" => NetworkPolicy::none(),
        "full" => NetworkPolicy::full(),
        json => serde_json::from_str(json).map_err(|e| {
            format!("expected none, full or a JSON policy such as '{{\"allow\":[]}}': {e}")
        })?,
    };
    p.validate().map_err(|e| e.to_string())?;
    Ok(p)
}

pub async fn run(cli: Cli) -> i32 {
    match dispatch(cli.command).await {
        Ok(code) => code,
        Err(CliError(msg)) => {
            eprintln!("error: {msg}");
            1
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TORPOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

async fn dispatch(cmd: Command) -> CliResult {
    match cmd {
        Command::Up {
            listen,
            workers,
            data_dir,
            runsc,
            platform,
            worker_wait_ms,
            drain_timeout_ms,
            lot_size,
            reserved_workers,
            memory_budget,
            tick_ms,
            warm_pool,
            live_restore,
            reencode_images,
            gpu_inventory,
            gpu_quotas,
            cuda_checkpoint,
            store,
            keda_listen,
            import_dir,
            broker_allow,
            metrics_listen,
            default_requests_per_s,
            max_connections,
            header_read_timeout_ms,
            audit_commit_ms,
            proxy_domain,
            e2b_egress_ceiling,
            egress_mbit,
            egress_pps,
            sandbox_reach_host,
            max_sandbox_connections,
            telemetry,
            tls,
        } => {
            let telemetry = crate::telemetry::Telemetry::init(&telemetry)?;
            torpor_runtime::net::set_host_guard(
                sandbox_reach_host,
                &[Some(listen), metrics_listen, keda_listen, tls.tls_listen]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>(),
            );
            torpor_runtime::net::set_egress_limits(torpor_runtime::net::EgressLimits {
                mbit_per_s: egress_mbit,
                packets_per_s: egress_pps,
            });
            if let Some(d) = &proxy_domain {
                torpor_api::proxy::set_proxy_domain(d);
            }
            crate::tls_listen::prepare(&tls, torpor_api::proxy::proxy_domain())
                .await
                .map_err(|e| CliError(e.report()))?;
            if let Some(c) = e2b_egress_ceiling {
                torpor_api::e2b::base::set_egress_ceiling(c);
            }
            let up = daemon::up(daemon::UpConfig {
                listen,
                data_dir: data_dir.unwrap_or_else(daemon::default_data_dir),
                workers,
                runsc,
                platform,
                worker_wait: Duration::from_millis(worker_wait_ms),
                drain_timeout: Duration::from_millis(drain_timeout_ms),
                lot_capacity: lot_size.max(1),
                reserved_workers,
                memory_budget,
                tick: Duration::from_millis(tick_ms.max(50)),
                warm_pool,
                live_restore,
                reencode_images,
                gpu_inventory,
                gpu_quotas,
                cuda_checkpoint,
                snapshots: store.config(),
                keda_listen,
                import_dir,
                broker_allow,
                metrics_listen,
                default_requests_per_s,
                max_connections: max_connections.map(|m| m as usize),
                header_read_timeout: Duration::from_millis(header_read_timeout_ms),
                audit_commit: Duration::from_millis(audit_commit_ms),
                max_sandbox_connections: max_sandbox_connections.map(|n| n as usize),
                cluster: None,
            })
            .await;
            telemetry.shutdown().await;
            up?;
            Ok(0)
        }
        Command::Template(t) => template(t).await,
        Command::Tenant(t) => tenant(t).await,
        Command::Snapshot(c) => crate::snapshot::run(c).await,
        Command::Pool(p) => crate::pool::run(p).await,
        Command::Audit(a) => crate::audit::run(a),
        Command::Usage(u) => crate::usage::run(u).await,
        Command::Report(r) => crate::finops::run(r).await,
        Command::Ca(c) => crate::ca::run(c),
        Command::Worker(w) => {
            init_logging();
            Ok(crate::worker::run(w).await.map(|()| 0)?)
        }
        Command::Controller(c) => {
            let telemetry = crate::telemetry::Telemetry::init(&c.telemetry)?;
            let run = crate::controller::run(c).await;
            telemetry.shutdown().await;
            Ok(run.map(|()| 0)?)
        }
        Command::K8s(k) => {
            init_logging();
            Ok(crate::k8s::run(k).await.map(|()| 0)?)
        }
        Command::Create {
            template,
            env,
            meta,
            memory_mib,
            cpus,
            pids,
            gpu,
            network,
            conn,
        } => {
            let c = client(&conn)?;
            let t = Instant::now();
            let s = c
                .create_sandbox(&CreateSandboxBody {
                    template,
                    env: env.into_iter().collect(),
                    metadata: meta.into_iter().collect(),
                    limits: Some(LimitsPatch {
                        memory_mib,
                        cpus,
                        pids,
                    }),
                    gpu,
                    network,
                })
                .await?;
            if conn.json {
                print_json(&s);
            } else {
                println!("{}", s.id);
                eprintln!(
                    "created from {} in {:.0} ms",
                    s.template,
                    t.elapsed().as_secs_f64() * 1000.0
                );
            }
            Ok(0)
        }
        Command::Ls { state, conn } => {
            let c = client(&conn)?;
            let all = c.sandboxes(state.as_deref()).await?;
            if conn.json {
                print_json(&all);
            } else {
                print_sandboxes(&all);
            }
            Ok(0)
        }
        Command::Workers { conn } => {
            let w = client(&conn)?.workers().await?;
            if conn.json {
                print_json(&w);
            } else {
                println!(
                    "workers: {} total, {} busy, {} free ({} kept for tenants holding none); parked calls: {} (lot {}, budget {} ms)",
                    w.total, w.busy, w.free, w.reserved_workers, w.parked_calls, w.lot_capacity, w.park_budget_ms
                );
                println!(
                    "resident memory: {} of {}",
                    human_bytes(w.resident_memory_bytes),
                    w.memory_budget_bytes
                        .map_or("no budget".into(), human_bytes)
                );
                println!(
                    "warm pool: {} of {} ready; wakes on a prepared worker {}, prepared inline {}",
                    w.warm_ready, w.warm_pool_size, w.warm_takes, w.cold_takes
                );
            }
            Ok(0)
        }
        Command::Status { id, conn } => {
            let c = client(&conn)?;
            match id {
                Some(id) => {
                    let s = c.sandbox(&id).await?;
                    if conn.json {
                        print_json(&s);
                    } else {
                        print_sandbox(&s);
                    }
                }
                None => {
                    let h = c.health().await?;
                    if conn.json {
                        print_json(&h);
                    } else {
                        println!(
                            "torpor {} at {}: {} (runsc {}, platform {}, {} workers)",
                            h.version,
                            c.base_url(),
                            h.status,
                            h.runsc_version,
                            h.platform,
                            h.workers
                        );
                    }
                }
            }
            Ok(0)
        }
        Command::Exec {
            id,
            env,
            cwd,
            timeout_ms,
            detach,
            stream,
            conn,
            cmd,
        } => {
            let c = client(&conn)?;
            let stdin = if atty_stdin() {
                None
            } else {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                (!s.is_empty()).then_some(s)
            };
            let body = ExecBody {
                cmd,
                env: env.into_iter().collect::<BTreeMap<_, _>>(),
                cwd,
                stdin,
                timeout_ms,
                detach,
                stream: false,
            };
            let result = if stream && !conn.json {
                c.exec_stream(&id, &body, |ev| match ev {
                    ExecEvent::Stdout { data } => {
                        print!("{data}");
                        let _ = std::io::stdout().flush();
                    }
                    ExecEvent::Stderr { data } => eprint!("{data}"),
                    _ => {}
                })
                .await?
            } else {
                let r = c.exec(&id, &body).await?;
                if conn.json {
                    print_json(&r);
                    return Ok(0);
                }
                if detach {
                    println!("started pid {}", r.stdout);
                    return Ok(0);
                }
                print!("{}", r.stdout);
                eprint!("{}", r.stderr);
                r
            };
            if result.oom_killed {
                eprintln!("torpor: the sandbox ran out of memory and was killed (oom_killed)");
            }
            Ok(result.exit_code.unwrap_or(1))
        }
        Command::Cp { src, dest, conn } => {
            let c = client(&conn)?;
            match (split_remote(&src), split_remote(&dest)) {
                (Some((id, path)), None) => {
                    let data = c.read_file(id, path).await?;
                    std::fs::write(&dest, data)?;
                }
                (None, Some((id, path))) => {
                    let data = std::fs::read(&src)?;
                    use std::os::unix::fs::PermissionsExt;
                    let mode = std::fs::metadata(&src)?.permissions().mode() & 0o7777;
                    c.write_file(id, path, data, Some(mode)).await?;
                }
                _ => {
                    return Err(CliError(
                        "exactly one side must be a sandbox path, ID:/path".into(),
                    ))
                }
            }
            Ok(0)
        }
        Command::Suspend { id, tier, conn } => {
            let c = client(&conn)?;
            let t = Instant::now();
            let s = c.suspend(&id, tier.map(Tier::from)).await?;
            if conn.json {
                print_json(&s);
            } else {
                println!(
                    "{} is {} ({:.0} ms)",
                    s.id,
                    s.tier,
                    t.elapsed().as_secs_f64() * 1000.0
                );
            }
            Ok(0)
        }
        Command::Fork { id, count, conn } => {
            let forks = client(&conn)?.fork(&id, count).await?;
            if conn.json {
                print_json(&forks);
            } else {
                for f in &forks {
                    println!("{}", f.id);
                }
            }
            Ok(0)
        }
        Command::Resume { id, conn } => {
            let c = client(&conn)?;
            let t = Instant::now();
            let s = c.resume(&id).await?;
            if conn.json {
                print_json(&s);
            } else {
                println!(
                    "{} is {} ({:.0} ms)",
                    s.id,
                    s.tier,
                    t.elapsed().as_secs_f64() * 1000.0
                );
            }
            Ok(0)
        }
        Command::Rm { id, conn } => {
            client(&conn)?.delete_sandbox(&id).await?;
            Ok(0)
        }
        Command::Gpu(g) => {
            init_logging();
            Ok(crate::gpu::run(g).await)
        }
        Command::Demo(args) => crate::demo::run(args).await.map_err(CliError::from),
        Command::SandboxAgent { .. } | Command::Shim { .. } => {
            unreachable!("handled before the runtime starts")
        }
    }
}

async fn template(cmd: TemplateCmd) -> CliResult {
    match cmd {
        TemplateCmd::Add {
            name,
            rootfs,
            image,
            rootfs_tar,
            upload,
            reference,
            command,
            env,
            cwd,
            memory_mib,
            cpus,
            pids,
            freeze_after,
            park_after,
            suspend_after,
            warmup_ms,
            gpu,
            network,
            conn,
        } => {
            let c = client(&conn)?;
            // Tenants bring archives by upload; host paths are the admin's (or --import-dir's).
            let upload = match (&image, rootfs_tar) {
                (_, Some(tar)) => Some((tar, UploadKind::Rootfs)),
                (Some(img), None) if upload || !is_admin(&conn) => {
                    Some((PathBuf::from(img), UploadKind::Image))
                }
                _ => None,
            };
            let source = match (rootfs, image) {
                (Some(path), None) => TemplateSource::Rootfs { path },
                (None, Some(path)) if upload.is_none() => TemplateSource::Image {
                    path,
                    reference: reference.clone(),
                },
                _ => TemplateSource::Host,
            };
            let defaults = IdlePolicy::default();
            let step = |v: Option<f64>, d: Option<f64>| match v {
                Some(v) if v < 0.0 => None,
                Some(v) => Some(v),
                None => d,
            };
            let base = Limits::default();
            let spec = TemplateSpec {
                name: TemplateName::new(&name).map_err(|e| CliError(e.to_string()))?,
                source,
                command,
                env: env.into_iter().collect(),
                cwd,
                limits: Limits {
                    memory_mib: memory_mib.unwrap_or(base.memory_mib),
                    cpus: cpus.unwrap_or(base.cpus),
                    pids: pids.unwrap_or(base.pids),
                },
                idle: IdlePolicy {
                    freeze_after_s: step(freeze_after, defaults.freeze_after_s),
                    park_after_s: step(park_after, defaults.park_after_s),
                    suspend_after_s: step(suspend_after, defaults.suspend_after_s),
                },
                warmup_ms,
                gpu,
                network,
            };
            if !conn.json {
                eprintln!("building template {name}: import, boot, golden snapshot ...");
            }
            let t = Instant::now();
            let tpl = match upload {
                Some((file, kind)) => {
                    if !conn.json {
                        eprintln!("uploading {}", file.display());
                    }
                    c.upload_template_image(
                        &name,
                        &upload_spec(&spec),
                        &file,
                        kind,
                        reference.as_deref(),
                    )
                    .await?
                }
                None => c.create_template(&spec).await?,
            };
            if conn.json {
                print_json(&tpl);
            } else {
                eprintln!(
                    "template {} ready in {:.1} s (golden snapshot {})",
                    tpl.name,
                    t.elapsed().as_secs_f64(),
                    human_bytes(tpl.golden_snapshot_bytes)
                );
            }
            Ok(0)
        }
        TemplateCmd::Ls { conn } => {
            let all = client(&conn)?.templates().await?;
            if conn.json {
                print_json(&all);
            } else {
                print_templates(&all);
            }
            Ok(0)
        }
        TemplateCmd::Rm { name, conn } => {
            client(&conn)?.delete_template(&name).await?;
            Ok(0)
        }
    }
}

async fn tenant(cmd: TenantCmd) -> CliResult {
    match cmd {
        TenantCmd::Create {
            name,
            max_sandboxes,
            max_running,
            max_memory_mib,
            max_cpus,
            max_templates,
            max_pools,
            max_disk_mib,
            requests_per_s,
            conn,
        } => {
            let created = client(&conn)?
                .create_tenant(&torpor_api::types::CreateTenantBody {
                    name,
                    quotas: Some(torpor_api::types::Quotas {
                        max_sandboxes,
                        max_running,
                        max_memory_mib,
                        max_cpus,
                        max_templates,
                        max_pools,
                        max_disk_mib,
                        requests_per_s,
                    }),
                })
                .await?;
            if conn.json {
                println!(
                    "{}",
                    serde_json::json!({"name": created.name, "token": created.token})
                );
            } else {
                println!("{}", created.token);
                eprintln!(
                    "tenant {} created; this token is shown once: keep it (TORPOR_TOKEN)",
                    created.name
                );
            }
            Ok(0)
        }
        TenantCmd::Ls { conn } => {
            let all = client(&conn)?.tenants().await?;
            if conn.json {
                print_json(&all);
            } else {
                let q = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                println!(
                    "{:<20} {:>9} {:>8} {:>10} {:>5} {:>9} {:>5} {:>9} {:>6}  CREATED",
                    "NAME",
                    "SANDBOXES",
                    "RUNNING",
                    "MEMORY MIB",
                    "CPUS",
                    "TEMPLATES",
                    "POOLS",
                    "DISK MIB",
                    "REQ/S"
                );
                for t in all {
                    let qs = &t.quotas;
                    println!(
                        "{:<20} {:>9} {:>8} {:>10} {:>5} {:>9} {:>5} {:>9} {:>6}  {}",
                        t.name,
                        q(qs.max_sandboxes),
                        q(qs.max_running),
                        q(qs.max_memory_mib),
                        q(qs.max_cpus),
                        q(qs.max_templates),
                        q(qs.max_pools),
                        q(qs.max_disk_mib),
                        q(qs.requests_per_s),
                        t.created_at
                    );
                }
            }
            Ok(0)
        }
        TenantCmd::Rm { name, conn } => {
            client(&conn)?.delete_tenant(&name).await?;
            Ok(0)
        }
    }
}

/// The `spec` part of an upload: the template's fields but its name and source.
fn upload_spec(spec: &TemplateSpec) -> serde_json::Value {
    let mut v = serde_json::to_value(spec).expect("a template spec serialises");
    if let Some(o) = v.as_object_mut() {
        o.remove("name");
        o.remove("source");
    }
    v
}

fn split_remote(s: &str) -> Option<(&str, &str)> {
    let (id, path) = s.split_once(':')?;
    (id.starts_with("sb-") && !path.is_empty()).then_some((id, path))
}

fn atty_stdin() -> bool {
    // SAFETY: isatty on fd 0 has no preconditions.
    unsafe { libc::isatty(0) == 1 }
}

fn print_sandboxes(all: &[Sandbox]) {
    println!(
        "{:<20} {:<14} {:<13} {:<10} {:<24}",
        "ID", "TEMPLATE", "STATE", "TIER", "LAST ACTIVE"
    );
    for s in all {
        println!(
            "{:<20} {:<14} {:<13} {:<10} {:<24}",
            s.id, s.template, s.state, s.tier, s.last_active_at
        );
    }
}

fn print_sandbox(s: &Sandbox) {
    println!("id:           {}", s.id);
    println!("template:     {}", s.template);
    println!("tenant:       {}", s.tenant);
    println!("state:        {} (tier {})", s.state, s.tier);
    println!("created:      {}", s.created_at);
    println!("last active:  {}", s.last_active_at);
    println!(
        "limits:       {} MiB, {} cpus, {} pids",
        s.limits.memory_mib, s.limits.cpus, s.limits.pids
    );
    if s.oom_killed {
        println!("oom_killed:   true");
    }
    if let Some(e) = &s.last_error {
        println!("last error:   {e}");
    }
}

fn print_templates(all: &[Template]) {
    println!(
        "{:<16} {:<8} {:<10} {:<8} {:>12}  COMMAND",
        "NAME", "TENANT", "SOURCE", "STATUS", "GOLDEN"
    );
    for t in all {
        let source = match &t.source {
            TemplateSource::Host => "host",
            TemplateSource::Rootfs { .. } => "rootfs",
            TemplateSource::Image { .. } => "image",
        };
        println!(
            "{:<16} {:<8} {:<10} {:<8} {:>12}  {}",
            t.name,
            t.tenant,
            source,
            t.status,
            human_bytes(t.golden_snapshot_bytes),
            t.command.join(" ")
        );
    }
}
