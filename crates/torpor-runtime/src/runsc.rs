//! The gVisor backend: runs `runsc` to boot, restore, checkpoint and destroy containers.
//!
//! runsc is feature-detected at start ([`Runsc::detect`]): its version, its platforms and how it
//! spells the in-memory root overlay. Each container is one foreground `runsc run` or
//! `runsc restore` process whose stdin and stdout are the agent channel ([`crate::conn`]); its
//! stderr goes to a log file under the data directory. When that process exits, the container
//! is gone — by checkpoint (expected) or by crash (reported with the OOM flag).
//!
//! Container ids are `<sandbox id>-g<generation>`: every restore gets a fresh id, so a stale
//! container from a crashed daemon never collides with a new one.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::cgroup;
use crate::conn::{AgentConn, ConnError};
use crate::proto::{Reply, Request};
use crate::shim::{self, ShimMeta, ShimNet, Shims};
use crate::spec::{self, ContainerSpec};
use crate::warm::Worker;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("runsc not found at {path}; install gVisor (Debian: `apt-get install runsc`)")]
    RunscMissing { path: PathBuf },
    #[error("`runsc {command}` failed ({status}): {stderr}")]
    RunscFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the sandbox's agent did not answer within {0:?}; log: {1}")]
    AgentTimeout(Duration, String),
    #[error("the container exited while starting; log: {0}")]
    ExitedEarly(String),
    #[error(transparent)]
    Conn(#[from] ConnError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("sandbox network: {0}")]
    Net(#[from] crate::net::NetError),
    #[error("{0}")]
    Unsupported(String),
    /// No machine of the node can take the container now (cluster mode: every worker is
    /// full, draining or lost); retryable.
    #[error("no worker can take it: {0}")]
    NoCapacity(String),
    /// The image to restore is only on a machine that is gone (cluster mode: a checkpoint whose
    /// upload to the snapshot store had not finished when its worker was lost).
    #[error("the image is lost: {0}")]
    ImageLost(String),
    /// The worker's GPUs cannot give the container its share (cluster mode); `code` is the
    /// GPU layer's stable code (`gpu_unavailable`, `gpu_quota_exceeded`, …).
    #[error("GPU ({code}): {message}")]
    Gpu { code: String, message: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A destroy slower than this says where its time went.
const SLOW_DESTROY: Duration = Duration::from_secs(1);
/// How long a destroy waits for a killed container's foreground runsc process to end before
/// it deletes the container anyway.
const FOREGROUND_EXIT_WAIT: Duration = Duration::from_secs(2);

/// What runsc can do, learned at start.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub binary: PathBuf,
    pub version: String,
    pub platform: String,
    /// Global flags that give the root filesystem an in-memory, checkpointed overlay.
    pub overlay_flags: Vec<String>,
    /// Whether `runsc flags` lists `-nvproxy` (GPU pass-through).
    nvproxy: bool,
    /// runsc's state directory (`--root`), private to this torpor.
    pub state_root: PathBuf,
    pub log_dir: PathBuf,
    /// The cgroup of each container started on a warm worker (the others use their own id).
    groups: Arc<Mutex<HashMap<String, String>>>,
    /// Containers running with a network (runsc `--network=sandbox`).
    networked: Arc<Mutex<HashSet<String>>>,
    /// How each container this process started or took back ends (its foreground runsc
    /// process), so a destroy by id waits for it too ([`Runsc::destroy`]).
    foreground: Arc<Mutex<HashMap<String, watch::Receiver<Option<ExitInfo>>>>>,
    /// Where containers' supervisors live (live restore); `None`: runsc is this process's
    /// child and its containers die with it.
    shims: Option<Arc<Shims>>,
}

/// How a container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub oom_killed: bool,
}

pub struct Container {
    pub id: String,
    /// Its cgroup name under `torpor/` (freezer, memory usage).
    pub cgroup: String,
    pub conn: Arc<AgentConn>,
    exit: watch::Receiver<Option<ExitInfo>>,
    /// Set before a checkpoint, so that the exit it causes is not taken for a crash.
    expected_exit: Arc<AtomicBool>,
    /// The supervisor holding its stdio (live restore).
    pub shim_pid: Option<u32>,
}

/// A cloneable view of how a container ends, for tasks that outlive a borrow of it.
#[derive(Clone)]
pub struct ExitHandle {
    exit: watch::Receiver<Option<ExitInfo>>,
    expected_exit: Arc<AtomicBool>,
}

impl ExitHandle {
    /// A handle over an exit channel and an "expected" flag (for other nodes than runsc's).
    pub fn from_parts(
        exit: watch::Receiver<Option<ExitInfo>>,
        expected_exit: Arc<AtomicBool>,
    ) -> ExitHandle {
        ExitHandle {
            exit,
            expected_exit,
        }
    }

    /// Resolves when the container's runsc process has exited.
    pub async fn exited(&self) -> ExitInfo {
        let mut rx = self.exit.clone();
        let seen = rx.wait_for(|e| e.is_some()).await.ok().and_then(|e| *e);
        seen.unwrap_or(ExitInfo {
            code: None,
            signal: None,
            oom_killed: false,
        })
    }

    /// Whether the exit was one torpor asked for (a checkpoint or a delete).
    pub fn expected(&self) -> bool {
        self.expected_exit.load(Ordering::SeqCst)
    }
}

impl Container {
    pub fn exit_handle(&self) -> ExitHandle {
        ExitHandle {
            exit: self.exit.clone(),
            expected_exit: self.expected_exit.clone(),
        }
    }

    /// Marks the coming exit as torpor's own doing.
    pub fn expect_exit(&self) {
        self.expected_exit.store(true, Ordering::SeqCst);
    }

    /// Resolves when the container's runsc process has exited.
    pub async fn exited(&self) -> ExitInfo {
        let mut rx = self.exit.clone();
        let seen = rx.wait_for(|e| e.is_some()).await.ok().and_then(|e| *e);
        seen.unwrap_or(ExitInfo {
            code: None,
            signal: None,
            oom_killed: false,
        })
    }

    pub fn exit_info(&self) -> Option<ExitInfo> {
        *self.exit.borrow()
    }

    /// Whether an exit now would be one torpor asked for.
    pub fn exit_expected(&self) -> bool {
        self.expected_exit.load(Ordering::SeqCst)
    }
}

impl Runsc {
    /// Finds runsc and learns its version, platform and overlay flag. `platform` overrides the
    /// choice (otherwise: systrap when this build has it, else ptrace; kvm only when asked).
    pub fn detect(
        binary: Option<PathBuf>,
        platform: Option<String>,
        state_root: PathBuf,
        log_dir: PathBuf,
    ) -> Result<Self, RuntimeError> {
        let binary = binary.unwrap_or_else(|| find_in_path("runsc"));
        if !binary.exists() {
            return Err(RuntimeError::RunscMissing { path: binary });
        }
        let version_out = run_sync(&binary, &["--version"])?;
        let version = version_out
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("runsc version ")
            .to_string();
        let flags = run_sync(&binary, &["flags"]).unwrap_or_default();
        let platforms = run_sync(&binary, &["help", "platforms"]).unwrap_or_default();
        let has_platform = |p: &str| platforms.lines().any(|l| l.trim() == p);
        let platform = platform.unwrap_or_else(|| {
            if has_platform("systrap") {
                "systrap".into()
            } else {
                "ptrace".into()
            }
        });
        let nvproxy = crate::gpu::flags_have_nvproxy(&flags);
        let overlay_flags = if flags.contains("-overlay2") {
            vec!["--overlay2=root:memory".to_string()]
        } else {
            vec!["--overlay".to_string()]
        };
        for dir in [&state_root, &log_dir] {
            std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        Ok(Runsc {
            binary,
            version,
            platform,
            overlay_flags,
            nvproxy,
            state_root,
            log_dir,
            groups: Arc::default(),
            networked: Arc::default(),
            foreground: Arc::default(),
            shims: None,
        })
    }

    /// Runs every container under a shim from now on, so that it outlives this process
    /// (see [`crate::shim`]).
    pub fn with_shims(mut self, shims: Shims) -> Runsc {
        self.shims = Some(Arc::new(shims));
        self
    }

    pub fn shims(&self) -> Option<&Shims> {
        self.shims.as_deref()
    }

    /// Records, for a later run of the daemon, what it needs to take `c` back (a no-op without
    /// shims). Called once the container's agent answered.
    pub fn record(&self, c: &Container, worker: Option<&Worker>, devices: bool) {
        let (Some(shims), Some(shim_pid)) = (&self.shims, c.shim_pid) else {
            return;
        };
        let meta = ShimMeta {
            container_id: c.id.clone(),
            cgroup: c.cgroup.clone(),
            worker: worker.map(|w| w.name().to_string()),
            networked: self.is_networked(&c.id),
            net: worker.and_then(|w| w.net()).map(|n| ShimNet {
                host_link: n.host_link.clone(),
                host_addr: n.host_addr,
                router_addr: n.router_addr,
            }),
            devices,
            agent_version: c.conn.agent_version(),
            shim_pid,
            socket: shims.socket_of(&c.id),
        };
        if let Err(e) = shims.write_meta(&meta) {
            tracing::warn!(container = %c.id, error = %e,
                "cannot record a container for live restore; a restart will restore it from its snapshot");
        }
    }

    /// Connects again to a container a previous run of the daemon started ([`Runsc::record`]):
    /// it kept running under its shim. `oom` is its group's OOM flag.
    pub fn reattach(
        &self,
        meta: &ShimMeta,
        oom: Arc<AtomicBool>,
    ) -> Result<Container, RuntimeError> {
        let shims = self
            .shims
            .clone()
            .ok_or_else(|| RuntimeError::Unsupported("live restore is off".into()))?;
        let first_id = shim::first_request_id();
        let stream = shim::connect(&meta.socket, first_id).map_err(io_err(&shims.dir))?;
        let (conn, exit) = attach_shim(&shims, &meta.container_id, stream, first_id, oom)
            .map_err(io_err(&shims.dir))?;
        conn.set_agent_version(meta.agent_version);
        if meta.worker.is_some() {
            self.groups
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(meta.container_id.clone(), meta.cgroup.clone());
        }
        if meta.networked {
            self.lock_networked().insert(meta.container_id.clone());
        }
        self.track_foreground(&meta.container_id, &exit);
        Ok(Container {
            id: meta.container_id.clone(),
            cgroup: meta.cgroup.clone(),
            conn,
            exit,
            expected_exit: Arc::new(AtomicBool::new(false)),
            shim_pid: Some(meta.shim_pid),
        })
    }

    /// Whether this runsc has nvproxy (`--nvproxy`), so a sandbox can be given a GPU.
    pub fn nvproxy(&self) -> bool {
        self.nvproxy
    }

    /// Global flags for a container with `spec`'s devices (`--nvproxy` for GPU devices).
    fn device_args(&self, spec: &ContainerSpec) -> Result<Vec<String>, RuntimeError> {
        crate::gpu::runsc_gpu_flags(!spec.devices.is_empty(), self.nvproxy)
            .map_err(|e| RuntimeError::Unsupported(e.to_string()))
    }

    fn global_args(&self) -> Vec<String> {
        self.global_args_net(false)
    }

    fn global_args_net(&self, net: bool) -> Vec<String> {
        let mut args = vec![
            format!("--root={}", self.state_root.display()),
            format!("--platform={}", self.platform),
            if net {
                "--network=sandbox".to_string()
            } else {
                "--network=none".to_string()
            },
        ];
        args.extend(self.overlay_flags.iter().cloned());
        args
    }

    pub fn log_path(&self, container_id: &str) -> PathBuf {
        self.log_dir.join(format!("{container_id}.log"))
    }

    fn write_bundle(
        &self,
        bundle: &Path,
        spec: &ContainerSpec,
        cgroup: &str,
    ) -> Result<(), RuntimeError> {
        std::fs::create_dir_all(bundle).map_err(io_err(bundle))?;
        let path = bundle.join("config.json");
        let json = serde_json::to_vec_pretty(&spec::render(spec, cgroup)).expect("spec serialises");
        std::fs::write(&path, json).map_err(io_err(&path))
    }

    /// Boots a container from scratch and waits until its agent answers.
    pub async fn boot(
        &self,
        container_id: &str,
        bundle: &Path,
        spec: &ContainerSpec,
        ready_timeout: Duration,
    ) -> Result<Container, RuntimeError> {
        let device_args = self.device_args(spec)?;
        self.write_bundle(bundle, spec, container_id)?;
        let mut args = self.global_args();
        args.extend(device_args);
        args.extend([
            "run".into(),
            format!("--bundle={}", bundle.display()),
            container_id.into(),
        ]);
        let oom = cgroup::watch_oom(container_id);
        let c = self.spawn_container(container_id, container_id, oom, args, false)?;
        self.wait_ready(&c, ready_timeout).await?;
        Ok(c)
    }

    /// Starts restoring a container from a checkpoint image on a warm worker (its cgroup and
    /// bundle directory made ahead; the sandbox's limits are written here). Returns as soon as
    /// runsc is running: requests written to the agent now are answered once the restore
    /// completes.
    pub fn restore(
        &self,
        container_id: &str,
        worker: &Worker,
        spec: &ContainerSpec,
        image_dir: &Path,
    ) -> Result<Container, RuntimeError> {
        let device_args = self.device_args(spec)?;
        let (quota, period) = spec::cpu_quota(&spec.limits);
        cgroup::apply_limits(
            worker.cgroup(),
            spec.limits.memory_bytes(),
            quota,
            period,
            spec::host_pids_limit(spec.limits.pids),
        )?;
        let bundle = worker.bundle();
        self.write_bundle(bundle, spec, worker.cgroup())?;
        let net = spec.netns.is_some();
        if net {
            self.lock_networked().insert(container_id.to_string());
        }
        let mut args = self.global_args_net(net);
        args.extend(device_args);
        args.extend([
            "restore".into(),
            format!("--image-path={}", image_dir.display()),
            format!("--bundle={}", bundle.display()),
            container_id.into(),
        ]);
        self.groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(container_id.to_string(), worker.cgroup().to_string());
        self.spawn_container(container_id, worker.cgroup(), worker.oom_flag(), args, net)
    }

    fn lock_networked(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.networked.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_networked(&self, container_id: &str) -> bool {
        self.lock_networked().contains(container_id)
    }

    /// Waits for the agent's hello, or fails with the tail of the container's log.
    pub async fn wait_ready(&self, c: &Container, timeout: Duration) -> Result<(), RuntimeError> {
        let hello = tokio::time::timeout(timeout, c.conn.call(&Request::Hello, &[])).await;
        match hello {
            Ok(Ok((Reply::Hello { version, .. }, _))) => {
                c.conn.set_agent_version(version);
                Ok(())
            }
            Ok(Ok((other, _))) => Err(RuntimeError::ExitedEarly(format!(
                "unexpected hello reply {other:?}"
            ))),
            Ok(Err(_)) => Err(RuntimeError::ExitedEarly(self.log_tail(&c.id))),
            Err(_) => Err(RuntimeError::AgentTimeout(timeout, self.log_tail(&c.id))),
        }
    }

    fn spawn_container(
        &self,
        container_id: &str,
        cgroup: &str,
        oom: Arc<AtomicBool>,
        args: Vec<String>,
        net: bool,
    ) -> Result<Container, RuntimeError> {
        let log_path = self.log_path(container_id);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        if let Some(shims) = self.shims.clone() {
            return self.spawn_shimmed(&shims, container_id, cgroup, oom, &args, net, log);
        }
        let mut cmd = Command::new(&self.binary);
        if net {
            private_proc_sys_net(&mut cmd);
        }
        let mut child = cmd
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(false)
            .spawn()
            .map_err(io_err(&self.binary))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let conn = AgentConn::new(stdin, stdout);
        let (tx, exit) = watch::channel(None);
        tokio::spawn(watch_exit(child, oom, tx));
        self.track_foreground(container_id, &exit);
        Ok(Container {
            id: container_id.to_string(),
            cgroup: cgroup.to_string(),
            conn,
            exit,
            expected_exit: Arc::new(AtomicBool::new(false)),
            shim_pid: None,
        })
    }

    /// Starts runsc under a shim of its own (live restore), connected over a socket pair.
    #[allow(clippy::too_many_arguments)]
    fn spawn_shimmed(
        &self,
        shims: &Arc<Shims>,
        container_id: &str,
        cgroup: &str,
        oom: Arc<AtomicBool>,
        args: &[String],
        net: bool,
        log: std::fs::File,
    ) -> Result<Container, RuntimeError> {
        let dir = shims.dir_of(container_id);
        let mut cmd = shims
            .command(container_id, &self.binary, args)
            .map_err(io_err(&dir))?;
        if net {
            private_proc_sys_net(&mut cmd);
        }
        let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(io_err(&dir))?;
        shim::pass_connection(&mut cmd, &theirs);
        let first_id = shim::first_request_id();
        shim::announce(&mut ours, first_id).map_err(io_err(&dir))?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(false)
            .spawn()
            .map_err(io_err(&shims.binary))?;
        drop(theirs);
        let shim_pid = child.id();
        // Reaped here while this daemon lives; by init after it.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        let (conn, exit) =
            attach_shim(shims, container_id, ours, first_id, oom).map_err(io_err(&dir))?;
        self.track_foreground(container_id, &exit);
        Ok(Container {
            id: container_id.to_string(),
            cgroup: cgroup.to_string(),
            conn,
            exit,
            expected_exit: Arc::new(AtomicBool::new(false)),
            shim_pid,
        })
    }

    /// Checkpoints a running (or frozen) container into `image_dir`; the container is gone
    /// afterwards. On failure the container is gone too (runsc stops it): the caller falls back
    /// to the previous snapshot.
    pub async fn checkpoint(&self, c: &Container, image_dir: &Path) -> Result<(), RuntimeError> {
        std::fs::create_dir_all(image_dir).map_err(io_err(image_dir))?;
        // runsc cannot checkpoint a container frozen behind its back.
        let _ = cgroup::set_frozen(&c.cgroup, false);
        c.expected_exit.store(true, Ordering::SeqCst);
        let mut args = self.global_args_net(self.is_networked(&c.id));
        args.extend([
            "checkpoint".into(),
            format!("--image-path={}", image_dir.display()),
            c.id.clone(),
        ]);
        let result = self.run(&args, "checkpoint").await;
        // The foreground run/restore process ends once the checkpoint is written.
        let _ = tokio::time::timeout(Duration::from_secs(30), c.exited()).await;
        self.destroy(&c.id).await;
        result.map(|_| ())
    }

    /// Kills and deletes a container, whatever its state, and removes its cgroups.
    ///
    /// The sandbox process is thawed and SIGKILLed first: `runsc delete --force` on a running container
    /// of this build waits 5 s for a stop that never comes; on a dead one it takes milliseconds.
    /// A container this process started or took back is waited for as
    /// [`Runsc::destroy_container`] does (a kill by id: a delete cutting calls in flight).
    pub async fn destroy(&self, container_id: &str) {
        let foreground = self
            .foreground
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(container_id)
            .map(|exit| ExitHandle::from_parts(exit.clone(), Arc::new(AtomicBool::new(true))));
        self.destroy_waiting(container_id, foreground).await
    }

    /// Remembers how `container_id` ends, and forgets the containers that ended.
    fn track_foreground(&self, container_id: &str, exit: &watch::Receiver<Option<ExitInfo>>) {
        let mut all = self.foreground.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|_, e| e.borrow().is_none());
        all.insert(container_id.to_string(), exit.clone());
    }

    /// Kills and deletes container `c`, one this process runs (or took back), as
    /// [`Runsc::destroy`] does, but waits for its foreground runsc process to end between the
    /// kill and `runsc delete`. That process reaps the container's gofer only after it has
    /// recorded the exit under the container's state lock; a `runsc delete` that takes the lock
    /// first waits out its 5 s for the gofer, a zombie no one reaps meanwhile (measured: up to
    /// 6 deletes in 20, each 5.1–5.3 s, after a wake of a sandbox holding 64 MiB).
    pub async fn destroy_container(&self, c: &Container) {
        c.expect_exit();
        self.destroy_waiting(&c.id, Some(c.exit_handle())).await
    }

    async fn destroy_waiting(&self, container_id: &str, foreground: Option<ExitHandle>) {
        let t = Instant::now();
        self.foreground
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(container_id);
        let group = self
            .groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(container_id);
        // A frozen process cannot die: thaw first, or the kill leaves it stuck (state D).
        let _ = cgroup::set_frozen(group.as_deref().unwrap_or(container_id), false);
        let net = self.lock_networked().remove(container_id);
        let mut state = self.global_args_net(net);
        state.extend(["state".into(), container_id.into()]);
        let thawed = t.elapsed();
        if let Ok(out) = self.run(&state, "state").await {
            let pid = serde_json::from_str::<serde_json::Value>(&out)
                .ok()
                .and_then(|v| v["pid"].as_i64())
                .filter(|p| *p > 1);
            if let Some(pid) = pid {
                // SAFETY: kill(2) with the sandbox pid runsc reported; no memory is passed.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
        if let Some(exit) = foreground {
            let _ = tokio::time::timeout(FOREGROUND_EXIT_WAIT, exit.exited()).await;
        }
        let killed = t.elapsed();
        let mut args = self.global_args_net(net);
        args.extend(["delete".into(), "--force".into(), container_id.into()]);
        let _ = self.run(&args, "delete").await;
        // A warm worker's group stays: the worker is reset and reused.
        if group.is_none() {
            cgroup::remove_all(container_id);
        }
        if t.elapsed() > SLOW_DESTROY {
            tracing::warn!(
                container = container_id,
                thaw_ms = thawed.as_millis() as u64,
                kill_and_exit_ms = (killed - thawed).as_millis() as u64,
                delete_ms = (t.elapsed() - killed).as_millis() as u64,
                "destroying a container was slow"
            );
        }
    }

    /// Kills every runsc process working on this state directory (`--root`), shims included:
    /// what a daemon that died left running (a restore, a checkpoint, a sandbox), except what
    /// runs under the shims in `keep` (containers taken back by live restore).
    pub fn kill_strays(&self, keep: &HashSet<u32>) -> usize {
        let needle = format!("--root={}", self.state_root.display());
        let me = std::process::id();
        let mut killed = 0;
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return 0;
        };
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if pid == me || under(pid, keep) {
                continue;
            }
            let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else {
                continue;
            };
            if cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == needle.as_bytes())
            {
                // SAFETY: kill(2) with a pid read from /proc; no memory is passed.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                killed += 1;
            }
        }
        killed
    }

    /// The ids of every container in torpor's runsc state directory.
    pub async fn list(&self) -> Vec<String> {
        let mut args = self.global_args();
        args.extend(["list".into(), "--quiet".into()]);
        match self.run(&args, "list").await {
            Ok(out) => out
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    async fn run(&self, args: &[String], what: &str) -> Result<String, RuntimeError> {
        let mut cmd = Command::new(&self.binary);
        if args.iter().any(|a| a == "--network=sandbox") {
            private_proc_sys_net(&mut cmd);
        }
        let out = cmd
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(io_err(&self.binary))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(RuntimeError::RunscFailed {
                command: what.into(),
                status: out.status.to_string(),
                stderr: last_chars(&String::from_utf8_lossy(&out.stderr), 600),
            })
        }
    }

    /// The last lines of a container's log, for error messages.
    pub fn log_tail(&self, container_id: &str) -> String {
        let text = std::fs::read_to_string(self.log_path(container_id)).unwrap_or_default();
        last_chars(&text, 800)
    }
}

/// Whether `pid` is one of `roots` or runs under one of them.
fn under(pid: u32, roots: &HashSet<u32>) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if roots.contains(&p) {
            return true;
        }
        match parent_of(p) {
            Some(pp) if pp > 1 => p = pp,
            _ => return false,
        }
    }
    false
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The agent channel through a shim's connection, and a watch that reports the container's
/// exit once the shim closes it (with the status the shim recorded).
fn attach_shim(
    shims: &Arc<Shims>,
    container_id: &str,
    stream: std::os::unix::net::UnixStream,
    first_id: u64,
    oom: Arc<AtomicBool>,
) -> std::io::Result<(Arc<AgentConn>, watch::Receiver<Option<ExitInfo>>)> {
    stream.set_nonblocking(true)?;
    let (r, w) = tokio::net::UnixStream::from_std(stream)?.into_split();
    let conn = AgentConn::with_first_id(w, r, first_id);
    let (tx, exit) = watch::channel(None);
    let shims = shims.clone();
    let closed = conn.clone();
    let cid = container_id.to_string();
    tokio::spawn(async move {
        closed.closed().await;
        // The shim records the status before it closes; a shim that was killed records none.
        let mut info = None;
        for _ in 0..50 {
            info = shims.take_exit(&cid);
            if info.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let info = info.unwrap_or_else(|| {
            let _ = std::fs::remove_dir_all(shims.dir_of(&cid));
            ExitInfo {
                code: None,
                signal: Some(libc::SIGKILL),
                oom_killed: false,
            }
        });
        report_exit(info, oom, tx).await;
    });
    Ok((conn, exit))
}

fn last_chars(s: &str, n: usize) -> String {
    let s = s.trim();
    let start = s.len().saturating_sub(n);
    let start = (start..=s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    s[start..].to_string()
}

async fn watch_exit(mut child: Child, oom: Arc<AtomicBool>, tx: watch::Sender<Option<ExitInfo>>) {
    use std::os::unix::process::ExitStatusExt;
    let info = match child.wait().await {
        Ok(s) => ExitInfo {
            code: s.code(),
            signal: s.signal(),
            oom_killed: false,
        },
        Err(_) => ExitInfo {
            code: None,
            signal: None,
            oom_killed: false,
        },
    };
    report_exit(info, oom, tx).await;
}

async fn report_exit(
    mut info: ExitInfo,
    oom: Arc<AtomicBool>,
    tx: watch::Sender<Option<ExitInfo>>,
) {
    // The OOM watcher reads the cgroup on the kernel's event; give it a moment to land.
    let t = Instant::now();
    while !oom.load(Ordering::SeqCst) && t.elapsed() < Duration::from_millis(50) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    info.oom_killed = oom.load(Ordering::SeqCst);
    let _ = tx.send(Some(info));
}

/// Runs the command in a private mount namespace with a tmpfs over /proc/sys/net. This runsc
/// build refuses `--network=sandbox` when /proc/sys/net/core/rmem_default exists (its test for
/// "in the root network namespace"), and newer kernels show that file in every namespace.
/// `ip netns exec` is no substitute: it remounts /sys and hides the cgroup mounts.
fn private_proc_sys_net(cmd: &mut Command) {
    // SAFETY: between fork and exec only async-signal-safe syscalls run (unshare, mount), with
    // static, NUL-terminated strings; no allocation, no locks.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let none = c"none".as_ptr();
            if libc::mount(
                none,
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::mount(
                none,
                c"/proc/sys/net".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn find_in_path(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join(name))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("/usr/bin").join(name))
}

fn run_sync(binary: &Path, args: &[&str]) -> Result<String, RuntimeError> {
    let out = std::process::Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(binary))?;
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok(s)
}
