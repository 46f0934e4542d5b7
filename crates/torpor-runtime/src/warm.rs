//! The warm pool: workers whose host-side pieces are made before a wake needs them, so that a
//! wake does only the restore.
//!
//! A worker is a cgroup in every v1 hierarchy (with the OOM notification already armed) and a
//! bundle directory. runsc uses groups it finds as they are, so a wake on a warm worker writes
//! the sandbox's limits (three small files) and starts `runsc restore`; runsc makes, configures
//! and removes nothing. When a sandbox leaves its worker (parked, suspended, deleted, crashed),
//! the [`Worker`] handle is dropped and a background thread resets the group (thaw, kill
//! leftovers, drop the memory still charged to it) and puts it back in the pool, or tears it
//! down when the pool already holds `target` ready workers. A wake that finds no ready worker
//! prepares one inline (a "cold" take, counted).
//!
//! Once a networked sandbox has run, the pool also prepares each ready worker's network
//! (namespaces, links, rules, egress relay: crate::net) in the background, and prefers keeping
//! workers that have one.
//!
//! Group names are `<tag>-w<n>`, `tag` being unique to one daemon (its data directory), so
//! several daemons on one host never share a group and a restarted daemon finds its own
//! leftovers by prefix ([`WarmPool::start`] removes them).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cgroup::{self, CgroupError};
use crate::net::{self, NetAlloc, NetError, WorkerNet};

/// How long a reset waits for a left-over process to die before it gives the group up.
const RESET_TIMEOUT: Duration = Duration::from_secs(10);

/// Counters shown by `GET /v1/workers`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmStats {
    /// Ready workers the pool keeps (configured).
    pub target: usize,
    /// Ready workers now.
    pub ready: usize,
    /// Workers handed out ready-made since start.
    pub warm_takes: u64,
    /// Workers prepared inline because none was ready.
    pub cold_takes: u64,
    /// Workers given up because a reset failed (processes that would not die).
    pub discarded: u64,
}

/// One prepared worker, owned by the pool or by a [`Worker`] handle.
struct Prepared {
    name: String,
    bundle: PathBuf,
    /// The OOM flag of the sandbox now on this worker; the group's watch thread sets it.
    occupant: Arc<Mutex<Arc<AtomicBool>>>,
    /// The worker's network namespaces, made the first time a networked sandbox runs here
    /// and kept with the worker from then on.
    net: Option<WorkerNet>,
}

enum Job {
    Refill,
    Reset(Prepared),
    /// Tear down every ready worker, and from now on every returned one; then acknowledge.
    Close(mpsc::Sender<()>),
}

struct Inner {
    tag: String,
    net_alloc: Arc<NetAlloc>,
    bundles: PathBuf,
    target: usize,
    next: AtomicUsize,
    ready: Mutex<Vec<Prepared>>,
    jobs: Mutex<mpsc::Sender<Job>>,
    warm_takes: AtomicU64,
    cold_takes: AtomicU64,
    discarded: AtomicU64,
    closed: AtomicBool,
    /// Set once a networked sandbox has run: from then on the pool prepares every worker's
    /// network too, so a networked wake does not pay for namespaces, links and rules.
    net_wanted: AtomicBool,
    /// The runtime the egress relays run on (the daemon's).
    rt: Option<tokio::runtime::Handle>,
}

#[derive(Clone)]
pub struct WarmPool {
    inner: Arc<Inner>,
}

/// A worker lent to one sandbox. Dropping it sends it back to the pool to be reset.
pub struct Worker {
    prepared: Option<Prepared>,
    inner: Arc<Inner>,
    warm: bool,
}

impl Worker {
    /// The cgroup name (under `torpor/`) the sandbox runs in.
    pub fn cgroup(&self) -> &str {
        &self.prepared().name
    }

    pub fn bundle(&self) -> &Path {
        &self.prepared().bundle
    }

    /// The worker's name (its cgroup's last component), unique within this daemon's run.
    pub fn name(&self) -> &str {
        &self.prepared().name
    }

    /// Whether it came ready from the pool (else it was prepared for this wake).
    pub fn was_warm(&self) -> bool {
        self.warm
    }

    /// A fresh OOM flag for the sandbox about to run here; the group's watch sets it.
    pub fn oom_flag(&self) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        *self
            .prepared()
            .occupant
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = flag.clone();
        flag
    }

    fn prepared(&self) -> &Prepared {
        self.prepared.as_ref().expect("present until drop")
    }

    /// The worker's network, made now if this worker never ran a networked sandbox.
    pub fn ensure_net(&mut self) -> Result<&WorkerNet, NetError> {
        if !self.inner.net_wanted.swap(true, Ordering::SeqCst) {
            // The first networked sandbox: the pool gives its ready workers networks now.
            self.inner.send(Job::Refill);
        }
        let inner = self.inner.clone();
        let p = self.prepared.as_mut().expect("present until drop");
        if p.net.is_none() {
            p.net = Some(inner.prepare_net(&p.name)?);
        }
        Ok(p.net.as_ref().expect("just made"))
    }

    /// The worker's network, if it has one.
    pub fn net(&self) -> Option<&WorkerNet> {
        self.prepared().net.as_ref()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(p) = self.prepared.take() {
            self.inner.send(Job::Reset(p));
        }
    }
}

impl Inner {
    fn send(&self, job: Job) {
        let tx = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(mpsc::SendError(Job::Reset(p))) = tx.send(job) {
            // The pool's thread is gone (shutdown): just tear the worker down.
            teardown(p);
        }
    }

    fn prepare(&self) -> Result<Prepared, CgroupError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-w{n}", self.tag);
        let bundle = self.bundles.join(&name);
        std::fs::create_dir_all(&bundle).map_err(|source| CgroupError {
            path: bundle.clone(),
            source,
        })?;
        if let Err(e) = cgroup::create_group(&name) {
            cgroup::remove_all(&name);
            return Err(e);
        }
        let occupant = Arc::new(Mutex::new(Arc::new(AtomicBool::new(false))));
        let current = occupant.clone();
        cgroup::spawn_oom_watch(&name, move || {
            current
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .store(true, Ordering::SeqCst);
            true
        });
        Ok(Prepared {
            name,
            bundle,
            occupant,
            net: None,
        })
    }

    fn prepare_net(&self, name: &str) -> Result<WorkerNet, NetError> {
        let rt = self
            .rt
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
            .ok_or_else(|| NetError {
                command: "egress relay".into(),
                stderr: "no tokio runtime to run the relay on".into(),
            })?;
        WorkerNet::prepare(name, &self.tag, &self.net_alloc, &rt)
    }

    /// Gives ready workers without a network one, one at a time (a take meanwhile gets a
    /// worker as it is and makes its network inline).
    fn network_ready_workers(&self) {
        loop {
            let mut p = {
                let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
                match ready.iter().position(|p| p.net.is_none()) {
                    Some(i) => ready.remove(i),
                    None => return,
                }
            };
            match self.prepare_net(&p.name) {
                Ok(n) => p.net = Some(n),
                Err(e) => {
                    tracing::warn!(worker = %p.name, error = %e, "cannot prepare a worker's network")
                }
            }
            let failed = p.net.is_none();
            self.ready.lock().unwrap_or_else(|p| p.into_inner()).push(p);
            if failed || self.closed.load(Ordering::SeqCst) {
                return;
            }
        }
    }

    fn ready_len(&self) -> usize {
        self.ready.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The pool thread: resets returned workers and keeps `target` ready.
    fn run(self: Arc<Self>, jobs: mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            match job {
                Job::Reset(p) if self.closed.load(Ordering::SeqCst) => teardown(p),
                Job::Reset(mut p) => match cgroup::reset_group(&p.name, RESET_TIMEOUT) {
                    Ok(()) if p.net.as_ref().is_some_and(|n| n.reset().is_err()) => {
                        // A network that cannot be reset is made afresh on next use.
                        if let Some(n) = p.net.take() {
                            n.teardown();
                        }
                        self.ready.lock().unwrap_or_else(|p| p.into_inner()).push(p);
                    }
                    Ok(()) if self.ready_len() < self.target => {
                        self.ready.lock().unwrap_or_else(|p| p.into_inner()).push(p);
                    }
                    Ok(()) => {
                        // Full: keep the worker whose network is made, give up one without.
                        let bare = if p.net.is_some() {
                            let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
                            ready
                                .iter()
                                .position(|r| r.net.is_none())
                                .map(|i| ready.remove(i))
                        } else {
                            None
                        };
                        match bare {
                            Some(b) => {
                                // At the bottom: taken after the workers already waiting.
                                self.ready
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .insert(0, p);
                                teardown(b);
                            }
                            None => teardown(p),
                        }
                    }
                    Err(e) => {
                        tracing::warn!(worker = %p.name, error = %e, "cannot reset a worker; discarding it");
                        self.discarded.fetch_add(1, Ordering::Relaxed);
                        teardown(p);
                    }
                },
                Job::Refill => {}
                Job::Close(ack) => {
                    self.closed.store(true, Ordering::SeqCst);
                    self.teardown_ready();
                    let _ = ack.send(());
                }
            }
            while !self.closed.load(Ordering::SeqCst) && self.ready_len() < self.target {
                match self.prepare() {
                    Ok(p) => self.ready.lock().unwrap_or_else(|p| p.into_inner()).push(p),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot prepare a warm worker");
                        break;
                    }
                }
            }
            if self.net_wanted.load(Ordering::SeqCst) && !self.closed.load(Ordering::SeqCst) {
                self.network_ready_workers();
            }
        }
        self.teardown_ready();
    }

    fn teardown_ready(&self) {
        let ready: Vec<Prepared> = self
            .ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for p in ready {
            teardown(p);
        }
    }
}

fn teardown(mut p: Prepared) {
    let _ = cgroup::reset_group(&p.name, RESET_TIMEOUT);
    cgroup::remove_all(&p.name);
    let _ = std::fs::remove_dir_all(&p.bundle);
    if let Some(n) = p.net.take() {
        n.teardown();
    }
}

impl WarmPool {
    /// Starts the pool for the daemon whose state lives in `data_dir`: removes the groups a
    /// previous run left, then prepares `target` workers in the background.
    pub fn start(data_dir: &Path, target: usize) -> WarmPool {
        let tag = tag_for(data_dir);
        let bundles = data_dir.join("workers");
        remove_leftovers(&tag, &bundles);
        let (tx, rx) = mpsc::channel();
        let inner = Arc::new(Inner {
            net_alloc: NetAlloc::new(&tag),
            tag,
            bundles,
            target,
            next: AtomicUsize::new(0),
            ready: Mutex::new(Vec::new()),
            jobs: Mutex::new(tx),
            warm_takes: AtomicU64::new(0),
            cold_takes: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            net_wanted: AtomicBool::new(false),
            rt: tokio::runtime::Handle::try_current().ok(),
        });
        let worker = inner.clone();
        let spawned = std::thread::Builder::new()
            .name("warm-pool".into())
            .spawn(move || worker.run(rx));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the warm pool thread; every wake is cold");
        }
        inner.send(Job::Refill);
        WarmPool { inner }
    }

    /// A worker for one sandbox: a ready one when there is one, else one prepared now.
    pub fn take(&self) -> Result<Worker, CgroupError> {
        let ready = self
            .inner
            .ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let warm = ready.is_some();
        let prepared = match ready {
            Some(p) => {
                self.inner.warm_takes.fetch_add(1, Ordering::Relaxed);
                p
            }
            None => {
                self.inner.cold_takes.fetch_add(1, Ordering::Relaxed);
                self.inner.prepare()?
            }
        };
        self.inner.send(Job::Refill);
        Ok(Worker {
            prepared: Some(prepared),
            inner: self.inner.clone(),
            warm,
        })
    }

    pub fn stats(&self) -> WarmStats {
        WarmStats {
            target: self.inner.target,
            ready: self.inner.ready_len(),
            warm_takes: self.inner.warm_takes.load(Ordering::Relaxed),
            cold_takes: self.inner.cold_takes.load(Ordering::Relaxed),
            discarded: self.inner.discarded.load(Ordering::Relaxed),
        }
    }

    /// Tears down every ready worker and every worker returned before this call; workers
    /// returned later are torn down as they come back. Blocks until done.
    pub fn shutdown(&self) {
        let (tx, rx) = mpsc::channel();
        self.inner.send(Job::Close(tx));
        let _ = rx.recv_timeout(Duration::from_secs(30));
    }
}

/// A short name unique to one data directory.
fn tag_for(data_dir: &Path) -> String {
    let abs = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325; // FNV-1a: stable across runs and builds
    for b in abs.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("p{:08x}", h as u32)
}

/// Removes the groups and bundle directories a previous run of this daemon left.
fn remove_leftovers(tag: &str, bundles: &Path) {
    let prefix = format!("{tag}-w");
    let names: Vec<String> = std::fs::read_dir(
        PathBuf::from(cgroup::CGROUP_ROOT)
            .join("memory")
            .join(cgroup::PARENT),
    )
    .map(|rd| {
        rd.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&prefix))
            .collect()
    })
    .unwrap_or_default();
    for name in names {
        let _ = cgroup::reset_group(&name, RESET_TIMEOUT);
        cgroup::remove_all(&name);
    }
    let _ = std::fs::remove_dir_all(bundles);
    net::remove_leftovers(&prefix);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_stable_and_distinct() {
        let a = tag_for(Path::new("/nonexistent/a"));
        assert_eq!(a, tag_for(Path::new("/nonexistent/a")));
        assert_ne!(a, tag_for(Path::new("/nonexistent/b")));
        assert_eq!(a.len(), 9);
    }
}
