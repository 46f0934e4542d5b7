//! One pool's controller: an actor that alone owns the pool's agents. Each tick it reads every
//! trigger's depth, applies the scaling rule, creates, wakes or drains agents, and publishes
//! the pool's status; helper tasks report back over a bounded channel. Push watchers poke it
//! when a broker shows new work.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Notify};
use torpor_core::{now_millis, SandboxId, SandboxState, TenantId, Tier};
use torpor_triggers::consume;
use torpor_triggers::rule::{decide, RuleState};
use torpor_triggers::{DepthReader, TriggerError, TriggerSpec};

use super::lane::LaneWorker;
use super::registry::{pool_agents, PoolHandle};
use super::spec::PoolSpec;
use super::status::{err_status, TriggerErrorStatus, TriggerStatus};
use super::{DRAIN_FILE, POOL_METADATA_KEY};
use crate::engine::{CreateSandbox, Engine};

struct Lane {
    drain: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// What the controller's helper tasks report back.
enum Event {
    Started(SandboxId),
    StartFailed(Option<SandboxId>, String),
    /// A wake that could not be made yet and is tried again at the next tick (an agent passed
    /// here whose worker has not joined this controller yet): no error.
    StartDeferred(SandboxId),
    Stopped(SandboxId, Option<String>),
}

pub(super) struct Controller {
    engine: Arc<Engine>,
    pool: Arc<PoolHandle>,
    stop: watch::Receiver<bool>,
    readers: Vec<DepthReader>,
    rule: RuleState,
    /// Active agents (awake, with a lane in dispatch mode).
    active: BTreeMap<SandboxId, Lane>,
    /// Being created (counted by number) or woken (by id).
    starting: usize,
    waking: BTreeSet<SandboxId>,
    draining: BTreeSet<SandboxId>,
    events_tx: mpsc::Sender<Event>,
    events_rx: mpsc::Receiver<Event>,
    last_error: Option<String>,
    /// Whether this controller scaled the pool at its last tick (cluster mode: it held the
    /// pool's lease; always in embedded mode).
    scaling: bool,
    /// A redis-list dispatch pool's processing list is to be moved back to the queue before
    /// this controller's lanes take work (set whenever it starts scaling the pool).
    recover: bool,
}

impl Controller {
    pub(super) fn new(
        engine: Arc<Engine>,
        pool: Arc<PoolHandle>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::channel(256);
        Controller {
            readers: pool
                .spec
                .triggers
                .iter()
                .cloned()
                .map(DepthReader::new)
                .collect(),
            engine,
            pool,
            stop,
            rule: RuleState::default(),
            active: BTreeMap::new(),
            starting: 0,
            waking: BTreeSet::new(),
            draining: BTreeSet::new(),
            events_tx,
            events_rx,
            last_error: None,
            scaling: false,
            recover: false,
        }
    }

    fn spec(&self) -> &PoolSpec {
        &self.pool.spec
    }

    pub(super) async fn run(mut self) {
        let name = self.spec().name.clone();
        tracing::info!("pool controller started");
        let watchers = if self.spec().push {
            self.spec()
                .triggers
                .iter()
                .cloned()
                .map(|t| tokio::spawn(watch_for_work(t, self.pool.poke.clone(), self.stop.clone())))
                .collect()
        } else {
            Vec::new()
        };
        let interval = Duration::from_millis(self.spec().poll_interval_ms);
        loop {
            if *self.stop.borrow() {
                break;
            }
            self.tick().await;
            let poke = self.pool.poke.clone();
            let mut stop = self.stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = poke.notified() => {}
                _ = stop.changed() => {}
                Some(ev) = self.events_rx.recv() => self.on_event(ev),
            }
            while let Ok(ev) = self.events_rx.try_recv() {
                self.on_event(ev);
            }
        }
        for w in watchers {
            w.abort();
        }
        self.stop_all().await;
        tracing::info!(pool = %name, "pool controller stopped");
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Started(id) => {
                // A woken agent was counted in `waking`, a created one in `starting`.
                if !self.waking.remove(&id) {
                    self.starting = self.starting.saturating_sub(1);
                }
                // One lane per agent. An agent whose creation is not reported yet is listed
                // like a sleeping one, so a tick in between can also wake it: it is then
                // reported twice. A second lane would read the same consumer's pending
                // messages and hand each to the agent twice (and, replaced in `active`, never
                // be drained).
                if self.active.contains_key(&id) || self.draining.contains(&id) {
                    tracing::debug!(pool = %self.spec().name, sandbox = %id, "agent reported started twice");
                    return;
                }
                // Started after the pool passed to another controller: passed on as it runs (or
                // put back to sleep) for the pool's holder (it cannot drive a sandbox this
                // controller holds).
                if !self.scaling {
                    let lane = Lane {
                        drain: Arc::new(AtomicBool::new(true)),
                        busy: Arc::new(AtomicBool::new(false)),
                        task: None,
                    };
                    let to = self.successor();
                    self.drain(id, lane, to);
                    return;
                }
                let lane = self.start_lane(&id);
                self.active.insert(id, lane);
            }
            Event::StartDeferred(id) => {
                self.waking.remove(&id);
            }
            Event::StartFailed(id, e) => {
                match id {
                    Some(id) => {
                        self.waking.remove(&id);
                    }
                    None => self.starting = self.starting.saturating_sub(1),
                }
                tracing::warn!(pool = %self.spec().name, error = %e, "cannot start an agent");
                self.last_error = Some(e);
            }
            Event::Stopped(id, err) => {
                self.draining.remove(&id);
                if let Some(e) = err {
                    tracing::warn!(pool = %self.spec().name, sandbox = %id, error = %e, "cannot suspend an agent");
                    self.last_error = Some(e);
                }
            }
        }
    }

    /// One reading and one decision.
    async fn tick(&mut self) {
        // Cluster mode: one controller scales each pool (the pool's lease, spread over the
        // controllers); the others read the triggers too, so every controller answers the
        // pool's status and KEDA's demand, and the next holder starts from a current reading.
        let (tenant, name) = (self.pool.tenant.clone(), self.spec().name.clone());
        if !self.engine.runs_pool(&tenant, name.as_str()) {
            self.engine.take_free_pool(&tenant, name.as_str());
        }
        let scaling = self.engine.runs_pool(&tenant, name.as_str());
        if scaling && !self.scaling {
            if self.engine.controller_name().is_some() {
                tracing::info!(pool = %name, "this controller scales the pool");
            }
            self.recover = self.spec().dispatch.is_some();
        }
        self.scaling = scaling;
        // The processing list holds the messages of lanes still draining here (the pool came
        // back before they stopped): recovered once they have.
        if scaling && self.recover && self.draining.is_empty() {
            self.recover_processing().await;
        }
        let generic = self.pool.tenant_owned();
        let readings = futures::future::join_all(self.readers.iter_mut().map(|r| async move {
            let started = Instant::now();
            let r = r.read().await;
            // A refused port fails at once, a filtered one after the timeout: for a tenant's
            // pool every unreachable broker fails after the same time, so the failures'
            // pace is no oracle either.
            if generic && matches!(&r, Err(e) if e.is_unreachable()) {
                tokio::time::sleep_until((started + torpor_triggers::depth::READ_TIMEOUT).into())
                    .await;
            }
            r
        }))
        .await;
        let in_flight = self.pool.counters.in_flight.load(Ordering::Relaxed);
        let dispatch = self.spec().dispatch.is_some();
        let mut depths = Vec::with_capacity(readings.len());
        let mut trig = Vec::with_capacity(readings.len());
        for (i, r) in readings.iter().enumerate() {
            let spec = &self.spec().triggers[i];
            let depth = match r {
                Ok(d) if dispatch && i == 0 && !spec.depth_counts_in_flight() => {
                    Some(d + in_flight)
                }
                // The broker's count may lag (RabbitMQ's management statistics): never below
                // what torpor itself holds.
                Ok(d) if dispatch && i == 0 => Some((*d).max(in_flight)),
                Ok(d) => Some(*d),
                Err(_) => None,
            };
            depths.push(depth);
            trig.push((
                spec.kind(),
                depth,
                r.as_ref().err().map(|e| err_status(e, generic)),
            ));
        }
        let current = (self.active.len() + self.starting + self.waking.len()) as u32;
        let d = decide(
            &self.spec().policy(),
            &depths,
            current,
            now_millis().max(0) as u64,
            &mut self.rule,
        );
        if readings.iter().any(Result::is_err) {
            for (i, r) in readings.iter().enumerate() {
                if let Err(e) = r {
                    tracing::warn!(pool = %self.spec().name, trigger = i, code = e.code(), error = %e, "trigger reading failed");
                }
            }
        }
        if !self.scaling {
            self.let_go();
        } else if !self.recover {
            self.scale_to(d.desired).await;
        }
        self.publish(d, trig).await;
    }

    /// Moves what a redis-list dispatch pool left mid-processing (a crashed torpor, a dead
    /// controller that scaled it) back to the queue, before this controller's lanes take
    /// work; tried again at the next tick while the broker cannot be reached. Only the
    /// controller that scales the pool does it: another's lanes may be processing those.
    async fn recover_processing(&mut self) {
        let name = &self.pool.spec.name;
        match consume::recover_redis_list(&self.pool.spec.triggers[0]).await {
            Ok(n) => {
                if n > 0 {
                    tracing::warn!(pool = %name, messages = n, "requeued unfinished messages");
                }
                self.recover = false;
            }
            Err(e) => {
                tracing::warn!(pool = %name, error = %e, "cannot recover the processing list yet")
            }
        }
    }

    /// The pool passed to another controller (handed over, or its lease lost): only the
    /// controller that holds a sandbox drives it, so this one's agents go to the pool's next
    /// holder as they run (lanes finish their messages first; [`Engine::pass_hold`]). With
    /// no live successor known, or a pass refused, they drain as in a scale-in and sleep, and
    /// the new holder wakes them. Once nothing of the pool is in motion here a lease being
    /// handed over passes on.
    fn let_go(&mut self) {
        let to = self.successor();
        for (id, lane) in std::mem::take(&mut self.active) {
            self.drain(id, lane, to.clone());
        }
        if self.starting == 0 && self.waking.is_empty() && self.draining.is_empty() {
            self.engine
                .let_go_of_pool(&self.pool.tenant, self.spec().name.as_str());
        }
    }

    async fn publish(
        &self,
        d: torpor_triggers::Decision,
        trig: Vec<(&'static str, Option<u64>, Option<TriggerErrorStatus>)>,
    ) {
        let agents = pool_agents(&self.engine, &self.pool.tenant, self.spec().name.as_str());
        // A controller that does not scale the pool (cluster mode) counts what the store says.
        let scales_here = self
            .engine
            .runs_pool(&self.pool.tenant, self.spec().name.as_str());
        let running = if scales_here {
            self.active.len()
        } else {
            agents
                .iter()
                .filter(|s| matches!(s.state, SandboxState::Running | SandboxState::Frozen))
                .count()
        };
        let sandboxes = agents.into_iter().map(|s| s.id).collect();
        let c = &self.pool.counters;
        let mut s = self.pool.status.lock().unwrap_or_else(|p| p.into_inner());
        s.desired = d.desired;
        s.running = running as u32;
        s.starting = (self.starting + self.waking.len()) as u32;
        s.draining = self.draining.len() as u32;
        s.depth = d.depth;
        s.active = d.active;
        s.fallback = d.fallback;
        s.in_flight = c.in_flight.load(Ordering::Relaxed);
        s.processed = c.processed.load(Ordering::Relaxed);
        s.failed_attempts = c.failed_attempts.load(Ordering::Relaxed);
        s.dead_lettered = c.dead_lettered.load(Ordering::Relaxed);
        s.sandboxes = sandboxes;
        s.triggers = trig
            .into_iter()
            .enumerate()
            .map(|(i, (kind, depth, error))| TriggerStatus {
                kind: kind.into(),
                depth,
                error,
                consecutive_errors: self.rule.consecutive_errors.get(i).copied().unwrap_or(0),
            })
            .collect();
        s.last_error = self.last_error.clone();
        s.controller = self
            .engine
            .pool_holder(&self.pool.tenant, self.spec().name.as_str());
    }

    /// Pool agents no lane serves, oldest first: asleep, or running without a lane (after a
    /// restart; or just created, its start not reported yet: see `on_event`).
    fn sleeping_agents(&self) -> Vec<SandboxId> {
        let mut v: Vec<_> = pool_agents(&self.engine, &self.pool.tenant, self.spec().name.as_str())
            .into_iter()
            .filter(|s| {
                !self.active.contains_key(&s.id)
                    && !self.waking.contains(&s.id)
                    && !self.draining.contains(&s.id)
            })
            .filter(|s| !matches!(s.state, SandboxState::Creating | SandboxState::Deleting))
            .map(|s| (s.created_at, s.id))
            .collect();
        v.sort();
        v.into_iter().map(|(_, id)| id).collect()
    }

    async fn scale_to(&mut self, desired: u32) {
        let desired = desired as usize;
        let self_consume = self.spec().dispatch.is_none();
        let current = self.active.len() + self.starting + self.waking.len();
        if desired > current {
            let mut need = desired - current;
            let sleeping = self.sleeping_agents();
            let unused = sleeping.len().saturating_sub(need);
            for id in sleeping.into_iter().take(need) {
                need -= 1;
                self.waking.insert(id.clone());
                let engine = self.engine.clone();
                let tenant = self.pool.tenant.clone();
                let tx = self.events_tx.clone();
                tokio::spawn(async move {
                    let ev = match engine.resume(&tenant, &id).await {
                        Ok(_) => {
                            if self_consume {
                                clear_drain_notice(&engine, &tenant, &id).await;
                            }
                            Event::Started(id)
                        }
                        Err(crate::ControlError::Busy(why)) => {
                            tracing::debug!(sandbox = %id, why, "an agent's wake waits");
                            Event::StartDeferred(id)
                        }
                        Err(e) => Event::StartFailed(Some(id), format!("wake: {e}")),
                    };
                    let _ = tx.send(ev).await;
                });
            }
            // Never more agents than max, counting those still draining and those asleep:
            // a draining agent is woken again once it sleeps, instead of a new one made now.
            let owned = self.active.len()
                + self.starting
                + self.waking.len()
                + self.draining.len()
                + unused;
            let room = (self.spec().max as usize).saturating_sub(owned);
            for _ in 0..need.min(room) {
                self.starting += 1;
                let engine = self.engine.clone();
                let tenant = self.pool.tenant.clone();
                let tx = self.events_tx.clone();
                let req = CreateSandbox {
                    template: self.spec().template.clone(),
                    env: Default::default(),
                    metadata: BTreeMap::from([(
                        POOL_METADATA_KEY.to_string(),
                        self.spec().name.to_string(),
                    )]),
                    limits: Default::default(),
                    gpu: None,
                    layer_metadata: Default::default(),
                    network: None,
                };
                tokio::spawn(async move {
                    let ev = match engine.create_sandbox(&tenant, req).await {
                        Ok(rec) => {
                            if self_consume {
                                clear_drain_notice(&engine, &tenant, &rec.id).await;
                            }
                            Event::Started(rec.id)
                        }
                        Err(e) => Event::StartFailed(None, format!("create: {e}")),
                    };
                    let _ = tx.send(ev).await;
                });
            }
        } else if desired < self.active.len() {
            // Idle agents first; a busy one finishes its message before it sleeps.
            let excess = self.active.len() - desired;
            let mut ids: Vec<_> = self
                .active
                .iter()
                .map(|(id, l)| (l.busy.load(Ordering::Relaxed), id.clone()))
                .collect();
            ids.sort();
            for (_, id) in ids.into_iter().take(excess) {
                if let Some(lane) = self.active.remove(&id) {
                    self.drain(id, lane, None);
                }
            }
        }
    }

    fn start_lane(&mut self, id: &SandboxId) -> Lane {
        let drain = Arc::new(AtomicBool::new(false));
        let busy = Arc::new(AtomicBool::new(false));
        let task = self.spec().dispatch.clone().map(|d| {
            let lane = LaneWorker {
                engine: self.engine.clone(),
                tenant: self.pool.tenant.clone(),
                sandbox: id.clone(),
                trigger: self.spec().triggers[0].clone(),
                dispatch: d,
                dead_letter: self.spec().dead_letter(),
                consumer_name: format!("torpor-{}-{}", self.spec().name, id),
                pool_name: self.spec().name.clone(),
                drain: drain.clone(),
                busy: busy.clone(),
                counters: self.pool.counters.clone(),
                poke: self.pool.poke.clone(),
            };
            tokio::spawn(lane.run())
        });
        Lane { drain, busy, task }
    }

    /// The controller this pool passes to, if it no longer scales here.
    fn successor(&self) -> Option<String> {
        self.engine
            .pool_successor(&self.pool.tenant, self.spec().name.as_str())
    }

    /// Takes an agent out of service: its lane finishes its message (dispatch), then
    /// - with `to` (the pool passes to that controller): the agent's hold goes there as it
    ///   runs, nothing stopped (a self-consuming agent just keeps consuming: no drain notice);
    /// - otherwise (a scale-in; no live successor known; a pass refused): a self-consuming
    ///   agent gets the drain notice and its grace, and the agent sleeps (suspended).
    fn drain(&mut self, id: SandboxId, mut lane: Lane, to: Option<String>) {
        match &to {
            Some(to) => {
                tracing::info!(pool = %self.spec().name, sandbox = %id, to = %to, "passing a running agent on with its pool")
            }
            None if !self.scaling => {
                tracing::info!(pool = %self.spec().name, sandbox = %id, "draining an agent: the pool passes to another controller")
            }
            None => {}
        }
        self.draining.insert(id.clone());
        lane.drain.store(true, Ordering::Relaxed);
        let engine = self.engine.clone();
        let tenant = self.pool.tenant.clone();
        let tx = self.events_tx.clone();
        let grace = Duration::from_secs(self.spec().drain_grace_s);
        let self_consume = self.spec().dispatch.is_none();
        tokio::spawn(async move {
            if let Some(task) = lane.task.take() {
                let _ = task.await;
            }
            if let Some(to) = to {
                match engine.pass_hold(&tenant, &id, &to).await {
                    Ok(()) => {
                        let _ = tx.send(Event::Stopped(id, None)).await;
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, to = %to, error = %e, "cannot pass an agent on; putting it to sleep for the pool's next holder")
                    }
                }
            }
            if self_consume {
                if let Err(e) = engine
                    .write_file(&tenant, &id, DRAIN_FILE, None, b"drain\n")
                    .await
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot write the drain notice");
                }
                tokio::time::sleep(grace).await;
            }
            let err = engine
                .suspend(&tenant, &id, Tier::Suspended)
                .await
                .err()
                .map(|e| format!("suspend: {e}"));
            let _ = tx.send(Event::Stopped(id, err)).await;
        });
    }

    /// Shutdown or delete: every lane finishes its message; agents are left as they are (the
    /// engine checkpoints resident sandboxes on shutdown).
    async fn stop_all(&mut self) {
        for lane in self.active.values() {
            lane.drain.store(true, Ordering::Relaxed);
        }
        for (_, mut lane) in std::mem::take(&mut self.active) {
            if let Some(t) = lane.task.take() {
                let _ = t.await;
            }
        }
    }
}

/// A self-consuming agent takes work while [`DRAIN_FILE`] is absent: clear the notice its last
/// scale-in left (or its template's golden snapshot holds) before it counts as active.
async fn clear_drain_notice(engine: &Engine, tenant: &TenantId, id: &SandboxId) {
    if let Err(e) = engine.remove_file(tenant, id, DRAIN_FILE, false).await {
        let text = e.to_string();
        if !text.contains("not found") && !text.contains("No such file") {
            tracing::warn!(sandbox = %id, error = %text, "cannot clear the drain notice");
        }
    }
}

// ------------------------------------------------------------------------------- push

/// Pokes the controller when the broker shows new work, without taking it: a Redis
/// `BLMOVE key key RIGHT RIGHT` (a blocking no-op rotation), a Redis stream `XREAD BLOCK`, a
/// NATS subscription on the stream's subjects. RabbitMQ and Kafka have no such watch: their
/// pools poll.
async fn watch_for_work(spec: TriggerSpec, poke: Arc<Notify>, stop: watch::Receiver<bool>) {
    let mut watcher = torpor_triggers::depth::Watcher::new(spec);
    loop {
        if *stop.borrow() {
            return;
        }
        match watcher.wait(Duration::from_secs(2)).await {
            Ok(true) => {
                poke.notify_one();
                // While work stays queued the watch answers at once; lanes take it from here,
                // and the controller's polling covers the rest.
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(false) => {}
            Err(TriggerError::Unsupported { .. }) => return,
            Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}
