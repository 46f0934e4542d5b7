//! The warm pool: workers whose host-side pieces are made before a wake needs them, so that a
//! wake does only the restore.
//!
//! A worker is a cgroup in every v1 hierarchy (with the OOM notification already armed) and a
//! bundle directory. runsc uses groups it finds as they are, so a wake on a warm worker writes
//! the sandbox's limits (three small files) and starts `runsc restore`; runsc makes, configures
//! and removes nothing. When a sandbox leaves its worker (parked, suspended, deleted, crashed),
//! the [`Worker`] handle is dropped and a background thread resets the group (thaw, kill
//! leftovers, drop the memory still charged to it) and puts it back in the pool, or tears it
//! down when the pool is full. A wake that finds no ready worker prepares one inline (a "cold"
//! take, counted).
//!
//! A worker may also carry a network (namespaces, links, rules, egress relay: crate::net),
//! made once and kept with the worker from then on. A networked sandbox that gets a worker
//! without one pays for it inline (about 0.1–0.5 s of `ip` and `nft` processes): the take is
//! counted cold too, so `cold_takes` (`GET /v1/workers`) and
//! `torpor_warm_pool_takes_total{kind="cold"}` count every take that prepared, inline, the
//! worker or its network because none ready had it.
//!
//! # Sizing (crate::warm::sizing)
//!
//! The pool keeps a stock of ready workers, and among them a stock of ready networks, sized
//! from demand rather than fixed:
//!
//! - **Demand.** Every take is recorded with its time, and so is every networked take (the
//!   sandbox asked for its worker's network). The take rate is the highest of the rates over
//!   the last 2 s, 10 s and 60 s: a burst raises it within two seconds, a steady rate holds it.
//! - **Lead time.** The time to prepare one network is measured (a moving average of every
//!   preparation, in the background or inline). The stock must cover the takes expected while
//!   a replacement is prepared: lead = 2 × that time, at least 1 s.
//! - **Targets.** ready = rate × lead + 1, bounded below by the floor (`--warm-pool`, kept even
//!   at rest) and above by the ceiling (the larger of the floor and 16, and a ceiling above the
//!   floor never more than 128: half of one daemon's 256 uplink subnets, the other half left
//!   to the workers that hold sandboxes). networks = networked rate × lead + 1, at least one
//!   once a networked sandbox has run, at most the ready target. A floor of 0 keeps the pool
//!   off (every worker prepared at wake time).
//! - **Refill, bounded by the cores.** A few preparer threads (the cores, 1 to 4) each claim
//!   one unit of work at a time: give a ready worker without a network one (while ready
//!   networks + those being made < network target), else make a worker (while ready + being
//!   made < ready target). Preparations are short processes that compete with wakes for the
//!   CPU, so they are never more than the cores, and only as many run as there are missing
//!   workers. Resets of returned workers run on the pool's own thread, never behind a
//!   preparation.
//! - **Who gets what.** A take gets a ready worker without a network when there is one, so
//!   that plain sandboxes leave the networks to networked ones; a networked sandbox whose
//!   worker has none swaps it, before anything ran on it, for a ready one that has.
//! - **Shrinking.** A returned worker is kept while the pool is under its target (a full pool
//!   keeps it if it has a network and gives up one without). As the rate windows empty, the
//!   target falls back to the floor a minute after the last take; after 30 s without a take
//!   the pool gives back one ready worker above its target per second, those without a
//!   network first, so the networks made stay with the workers kept.
//!
//! `TORPOR_WARM_POOL_FIXED=1` in the daemon's environment selects the behaviour before sizing
//! (a benchmark's baseline): `--warm-pool` ready workers, all of them networked once a
//! networked sandbox has run, one preparation at a time, takes from the top of the stack.
//!
//! Group names are `<tag>-w<n>`, `tag` being unique to one daemon (its data directory), so
//! several daemons on one host never share a group and a restarted daemon finds its own
//! leftovers by prefix ([`WarmPool::start`] removes them).

mod sizing;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cgroup::{self, CgroupError};
use crate::net::{self, NetAlloc, NetError, WorkerNet};

use sizing::Sizer;
pub use sizing::{SizingConfig, Targets};

/// How long a reset waits for a left-over process to die before it gives the group up.
const RESET_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the pool re-reads its targets without a job (shrinking, retries).
const TICK: Duration = Duration::from_secs(1);
/// The longest a preparer waits after failures before it tries again.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// The environment variable that selects the fixed-size pool (a benchmark's baseline).
pub const FIXED_ENV: &str = "TORPOR_WARM_POOL_FIXED";

/// Counters shown by `GET /v1/workers`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmStats {
    /// Ready workers the pool aims for now (the floor, `--warm-pool`, at rest; more while
    /// sandboxes are taken faster than they can be prepared).
    pub target: usize,
    /// Ready workers now.
    pub ready: usize,
    /// Workers handed out with everything the sandbox needed already made, since start.
    pub warm_takes: u64,
    /// Takes that prepared inline, because none ready had it, the worker or (for a
    /// networked sandbox) its network.
    pub cold_takes: u64,
    /// Workers given up because a reset failed (processes that would not die).
    pub discarded: u64,
}

/// The sizing's view, for logs, tests and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizingStats {
    pub config: SizingConfig,
    pub targets: Targets,
    pub ready: usize,
    /// Ready workers that have a network.
    pub ready_net: usize,
    /// Workers being made and networks being made now.
    pub making: usize,
    pub networking: usize,
    /// Networks made inline for a networked sandbox / made ahead by the pool, since start.
    pub net_inline: u64,
    pub net_ahead: u64,
    pub take_rate: f64,
    pub net_take_rate: f64,
    pub net_prep_ms: f64,
    pub preparers: usize,
}

/// One prepared worker, owned by the pool or by a [`Worker`] handle.
struct Prepared {
    name: String,
    bundle: PathBuf,
    /// The OOM flag of the sandbox now on this worker; the group's watch thread sets it.
    occupant: Arc<Mutex<Arc<AtomicBool>>>,
    /// The worker's network namespaces, made the first time a networked sandbox runs here
    /// (or ahead by the pool) and kept with the worker from then on.
    net: Option<WorkerNet>,
}

enum Job {
    Reset(Prepared),
    /// Tear down every ready worker, and from now on every returned one; then acknowledge.
    Close(mpsc::Sender<()>),
}

/// What the pool holds, under one lock.
struct State {
    ready: Vec<Prepared>,
    /// Workers a preparer is making now.
    making: usize,
    /// Ready workers a preparer took out to give a network.
    networking: usize,
    sizer: Sizer,
}

/// One unit of a preparer's work.
enum Work {
    Make,
    Network(Box<Prepared>),
}

struct Inner {
    tag: String,
    net_alloc: Arc<NetAlloc>,
    bundles: PathBuf,
    next: AtomicUsize,
    state: Mutex<State>,
    /// Signalled when there may be work for a preparer, or a preparation finished.
    work: Condvar,
    jobs: Mutex<mpsc::Sender<Job>>,
    warm_takes: AtomicU64,
    cold_takes: AtomicU64,
    net_inline: AtomicU64,
    net_ahead: AtomicU64,
    discarded: AtomicU64,
    closed: AtomicBool,
    preparers: usize,
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
    /// Its group, bundle or name has been handed out: it can no longer be swapped.
    pinned: AtomicBool,
}

impl Worker {
    /// The cgroup name (under `torpor/`) the sandbox runs in.
    pub fn cgroup(&self) -> &str {
        &self.pinned_prepared().name
    }

    pub fn bundle(&self) -> &Path {
        &self.pinned_prepared().bundle
    }

    /// The worker's name (its cgroup's last component), unique within this daemon's run.
    pub fn name(&self) -> &str {
        &self.pinned_prepared().name
    }

    /// Whether everything the sandbox needed came ready from the pool (else the worker, or
    /// its network, was prepared for this wake).
    pub fn was_warm(&self) -> bool {
        self.warm
    }

    /// A fresh OOM flag for the sandbox about to run here; the group's watch sets it.
    pub fn oom_flag(&self) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        *self
            .pinned_prepared()
            .occupant
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = flag.clone();
        flag
    }

    fn pinned_prepared(&self) -> &Prepared {
        self.pinned.store(true, Ordering::Relaxed);
        self.prepared.as_ref().expect("present until drop")
    }

    /// The worker's network: this worker's own if it has one; else, when nothing has used
    /// the worker yet, a ready worker that has one is swapped in; else one is made now
    /// (counted as an inline preparation).
    pub fn ensure_net(&mut self) -> Result<&WorkerNet, NetError> {
        let inner = self.inner.clone();
        let has_net = self.prepared.as_ref().is_some_and(|p| p.net.is_some());
        let swap = {
            let mut st = inner.lock();
            st.sizer.record_net_take(Instant::now());
            let adaptive = st.sizer.config().adaptive;
            if !has_net && adaptive && !self.pinned.load(Ordering::Relaxed) {
                st.ready
                    .iter()
                    .rposition(|q| q.net.is_some())
                    .map(|i| st.ready.remove(i))
            } else {
                None
            }
        };
        if let Some(q) = swap {
            if let Some(bare) = self.prepared.replace(q) {
                inner.lock().ready.push(bare);
            }
        }
        // The networked rate just rose: the preparers re-read their targets.
        inner.work.notify_all();
        let p = self.prepared.as_mut().expect("present until drop");
        if p.net.is_none() {
            let t = Instant::now();
            let made = inner.prepare_net(&p.name)?;
            inner.lock().sizer.record_net_prep(t.elapsed());
            p.net = Some(made);
            inner.net_inline.fetch_add(1, Ordering::Relaxed);
            if self.warm {
                self.warm = false;
                inner.warm_takes.fetch_sub(1, Ordering::Relaxed);
                inner.cold_takes.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(p.net.as_ref().expect("just made"))
    }

    /// The worker's network, if it has one.
    pub fn net(&self) -> Option<&WorkerNet> {
        self.prepared.as_ref()?.net.as_ref()
    }

    /// Takes back the network a previous run made for this (adopted) worker: see
    /// [`WorkerNet::adopt`].
    pub fn adopt_net(
        &mut self,
        host_link: &str,
        host_addr: std::net::Ipv4Addr,
        router_addr: std::net::Ipv4Addr,
    ) -> Result<&WorkerNet, NetError> {
        let rt = self.inner.relay_runtime()?;
        let p = self.prepared.as_mut().expect("present until drop");
        let net = WorkerNet::adopt(
            &p.name,
            host_link,
            host_addr,
            router_addr,
            &self.inner.net_alloc,
            &rt,
        )?;
        Ok(p.net.insert(net))
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
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

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
        Ok(Prepared {
            occupant: watch_occupant(&name),
            name,
            bundle,
            net: None,
        })
    }

    /// The runtime egress relays run on: the daemon's.
    fn relay_runtime(&self) -> Result<tokio::runtime::Handle, NetError> {
        self.rt
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
            .ok_or_else(|| NetError {
                command: "egress relay".into(),
                stderr: "no tokio runtime to run the relay on".into(),
            })
    }

    fn prepare_net(&self, name: &str) -> Result<WorkerNet, NetError> {
        WorkerNet::prepare(name, &self.net_alloc, &self.relay_runtime()?)
    }

    /// The next unit of work the targets call for, claimed (counted as in progress).
    fn claim(&self, st: &mut State, now: Instant) -> Option<Work> {
        let t = st.sizer.targets(now);
        let ready_net = st.ready.iter().filter(|p| p.net.is_some()).count();
        if ready_net + st.networking < t.net {
            // The oldest ready worker without a network (takes prefer the newest).
            if let Some(i) = st.ready.iter().position(|p| p.net.is_none()) {
                st.networking += 1;
                return Some(Work::Network(Box::new(st.ready.remove(i))));
            }
        }
        if st.ready.len() + st.making + st.networking < t.ready {
            st.making += 1;
            return Some(Work::Make);
        }
        None
    }

    /// A preparer thread: claims work while the targets call for it, waits otherwise.
    fn prepare_loop(self: Arc<Self>) {
        let mut failures: u32 = 0;
        loop {
            let work = {
                let mut st = self.lock();
                loop {
                    if self.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Some(w) = self.claim(&mut st, Instant::now()) {
                        break w;
                    }
                    st = self
                        .work
                        .wait_timeout(st, TICK)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            };
            let ok = match work {
                Work::Make => {
                    let made = self.prepare();
                    let ok = made.is_ok();
                    match made {
                        Ok(p) if self.closed.load(Ordering::SeqCst) => teardown(p),
                        Ok(p) => self.lock().ready.push(p),
                        Err(e) => tracing::warn!(error = %e, "cannot prepare a warm worker"),
                    }
                    self.lock().making -= 1;
                    ok
                }
                Work::Network(p) => {
                    let mut p = *p;
                    let t = Instant::now();
                    let made = self.prepare_net(&p.name);
                    let took = t.elapsed();
                    let ok = made.is_ok();
                    match made {
                        Ok(n) => {
                            p.net = Some(n);
                            self.net_ahead.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            tracing::warn!(worker = %p.name, error = %e, "cannot prepare a worker's network")
                        }
                    }
                    if self.closed.load(Ordering::SeqCst) {
                        teardown(p);
                        self.lock().networking -= 1;
                    } else {
                        let mut st = self.lock();
                        if ok {
                            st.sizer.record_net_prep(took);
                        }
                        st.networking -= 1;
                        st.ready.push(p);
                    }
                    ok
                }
            };
            self.work.notify_all();
            if ok {
                failures = 0;
            } else {
                // Back off (1 s, 2 s, ... 60 s) rather than retry a failing preparation in a loop.
                failures = failures.saturating_add(1);
                std::thread::sleep(
                    TICK.saturating_mul(1u32 << failures.min(6).saturating_sub(1))
                        .min(MAX_BACKOFF),
                );
            }
        }
    }

    /// A returned worker: reset, then kept or torn down.
    fn give_back(&self, mut p: Prepared) {
        if self.closed.load(Ordering::SeqCst) {
            return teardown(p);
        }
        if let Err(e) = cgroup::reset_group(&p.name, RESET_TIMEOUT) {
            tracing::warn!(worker = %p.name, error = %e, "cannot reset a worker; discarding it");
            self.discarded.fetch_add(1, Ordering::Relaxed);
            return teardown(p);
        }
        if p.net.as_ref().is_some_and(|n| n.reset().is_err()) {
            // A network that cannot be reset is made afresh on next use.
            if let Some(n) = p.net.take() {
                n.teardown();
            }
        }
        let now = Instant::now();
        let mut st = self.lock();
        if st.ready.len() < st.sizer.targets(now).ready {
            st.ready.push(p);
        } else {
            // Full: keep the worker whose network is made, give up one without.
            let bare = if p.net.is_some() {
                st.ready
                    .iter()
                    .position(|r| r.net.is_none())
                    .map(|i| st.ready.remove(i))
            } else {
                None
            };
            let gone = match bare {
                Some(b) => {
                    // At the bottom: taken after the workers already waiting.
                    st.ready.insert(0, p);
                    b
                }
                None => p,
            };
            drop(st);
            teardown(gone);
        }
        self.work.notify_all();
    }

    /// After a while without takes, gives back one worker above the target (one without a
    /// network first).
    fn shrink(&self) {
        let now = Instant::now();
        let gone = {
            let mut st = self.lock();
            let t = st.sizer.targets(now);
            if !st.sizer.may_shrink(now) || st.ready.len() <= t.ready {
                None
            } else {
                let i = st.ready.iter().position(|p| p.net.is_none()).unwrap_or(0);
                Some(st.ready.remove(i))
            }
        };
        if let Some(p) = gone {
            teardown(p);
        }
        // The targets move with time: the preparers re-read them.
        self.work.notify_all();
    }

    /// The pool thread: resets returned workers, shrinks the stock after idle.
    fn run(self: Arc<Self>, jobs: mpsc::Receiver<Job>) {
        loop {
            match jobs.recv_timeout(TICK) {
                Ok(Job::Reset(p)) => self.give_back(p),
                Ok(Job::Close(ack)) => {
                    self.close();
                    let _ = ack.send(());
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !self.closed.load(Ordering::SeqCst) {
                        self.shrink();
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        self.close();
    }

    /// Stops the preparers, waits (up to 30 s) for the preparations in flight, and tears
    /// down every ready worker.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.work.notify_all();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut st = self.lock();
        while st.making + st.networking > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .work
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let ready: Vec<Prepared> = st.ready.drain(..).collect();
        drop(st);
        for p in ready {
            teardown(p);
        }
    }
}

/// The OOM flag of whatever sandbox occupies group `name`, armed on the group's OOM events.
fn watch_occupant(name: &str) -> Arc<Mutex<Arc<AtomicBool>>> {
    let occupant = Arc::new(Mutex::new(Arc::new(AtomicBool::new(false))));
    let current = occupant.clone();
    cgroup::spawn_oom_watch(name, move || {
        current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .store(true, Ordering::SeqCst);
        true
    });
    occupant
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
    /// previous run left but those in `keep` (workers whose containers outlived that run: live
    /// restore takes them back with [`WarmPool::adopt`]), then prepares `floor` workers in the
    /// background and sizes the stock from demand from then on (fixed at `floor` when
    /// [`FIXED_ENV`] is `1`).
    pub fn start(data_dir: &Path, floor: usize, keep: &[String]) -> WarmPool {
        let cfg = if std::env::var(FIXED_ENV).is_ok_and(|v| v == "1") {
            SizingConfig::fixed(floor)
        } else {
            SizingConfig::adaptive(floor)
        };
        WarmPool::start_sized(data_dir, cfg, keep)
    }

    /// [`WarmPool::start`] with explicit sizing.
    pub fn start_sized(data_dir: &Path, cfg: SizingConfig, keep: &[String]) -> WarmPool {
        let tag = tag_for(data_dir);
        let bundles = data_dir.join("workers");
        remove_leftovers(&tag, &bundles, keep);
        // New names start after the kept ones.
        let next = keep
            .iter()
            .filter_map(|k| k.strip_prefix(&format!("{tag}-w"))?.parse::<usize>().ok())
            .map(|n| n + 1)
            .max()
            .unwrap_or(0);
        let preparers = if cfg.adaptive {
            sizing::preparers(std::thread::available_parallelism().map_or(1, |n| n.get()))
        } else {
            1
        };
        let (tx, rx) = mpsc::channel();
        let inner = Arc::new(Inner {
            net_alloc: NetAlloc::new(&tag),
            tag,
            bundles,
            next: AtomicUsize::new(next),
            state: Mutex::new(State {
                ready: Vec::new(),
                making: 0,
                networking: 0,
                sizer: Sizer::new(cfg),
            }),
            work: Condvar::new(),
            jobs: Mutex::new(tx),
            warm_takes: AtomicU64::new(0),
            cold_takes: AtomicU64::new(0),
            net_inline: AtomicU64::new(0),
            net_ahead: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            preparers,
            rt: tokio::runtime::Handle::try_current().ok(),
        });
        let worker = inner.clone();
        let spawned = std::thread::Builder::new()
            .name("warm-pool".into())
            .spawn(move || worker.run(rx));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the warm pool thread; returned workers are torn down");
        }
        for i in 0..preparers {
            let worker = inner.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("warm-prep-{i}"))
                .spawn(move || worker.prepare_loop());
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a warm pool preparer");
            }
        }
        WarmPool { inner }
    }

    /// A worker for one sandbox: a ready one when there is one (one without a network when
    /// there is such: a networked sandbox swaps it in [`Worker::ensure_net`]), else one
    /// prepared now.
    pub fn take(&self) -> Result<Worker, CgroupError> {
        let ready = {
            let mut st = self.inner.lock();
            st.sizer.record_take(Instant::now());
            let top = st.ready.len().checked_sub(1);
            let i = if st.sizer.config().adaptive {
                st.ready.iter().rposition(|p| p.net.is_none()).or(top)
            } else {
                top
            };
            i.map(|i| st.ready.remove(i))
        };
        self.inner.work.notify_all();
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
        Ok(Worker {
            prepared: Some(prepared),
            inner: self.inner.clone(),
            warm,
            pinned: AtomicBool::new(false),
        })
    }

    /// The handle of a worker kept at [`WarmPool::start`] whose container a restarted daemon
    /// took back; dropping it returns the worker to the pool as usual.
    pub fn adopt(&self, name: &str) -> Worker {
        Worker {
            prepared: Some(Prepared {
                name: name.to_string(),
                bundle: self.inner.bundles.join(name),
                occupant: watch_occupant(name),
                net: None,
            }),
            inner: self.inner.clone(),
            warm: false,
            // Its container runs in it already: never swapped for another.
            pinned: AtomicBool::new(true),
        }
    }

    pub fn stats(&self) -> WarmStats {
        let (target, ready) = {
            let st = self.inner.lock();
            (st.sizer.targets(Instant::now()).ready, st.ready.len())
        };
        WarmStats {
            target,
            ready,
            warm_takes: self.inner.warm_takes.load(Ordering::Relaxed),
            cold_takes: self.inner.cold_takes.load(Ordering::Relaxed),
            discarded: self.inner.discarded.load(Ordering::Relaxed),
        }
    }

    pub fn sizing_stats(&self) -> SizingStats {
        let now = Instant::now();
        let st = self.inner.lock();
        SizingStats {
            config: st.sizer.config(),
            targets: st.sizer.targets(now),
            ready: st.ready.len(),
            ready_net: st.ready.iter().filter(|p| p.net.is_some()).count(),
            making: st.making,
            networking: st.networking,
            net_inline: self.inner.net_inline.load(Ordering::Relaxed),
            net_ahead: self.inner.net_ahead.load(Ordering::Relaxed),
            take_rate: st.sizer.take_rate(now),
            net_take_rate: st.sizer.net_take_rate(now),
            net_prep_ms: st.sizer.net_prep().as_secs_f64() * 1e3,
            preparers: self.inner.preparers,
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

/// Removes the groups and bundle directories a previous run of this daemon left, but `keep`'s.
fn remove_leftovers(tag: &str, bundles: &Path, keep: &[String]) {
    let prefix = format!("{tag}-w");
    let names: Vec<String> = std::fs::read_dir(
        PathBuf::from(cgroup::CGROUP_ROOT)
            .join("memory")
            .join(cgroup::PARENT),
    )
    .map(|rd| {
        rd.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&prefix) && !keep.contains(n))
            .collect()
    })
    .unwrap_or_default();
    for name in names {
        let _ = cgroup::reset_group(&name, RESET_TIMEOUT);
        cgroup::remove_all(&name);
    }
    for e in std::fs::read_dir(bundles).into_iter().flatten().flatten() {
        if !keep.iter().any(|k| e.file_name() == k.as_str()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    net::remove_leftovers(&prefix, keep);
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
