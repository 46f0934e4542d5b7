//! The transitions of one sandbox, each run under its slot's write lock: restore (create and
//! wake), freeze/thaw, park (checkpoint to this node's disk), upload (into the snapshot store),
//! and what a crash does. Each writes its transitional state before its side effect on the
//! node and its stable state after, or goes back to the last committed one on failure.
//!
//! Every state write goes through [`Engine::move_to`], which checks it against the state
//! machine (`torpor_core::SandboxState::can_transition_to`):
//!
//! ```text
//!            create                 freeze (idle)
//!  Creating ────────▶ Running ◀──────────────────▶ Frozen
//!                      │  ▲    thaw (call)            │
//!       park (idle,    │  │ wake                      │ park
//!       evict, api)    ▼  │                           ▼
//!               Checkpointing ─────────────────▶ Parked ◀─────┐
//!                      │ (failed: back to the    │  ▲          │ upload failed
//!                      │  last committed image)  │  │          │
//!                      ▼                 upload  ▼  │ wake     │
//!                  Suspended ◀──────────── Uploading ──────────┘
//!                      │
//!                      └── wake: Resuming ──▶ Running (or back to Parked/Suspended)
//!  any resident state ── crash ──▶ its last committed image's tier (Parked or Suspended)
//!  any stable state  ── delete ──▶ Deleting ──▶ (gone)
//! ```
//!
//! A daemon crash leaves at most one transitional state per sandbox; `Engine::reconcile`
//! resolves each at the next start (`torpor_core::Recovery`).

use super::*;

/// Cluster mode: how many of this controller's idle sandboxes a start that found no worker with
/// room parks to make some (then, or with none to park, it tries again every [`ROOM_RETRY`]
/// for up to `--worker-wait-ms`, as a call parked for a worker waits).
const ROOM_EVICTIONS: u32 = 4;
/// How long a start waits before it tries again with nothing of its own to park.
const ROOM_RETRY: Duration = Duration::from_millis(250);

impl Engine {
    /// The one place a sandbox's state changes: checks the move against the state machine,
    /// sets the tier that goes with a stable state, persists the record and logs the move
    /// (inside the transition's span). A move the state machine does not allow is a bug: it is
    /// refused (and fails debug builds, so every test catches it) rather than written.
    pub(super) fn move_to(
        &self,
        rec: &mut SandboxRecord,
        to: SandboxState,
        cause: &str,
    ) -> Result<()> {
        self.move_to_on(rec, to, cause, None)
    }

    /// [`Engine::move_to`] for a sandbox whose new container runs on worker `node` (cluster
    /// mode), recorded in the same compare-and-set.
    pub(super) fn move_to_on(
        &self,
        rec: &mut SandboxRecord,
        to: SandboxState,
        cause: &str,
        node: Option<&str>,
    ) -> Result<()> {
        let from = rec.state;
        if from != to && !from.can_transition_to(to) {
            tracing::error!(sandbox = %rec.id, %from, %to, cause, "refused a transition the state machine does not allow");
            debug_assert!(false, "illegal transition {from} -> {to} ({cause})");
            return Err(ControlError::InvalidTransition { from, to: rec.tier });
        }
        rec.state = to;
        rec.tier = match to {
            SandboxState::Running => Tier::Running,
            SandboxState::Frozen => Tier::Frozen,
            SandboxState::Parked => Tier::Parked,
            SandboxState::Suspended => Tier::Suspended,
            _ => rec.tier,
        };
        rec.controller = self.holder_in(to);
        // A compare-and-set over the version this transition read: a write by another
        // controller since (cluster mode) fails it rather than being overwritten. The worker
        // its new container runs on goes in the same write.
        let written = match node {
            Some(node) => self
                .store
                .compare_and_set_sandbox_on(rec, rec.version, node),
            None => self.store.compare_and_set_sandbox(rec, rec.version),
        };
        match written {
            Ok(v) => rec.version = v,
            Err(e) if e.kind() == crate::store::StoreErrorKind::Conflict => {
                tracing::info!(sandbox = %rec.id, %from, %to, cause, "state moved under this transition");
                return Err(self.lost_race(&rec.id));
            }
            Err(e) => {
                self.metrics.store_error("state");
                return Err(e.into());
            }
        }
        if from != to {
            tracing::info!(sandbox = %rec.id, %from, %to, cause, "state");
        }
        Ok(())
    }

    /// Restores a container for `rec` from `image` on a warm worker and waits until its agent
    /// answers.
    pub(super) async fn restore_container(
        &self,
        rec: &SandboxRecord,
        tpl: &TemplateRecord,
        image: &Path,
        stored: StoredFiles,
        configure: bool,
    ) -> Result<Box<dyn Resident>> {
        let gpu = self.gpu_runtime(&rec.id)?;
        let mut spec = container_spec(tpl, &rec.limits, &tpl.spec.env);
        spec.devices = gpu.devices;
        spec.mounts.extend(gpu.mounts);
        let networked = self.store.network(&rec.id)?;
        let launch = Launch {
            container_id: rec.container_id(),
            spec,
            network: networked.clone(),
            ready_timeout: READY_TIMEOUT,
            stored,
            gpu: self.launch_gpu(&rec.id)?,
        };
        let gpu_launched = launch.gpu.is_some();
        let mut evicted = 0;
        let mut room_until: Option<Instant> = None;
        let container = loop {
            let attempt = {
                let _turn = self.restores.take().await;
                self.timed_restore(launch.clone(), image).await
            };
            match attempt {
                // Cluster mode: the lot gave this call a slot, but no worker had one free: the
                // other controllers took it within the heartbeat their use takes to be seen
                // here. A slot this controller holds is made free (its least recently used idle
                // sandbox parked) rather than failing the call; with none to park, the workers'
                // next heartbeats may show one. A checkpoint that only its worker holds (not
                // uploaded yet) makes room there; none is made with no worker ready. (Not the
                // lot's size: that counts the slots the others use, all of them on a full fleet.)
                Err(ControlError::Runtime(torpor_runtime::RuntimeError::NoCapacity(why)))
                    if self.cfg.controller.is_some()
                        && self.node.has_ready_worker()
                        && room_until.is_none_or(|t| Instant::now() < t) =>
                {
                    room_until.get_or_insert_with(|| Instant::now() + self.cfg.worker_wait);
                    let on = launch.stored.image_on.as_deref();
                    if evicted < ROOM_EVICTIONS && self.evict_one_on(on, "worker_full").await {
                        evicted += 1;
                        tracing::info!(sandbox = %rec.id, %why, "no worker had room: parked an idle sandbox of this controller's to make some");
                    } else {
                        tokio::time::sleep(ROOM_RETRY).await;
                    }
                }
                other => {
                    break other.map_err(|e| match e {
                        // A worker's GPUs refused it: answered as the GPU error it is.
                        ControlError::Runtime(torpor_runtime::RuntimeError::Gpu {
                            code,
                            message,
                        }) => crate::gpu::fleet::from_worker(&code, message).into(),
                        e => e,
                    })?;
                }
            }
        };
        self.metrics
            .warm_takes
            .with_label_values(&[if container.was_warm() { "warm" } else { "cold" }])
            .inc();
        let ready = async {
            self.gpu_cuda_resume(&rec.id, &*container, gpu_launched)
                .await?;
            if configure {
                // Both at once: the agent serves requests in parallel.
                let env = Request::Configure {
                    env: rec.env.clone(),
                };
                let configured = async {
                    container.call(&env, &[]).await?;
                    Ok::<_, ControlError>(())
                };
                if networked.is_some() {
                    tokio::try_join!(configured, net::write_resolv_conf(&*container))?;
                } else {
                    configured.await?;
                }
            }
            Ok::<_, ControlError>(())
        }
        .await;
        if let Err(e) = ready {
            container.destroy().await;
            return Err(e);
        }
        Ok(container)
    }

    pub(super) fn install_live(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        rec: &SandboxRecord,
        resident: Box<dyn Resident>,
        permit: WorkerPermit,
    ) {
        tracing::debug!(sandbox = %rec.id, container = resident.id(), worker = resident.worker(), "resident");
        guard.live = Some(Live {
            resident,
            _permit: permit,
            frozen: false,
            owner: rec.tenant.clone(),
        });
        self.metrics.workers_busy.set(self.workers.busy() as i64);
    }

    /// Sends a sandbox back to its last snapshot when the node reports that its container
    /// died on its own.
    pub(super) async fn watch_node(
        self: Arc<Self>,
        mut events: mpsc::UnboundedReceiver<NodeEvent>,
    ) {
        while let Some(event) = events.recv().await {
            let (container_id, reason, oom) = match event {
                NodeEvent::Exited { expected: true, .. } => continue,
                NodeEvent::Exited {
                    container_id, info, ..
                } => (container_id, crash_reason(&info), info.oom_killed),
                NodeEvent::Lost {
                    container_id,
                    worker,
                    silent_for,
                } => (
                    container_id,
                    format!(
                        "worker {worker} was lost (no heartbeat for {} s)",
                        silent_for.as_secs()
                    ),
                    false,
                ),
            };
            let Some(id) = sandbox_of(&container_id).and_then(|s| SandboxId::new(s).ok()) else {
                continue; // a template build's container: its build reports the failure
            };
            let engine = self.clone();
            tokio::spawn(async move {
                engine.on_crash(&id, &container_id, &reason, oom).await;
            });
        }
    }

    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %id, to = "last_snapshot", cause = "crash"))]
    pub(super) async fn on_crash(&self, id: &SandboxId, cid: &str, reason: &str, oom: bool) {
        let slot = self.slot(id);
        let mut guard = slot.state.clone().write_owned().await;
        let same = guard.live.as_ref().is_some_and(|l| l.resident.id() == cid);
        if !same {
            return;
        }
        // A container another controller took over meanwhile is that one's to report.
        let rec = self.store.sandbox(id);
        if let Ok(Some(rec)) = &rec {
            if self.let_go_if_stale(&mut guard, rec).await {
                return;
            }
        }
        let live = guard.live.take().expect("checked above");
        tracing::warn!(sandbox = %id, container = %cid, reason, log = %self.node.log_tail(cid), "sandbox crashed; back to its last snapshot");
        live.resident.destroy().await;
        self.release_gpu(id);
        self.metrics
            .crashes
            .with_label_values(&[if oom { "oom_killed" } else { "exited" }])
            .inc();
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        if let Ok(Some(mut rec)) = rec {
            let age = match &rec.image {
                ImageRef::Store(snapshot) => self
                    .snapshots
                    .taken_at(&rec.tenant, snapshot)
                    .await
                    .map(|at| stored_age(at as i64))
                    .unwrap_or_default(),
                image => snapshot_age(image),
            };
            rec.last_error = Some(format!("{reason}; restored to its last snapshot{age}"));
            rec.oom_killed = oom;
            let to = rec.image.sleeping_state();
            if let Err(e) = self.move_to(&mut rec, to, "crash") {
                tracing::error!(sandbox = %id, error = %e, "cannot record a crash");
            }
        }
    }

    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %rec.id, from = %rec.state, to = "running", cause = "call"))]
    pub(super) async fn wake_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        mut rec: SandboxRecord,
    ) -> Result<()> {
        let from = rec.tier;
        rec.state
            .check_transition(SandboxState::Resuming)
            .map_err(|e| ControlError::InvalidTransition {
                from: e.from,
                to: Tier::Running,
            })?;
        let t = Instant::now();
        let arrival = self.arrive(&rec.tenant)?;
        let tpl = self
            .store
            .template_for(&rec.tenant, &rec.template)?
            .ok_or_else(|| ControlError::NotFound {
                kind: "template",
                id: rec.template.to_string(),
            })?;
        let previous = rec.state;
        {
            let _quota = self.quota_guard(&rec.tenant).await?;
            self.check_quota(&rec.tenant, Charge::wake(rec.limits))?;
            rec.generation += 1;
            self.move_to(&mut rec, SandboxState::Resuming, "call")?;
        }
        let permit = match self
            .acquire_worker(&rec.tenant, rec.limits.memory_bytes(), Some(arrival))
            .await
        {
            Ok(p) => p,
            Err(e) => {
                self.move_to(&mut rec, previous, "no_worker")?;
                return Err(e);
            }
        };
        if let Err(e) = self.acquire_gpu(&rec.id, None).await {
            rec.last_error = Some(format!("wake failed: {e}"));
            self.move_to(&mut rec, previous, "gpu_unavailable")?;
            return Err(e);
        }
        let golden = rec.image == ImageRef::Golden;
        if self.image_host().is_some() {
            // Cluster mode: the worker fetches what it lacks.
            let (image, stored) = self.worker_start(&rec.tenant, &tpl, &rec.image)?;
            let mut restored = self
                .restore_container(&rec, &tpl, &image, stored, golden)
                .await;
            if let Err(e) = &restored {
                if worker_images::image_lost(e) {
                    // Its checkpoint was only on a worker that is gone: back to the last
                    // snapshot in the store (or the template's golden image).
                    self.fall_back_from_lost(&mut rec, e);
                    let golden = rec.image == ImageRef::Golden;
                    let (image, stored) = self.worker_start(&rec.tenant, &tpl, &rec.image)?;
                    restored = self
                        .restore_container(&rec, &tpl, &image, stored, golden)
                        .await;
                }
            }
            return self.finish_wake(guard, rec, restored, permit, previous, from, t);
        }
        // A Suspended checkpoint is fetched (every chunk verified) next to the parked ones.
        let fetched = self
            .sandbox_dir(&rec.id)
            .join("images")
            .join(format!(".tmp-fetch-{}", rec.generation));
        let image = match &rec.image {
            ImageRef::Golden => tpl.golden_dir.clone(),
            ImageRef::Local(p) => p.clone(),
            ImageRef::Worker { .. } => {
                self.release_gpu(&rec.id);
                self.move_to(&mut rec, previous, "restore_failed")?;
                return Err(ControlError::Invalid(
                    "the sandbox's checkpoint is on a cluster worker; wake it through a controller"
                        .into(),
                ));
            }
            ImageRef::Store(snapshot) => {
                let _ = std::fs::remove_dir_all(&fetched);
                if let Err(e) = self.snapshots.fetch(&rec.tenant, snapshot, &fetched).await {
                    self.release_gpu(&rec.id);
                    rec.last_error = Some(format!("wake failed: {e}"));
                    self.move_to(&mut rec, previous, "fetch_failed")?;
                    return Err(e);
                }
                fetched.clone()
            }
        };
        let restored = self
            .restore_container(&rec, &tpl, &image, StoredFiles::default(), golden)
            .await;
        // The restore has read the image; the store keeps the committed copy.
        let _ = std::fs::remove_dir_all(&fetched);
        self.finish_wake(guard, rec, restored, permit, previous, from, t)
    }

    /// Records how a wake's restore went: Running with its container, or back where it was.
    #[allow(clippy::too_many_arguments)]
    fn finish_wake(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        mut rec: SandboxRecord,
        restored: Result<Box<dyn Resident>>,
        permit: WorkerPermit,
        previous: SandboxState,
        from: Tier,
        t: Instant,
    ) -> Result<()> {
        match restored {
            Ok(container) => {
                self.move_to_on(&mut rec, SandboxState::Running, "call", container.node())?;
                self.install_live(guard, &rec, container, permit);
                self.metrics
                    .wake_seconds
                    .with_label_values(&[from.as_str()])
                    .observe(t.elapsed().as_secs_f64());
                Ok(())
            }
            Err(e) => {
                self.release_gpu(&rec.id);
                rec.last_error = Some(format!("wake failed: {e}"));
                self.move_to(&mut rec, previous, "restore_failed")?;
                Err(e)
            }
        }
    }

    /// Freezes a running sandbox (cgroup freezer): its memory stays, its CPU use drops to 0.
    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %id, to = "frozen", cause = %cause))]
    pub(super) async fn freeze_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
        cause: &str,
    ) -> Result<()> {
        if guard.live.as_ref().is_none_or(|l| l.frozen) {
            return Ok(());
        }
        let rec = self.store.sandbox(id)?;
        if let Some(rec) = &rec {
            if self.let_go_if_stale(guard, rec).await {
                return Err(self.lost_race(id));
            }
        }
        let live = guard.live.as_mut().expect("checked above");
        live.resident.set_frozen(true).await?;
        live.frozen = true;
        if let Some(mut rec) = rec {
            if let Err(e) = self.move_to(&mut rec, SandboxState::Frozen, cause) {
                // Another controller took it over as this one froze it (this one's lease had
                // run out): thawed again, and left to its holder.
                if let Some(live) = guard.live.as_mut() {
                    let _ = live.resident.set_frozen(false).await;
                    live.frozen = false;
                }
                if matches!(e, ControlError::HeldElsewhere { .. }) {
                    self.let_go(guard).await;
                }
                return Err(e);
            }
        }
        self.metrics
            .transitions
            .with_label_values(&["frozen", cause])
            .inc();
        Ok(())
    }

    /// Checkpoints a resident sandbox to this node's disk and releases its worker.
    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %id, to = "parked", cause = %cause))]
    pub(super) async fn park_locked(
        &self,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
        cause: &str,
    ) -> Result<()> {
        if guard.live.is_none() {
            return Ok(());
        }
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        if self.let_go_if_stale(guard, &rec).await {
            return Err(self.lost_race(id));
        }
        let cuda_toggled = match guard.live.as_ref() {
            Some(live) => self.gpu_cuda_suspend(id, &*live.resident).await?,
            None => None,
        };
        let live = guard.live.take().expect("checked above, and not let go");
        let _slot = self.checkpoints.take().await;
        self.move_to(&mut rec, SandboxState::Checkpointing, cause)?;
        let images = self.sandbox_dir(id).join("images");
        let tmp = images.join(format!(".tmp-{}", rec.generation));
        let dest = images.join(rec.generation.to_string());
        let _ = std::fs::remove_dir_all(&tmp);
        let t = Instant::now();
        let Live {
            resident, _permit, ..
        } = live;
        resident.settle_connections().await;
        self.note_cpu_at_release(&rec.tenant, id, &*resident);
        // Cluster mode: into the worker's own image area (relative), durable there.
        let on_worker = match (self.image_host(), resident.node()) {
            (Some(_), Some(node)) => Some((node.to_string(), rec.container_id())),
            _ => None,
        };
        let target = match &on_worker {
            Some((_, dir)) => PathBuf::from(dir),
            None => tmp.clone(),
        };
        let result = resident.checkpoint(&target).await;
        self.gpu_after_checkpoint(id, cuda_toggled, result.is_ok());
        drop(_permit);
        self.release_gpu(id);
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        match result {
            Ok(()) if on_worker.is_some() => {
                let (node, dir) = on_worker.expect("checked");
                let fallback = match &rec.image {
                    ImageRef::Store(s) => Some(s.clone()),
                    ImageRef::Worker { fallback, .. } => fallback.clone(),
                    ImageRef::Golden | ImageRef::Local(_) => None,
                };
                let old = std::mem::replace(
                    &mut rec.image,
                    ImageRef::Worker {
                        node,
                        dir,
                        taken_at: now_millis(),
                        fallback,
                    },
                );
                self.move_to(&mut rec, SandboxState::Parked, cause)?;
                // The snapshot it supersedes stays (as the fallback) until the upload.
                match old {
                    ImageRef::Worker { node, dir, .. } => {
                        if let Some(host) = self.image_host() {
                            host.remove(&node, &dir).await;
                        }
                    }
                    ImageRef::Local(_) => self.remove_image(&rec.tenant, &old).await,
                    ImageRef::Store(_) | ImageRef::Golden => {}
                }
                self.metrics
                    .checkpoint_seconds
                    .with_label_values(&["ok"])
                    .observe(t.elapsed().as_secs_f64());
                self.metrics
                    .transitions
                    .with_label_values(&["parked", cause])
                    .inc();
                if let ImageRef::Worker { node, .. } = &rec.image {
                    self.upload_soon(id, node);
                }
                Ok(())
            }
            Ok(()) => {
                // Durable before the record points at it; the old image goes only after.
                if let Err(e) = commit_image(&tmp, &dest).await {
                    rec.last_error = Some(
                        "checkpoint could not be stored durably; back to its last snapshot".into(),
                    );
                    let to = rec.image.sleeping_state();
                    self.move_to(&mut rec, to, "commit_failed")?;
                    return Err(e);
                }
                let old = std::mem::replace(&mut rec.image, ImageRef::Local(dest.clone()));
                self.move_to(&mut rec, SandboxState::Parked, cause)?;
                self.remove_image(&rec.tenant, &old).await;
                self.reencode_soon(id, &dest);
                let bytes = dir_size(&dest);
                self.metrics
                    .checkpoint_seconds
                    .with_label_values(&["ok"])
                    .observe(t.elapsed().as_secs_f64());
                self.metrics
                    .checkpoint_bytes
                    .with_label_values(&["sandbox"])
                    .inc_by(bytes);
                self.metrics
                    .transitions
                    .with_label_values(&["parked", cause])
                    .inc();
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                self.metrics
                    .checkpoint_seconds
                    .with_label_values(&["failed"])
                    .observe(t.elapsed().as_secs_f64());
                rec.last_error = Some(format!("checkpoint failed, back to its last snapshot: {e}"));
                let to = rec.image.sleeping_state();
                self.move_to(&mut rec, to, "checkpoint_failed")?;
                Err(e.into())
            }
        }
    }

    /// Moves a parked sandbox's checkpoint into the snapshot store.
    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %id, to = "suspended", cause = %cause))]
    pub(super) async fn upload_locked(&self, id: &SandboxId, cause: &str) -> Result<()> {
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        if rec.state == SandboxState::Suspended {
            return Ok(());
        }
        rec.state
            .check_transition(SandboxState::Uploading)
            .map_err(|e| ControlError::InvalidTransition {
                from: e.from,
                to: Tier::Suspended,
            })?;
        self.move_to(&mut rec, SandboxState::Uploading, cause)?;
        if let (ImageRef::Worker { .. }, Some(host)) = (&rec.image, self.image_host()) {
            return self.upload_from_worker(&mut rec, host, cause).await;
        }
        let source = match &rec.image {
            ImageRef::Local(p) => p.clone(),
            ImageRef::Worker { .. } => {
                self.move_to(&mut rec, SandboxState::Parked, "upload_failed")?;
                return Err(ControlError::Invalid(
                    "the sandbox's checkpoint is on a cluster worker; only a controller can upload it"
                        .into(),
                ));
            }
            ImageRef::Golden => {
                self.store
                    .template_for(&rec.tenant, &rec.template)?
                    .ok_or_else(|| ControlError::NotFound {
                        kind: "template",
                        id: rec.template.to_string(),
                    })?
                    .golden_dir
            }
            ImageRef::Store(_) => {
                // Already in the store (a sandbox that fell back to its stored snapshot).
                self.move_to(&mut rec, SandboxState::Suspended, cause)?;
                return Ok(());
            }
        };
        let t = Instant::now();
        // The manifest is the commit marker: until put_dir returns, the store holds no
        // snapshot for this checkpoint, and the local image stays the sandbox's.
        // The store's futures run in their own task: their internal borrows stay out of the
        // API handlers' futures (which must be Send for any lifetime).
        let labels = vec![(
            torpor_snapshot::store::LABEL_SANDBOX.to_string(),
            id.to_string(),
        )];
        match self.snapshots.put(&rec.tenant, labels, source).await {
            Ok(report) => {
                self.store
                    .set_snapshot_bytes(report.id.as_str(), report.stats.input_bytes)?;
                let old = std::mem::replace(&mut rec.image, ImageRef::Store(report.id.to_string()));
                self.move_to(&mut rec, SandboxState::Suspended, cause)?;
                self.remove_image(&rec.tenant, &old).await;
                self.metrics
                    .checkpoint_bytes
                    .with_label_values(&["store_new"])
                    .inc_by(report.stats.bytes_written);
                self.metrics
                    .transitions
                    .with_label_values(&["suspended", cause])
                    .inc();
                tracing::info!(sandbox = %id, snapshot = %report.id, ms = t.elapsed().as_millis() as u64,
                    written = report.stats.bytes_written, "checkpoint in the snapshot store");
                Ok(())
            }
            Err(e) => {
                rec.last_error = Some(format!("upload failed, still parked on this node: {e}"));
                self.move_to(&mut rec, SandboxState::Parked, "upload_failed")?;
                Err(e)
            }
        }
    }

    /// Removes a superseded checkpoint: a local image directory, or a snapshot in the store.
    pub(super) async fn remove_image(&self, tenant: &TenantId, image: &ImageRef) {
        match image {
            ImageRef::Golden => {}
            ImageRef::Local(p) => {
                let _ = std::fs::remove_dir_all(p);
            }
            ImageRef::Worker {
                node,
                dir,
                fallback,
                ..
            } => {
                if let Some(host) = self.image_host() {
                    host.remove(node, dir).await;
                }
                if let Some(f) = fallback {
                    Box::pin(self.remove_image(tenant, &ImageRef::Store(f.clone()))).await;
                }
            }
            ImageRef::Store(snapshot) => {
                if let Err(e) = self.store.forget_snapshot_bytes(snapshot) {
                    tracing::warn!(snapshot, error = %e, "cannot forget a snapshot's size");
                }
                self.snapshots.retire(tenant, snapshot).await;
                // The worker that uploaded it keeps a copy: a cache of what is gone.
                if let Some(host) = self.image_host() {
                    host.forget(snapshot, false).await;
                }
            }
        }
    }
}

/// When a sandbox's last snapshot was taken, for the error that sends it back there: what
/// it did since is what it lost.
pub(super) fn snapshot_age(image: &ImageRef) -> String {
    if let ImageRef::Worker { taken_at, .. } = image {
        return stored_age(*taken_at);
    }
    let ImageRef::Local(dir) = image else {
        return String::new();
    };
    let Ok(taken) = std::fs::metadata(dir).and_then(|m| m.modified()) else {
        return String::new();
    };
    let lost = taken.elapsed().unwrap_or_default().as_secs();
    format!(
        " (taken at {}; the last {lost} s of work are lost)",
        humantime::format_rfc3339_seconds(taken)
    )
}

/// [`snapshot_age`] of a snapshot taken at `taken_at`.
pub(super) fn stored_age(taken_at: i64) -> String {
    let lost = (now_millis() - taken_at).max(0) / 1000;
    format!(
        " (taken at {}; the last {lost} s of work are lost)",
        super::worker_images::format_millis(taken_at)
    )
}

pub(super) fn crash_reason(info: &torpor_runtime::ExitInfo) -> String {
    if info.oom_killed {
        return "oom_killed".to_string();
    }
    match (info.code, info.signal) {
        // Its runtime process left no status: it vanished (in cluster mode: with its worker,
        // or its worker ended it while out of reach, a fence).
        (None, None) => "ended without an exit status".into(),
        (Some(code), None) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (Some(code), Some(signal)) => format!("exited (code {code}, signal {signal})"),
    }
}

/// Copies a directory tree with `cp -a` (keeps modes, owners, links and special files).
/// Makes a checkpoint image that runsc wrote at `tmp` durable (every file, then the
/// directories) and publishes it at `dest` with a durable rename, replacing what was there. A
/// record may point at `dest` once this returns: a power loss cannot leave it half written.
pub(super) async fn commit_image(tmp: &Path, dest: &Path) -> Result<()> {
    let (tmp, dest) = (tmp.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || {
        use torpor_snapshot::durable;
        durable::fsync_tree(&tmp)?;
        let _ = std::fs::remove_dir_all(&dest);
        durable::rename_durably(&tmp, &dest)
    })
    .await
    .map_err(|e| ControlError::TaskFailed {
        what: "image commit",
        source: e,
    })?
    .map_err(|e| ControlError::Io {
        what: "cannot commit the image",
        path: e.path.clone(),
        source: e.source,
    })
}

/// Removes every entry of `dir` but `keep` (compared by name; nothing is removed when `keep`
/// does not lie in `dir` or does not exist).
pub(super) fn remove_other_entries(dir: &Path, keep: &Path) {
    let (Some(name), Some(parent)) = (keep.file_name(), keep.parent()) else {
        return;
    };
    if parent.file_name() != dir.file_name() || !keep.exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name() != name {
            tracing::info!(path = %e.path().display(), "removing a checkpoint no record points at");
            remove_entry(&e.path());
        }
    }
}

pub(super) fn remove_tmp_entries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            remove_entry(&e.path());
        }
    }
}

/// Removes a directory with its contents, or a file (a re-encoding left by a crash).
fn remove_entry(path: &Path) {
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}
