//! The sandbox operations the API calls: create, borrow for a call (waking it), suspend to a
//! tier, fork, resume, metadata, delete. Each takes the sandbox's slot lock and runs its
//! transitions (`transitions`) under it.

use super::*;

/// How many times a call's wake that another controller's transition overtook looks at the
/// sandbox again before it answers `sandbox_busy`.
const WAKE_RACES: u32 = 2;

impl Engine {
    /// Every sandbox whose metadata has `key` (the operator's view: background sweeps).
    pub fn sandboxes_with_metadata(&self, key: &str) -> Result<Vec<SandboxRecord>> {
        let mut all = self.store.sandboxes_with_metadata(key)?;
        for s in &mut all {
            self.fresh_activity(s);
        }
        Ok(all)
    }

    pub fn sandboxes(&self, tenant: &TenantId) -> Result<Vec<SandboxRecord>> {
        // Only what the caller owns: the operator's sandboxes are not a tenant's to see; the
        // operator sees every tenant's.
        let mut all = if *tenant == TenantId::admin() {
            self.store.sandboxes()?
        } else {
            self.store.sandboxes_of(tenant)?
        };
        for s in &mut all {
            self.fresh_activity(s);
        }
        Ok(all)
    }

    /// A sandbox the tenant owns; another tenant's answers NotFound, so existence is not leaked.
    pub fn sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<SandboxRecord> {
        match self.store.sandbox(id)? {
            Some(mut s) if owns(tenant, &s.tenant) => {
                self.fresh_activity(&mut s);
                Ok(s)
            }
            _ => Err(not_found(id)),
        }
    }

    /// The fast path of [`Engine::use_sandbox`]: a sandbox running here, its lock free, for its
    /// owner (or the operator) is borrowed at once, without reading its record (which no
    /// transition can change while the borrow holds the lock). Anything else: `None`.
    fn use_if_running(&self, tenant: &TenantId, id: &SandboxId) -> Option<InUse> {
        let slot = self.existing_slot(id)?;
        let guard = slot.state.clone().try_read_owned().ok()?;
        let live = guard.live.as_ref()?;
        if live.frozen || !live.resident.alive() || !owns(tenant, &live.owner) {
            return None;
        }
        slot.touch();
        Some(InUse {
            guard,
            slot,
            id: id.clone(),
            evictor: self.evictor.clone(),
        })
    }

    pub(super) fn fresh_activity(&self, s: &mut SandboxRecord) {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get(&s.id) {
            s.last_active_at = s
                .last_active_at
                .max(slot.last_active.load(Ordering::Relaxed));
        }
    }

    #[tracing::instrument(name = "transition", skip_all, fields(template = %req.template, to = "running", cause = "create"))]
    pub async fn create_sandbox(
        &self,
        tenant: &TenantId,
        req: CreateSandbox,
    ) -> Result<SandboxRecord> {
        self.check_running()?;
        let tpl = self.template(tenant, &req.template)?;
        if tpl.status != TemplateStatus::Ready {
            return Err(ControlError::TemplateNotReady(tpl.name.to_string()));
        }
        let limits = tpl
            .spec
            .limits
            .patched(&req.limits)
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        self.check_limits_fit(tenant, &limits)?;
        validate_env(&req.env).map_err(|e| ControlError::Invalid(e.to_string()))?;
        check_metadata(&req.metadata)?;
        let gpu_request = match req.gpu.as_ref().or(tpl.spec.gpu.as_ref()) {
            Some(gpu) => Some(match (self.gpus.get(), self.fleet_gpus.get()) {
                (None, Some(fleet)) => {
                    crate::gpu::fleet::parse_fleet_request(fleet.as_ref(), gpu, tenant)?
                }
                (node, _) => crate::gpu::NodeGpus::parse_request(node, gpu, tenant)?,
            }),
            None => None,
        };
        // The sandbox's own policy, else its template's.
        let network = net::check_policy(req.network.as_ref(), &tpl)?;
        let now = now_millis();
        let mut rec = SandboxRecord {
            id: SandboxId::generate(),
            tenant: tenant.clone(),
            template: tpl.name.clone(),
            state: SandboxState::Creating,
            tier: Tier::Running,
            limits,
            env: req.env,
            metadata: req.metadata.into_iter().chain(req.layer_metadata).collect(),
            created_at: now,
            last_active_at: now,
            generation: 1,
            image: ImageRef::Golden,
            last_error: None,
            oom_killed: false,
            controller: self.holder_in(SandboxState::Creating),
            version: Default::default(),
        };
        let arrival = self.arrive(tenant)?;
        {
            let _quota = self.quota_guard(tenant).await?;
            self.check_quota(tenant, Charge::sandbox(rec.limits))?;
            self.store.insert_sandbox(&rec)?;
            if let Some(policy) = &network {
                self.store.set_network(&rec.id, policy)?;
            }
        }
        let permit = match self
            .acquire_worker(tenant, rec.limits.memory_bytes(), Some(arrival))
            .await
        {
            Ok(p) => p,
            Err(e) => {
                self.store.delete_sandbox(&rec.id)?;
                return Err(e);
            }
        };
        if let Err(e) = self.acquire_gpu(&rec.id, gpu_request.as_ref()).await {
            self.forget_gpu(&rec.id);
            self.store.delete_sandbox(&rec.id)?;
            return Err(e);
        }
        let slot = self.slot(&rec.id);
        let mut guard = slot.state.clone().write_owned().await;
        let t = Instant::now();
        let (image, stored) = match self.image_host() {
            Some(_) => self.worker_start(&rec.tenant, &tpl, &ImageRef::Golden)?,
            None => (tpl.golden_dir.clone(), StoredFiles::default()),
        };
        match self
            .restore_container(&rec, &tpl, &image, stored, true)
            .await
        {
            Ok(container) => {
                self.move_to_on(&mut rec, SandboxState::Running, "create", container.node())?;
                self.install_live(&mut guard, &rec, container, permit);
                slot.touch();
                self.metrics
                    .wake_seconds
                    .with_label_values(&["golden"])
                    .observe(t.elapsed().as_secs_f64());
                Ok(rec)
            }
            Err(e) => {
                self.forget_gpu(&rec.id);
                self.store.delete_sandbox(&rec.id)?;
                self.remove_sandbox_files(&rec.id);
                self.slots
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec.id);
                Err(e)
            }
        }
    }

    /// Borrows a running sandbox for one call, waking it first if it sleeps.
    pub async fn use_sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<InUse> {
        if let Some(in_use) = self.use_if_running(tenant, id) {
            return Ok(in_use);
        }
        let seen = self.sandbox(tenant, id)?;
        // Resident by its record with no container here: passed to this controller, to be
        // adopted (it takes no worker from the lot).
        let passed = matches!(seen.state, SandboxState::Running | SandboxState::Frozen);
        let owner = seen.tenant;
        let slot = self.slot(id);
        let mut raced = 0;
        loop {
            {
                let guard = slot.state.clone().read_owned().await;
                match &guard.live {
                    Some(live) if !live.frozen && live.resident.alive() => {
                        slot.touch();
                        return Ok(InUse {
                            guard,
                            slot: slot.clone(),
                            id: id.clone(),
                            evictor: self.evictor.clone(),
                        });
                    }
                    // Asleep: it needs a worker. A call the lot would not serve within its
                    // budget is refused now, from memory, before the write lock and the store
                    // reads of the wake (a burst of them queues on those).
                    None if passed => {}
                    None => self.refuse_early(&owner)?,
                    Some(_) => {}
                }
            }
            self.check_running()?;
            let mut guard = slot.state.clone().write_owned().await;
            let Some(mut rec) = self.store.sandbox(id)? else {
                return Err(not_found(id));
            };
            self.let_go_if_stale(&mut guard, &rec).await;
            self.check_held_here(&rec)?;
            let live_state = guard.live.as_ref().map(|l| (l.frozen, !l.resident.alive()));
            match live_state {
                Some((_, true)) => {
                    // Its container died outside any transition (the crash watch may be
                    // recording it already; on_crash does it once). An exit that says it was
                    // asked for is a crash too here: its worker ended it on its own (a fence).
                    let live = guard.live.as_ref().expect("checked");
                    let (exit, cid) = (live.resident.exit_handle(), live.resident.id().to_string());
                    drop(guard);
                    let recorded = self
                        .record_exit(id, &cid, exit, super::calls::GONE_EXIT_WAIT)
                        .await;
                    if recorded.is_none() {
                        self.on_crash(id, &cid, "its agent channel closed", false)
                            .await;
                    }
                    continue;
                }
                Some((true, false)) => {
                    let t = Instant::now();
                    let live = guard.live.as_mut().expect("checked");
                    live.resident.set_frozen(false).await?;
                    live.frozen = false;
                    self.move_to(&mut rec, SandboxState::Running, "call")?;
                    self.metrics
                        .wake_seconds
                        .with_label_values(&["frozen"])
                        .observe(t.elapsed().as_secs_f64());
                }
                Some((false, false)) => {}
                // Resident by its record, yet no container here: its hold was passed to this
                // controller. Adopted (or sent back to its snapshot), then looked at again.
                None if matches!(rec.state, SandboxState::Running | SandboxState::Frozen) => {
                    self.take_passed(&mut guard, rec).await?;
                    continue;
                }
                None => match self.wake_locked(&mut guard, rec).await {
                    Ok(()) => self.reboot_if_marked(&guard, id).await?,
                    // Cluster mode: another controller moved it while this wake ran (woke it
                    // and put it back to sleep, or its own wake failed). Nothing was sent to
                    // it: looked at again, a sandbox now held elsewhere is that controller's
                    // to serve (the caller is forwarded there), a sleeping one is woken here.
                    Err(ControlError::Busy(why)) if raced < WAKE_RACES => {
                        raced += 1;
                        tracing::info!(sandbox = %id, why, "the sandbox changed under its wake; looking again");
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            }
            slot.touch();
            return Ok(InUse {
                guard: guard.downgrade(),
                slot: slot.clone(),
                id: id.clone(),
                evictor: self.evictor.clone(),
            });
        }
    }

    /// Puts a sandbox to sleep down to `tier` (explicit suspend).
    pub async fn suspend(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        tier: Tier,
    ) -> Result<SandboxRecord> {
        self.suspend_for(tenant, id, tier, "api").await
    }

    /// [`Engine::suspend`] with the cause its transitions record (`api`, `gpu_reclaimed`).
    pub async fn suspend_for(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        tier: Tier,
        cause: &str,
    ) -> Result<SandboxRecord> {
        self.sandbox(tenant, id)?;
        let mut guard = self
            .lock_drained(id, "nothing was cut, retry later")
            .await?;
        let current = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        self.check_held_here(&current)?;
        self.adopt_if_passed(&mut guard, &current).await?;
        let refused = || ControlError::InvalidTransition {
            from: current.state,
            to: tier,
        };
        if current.tier > tier {
            return Err(refused());
        }
        match tier {
            Tier::Running => return Err(refused()),
            Tier::Frozen => self.freeze_locked(&mut guard, id, cause).await?,
            Tier::Parked => self.park_locked(&mut guard, id, cause).await?,
            Tier::Suspended => {
                self.park_locked(&mut guard, id, cause).await?;
                self.upload_locked(id, cause).await?;
            }
        }
        drop(guard);
        self.sandbox(tenant, id)
    }

    /// Sandbox `id`'s lock for a transition, once its calls in flight have ended (up to the
    /// drain timeout; then `Busy`, saying `then`).
    pub(super) async fn lock_drained(
        &self,
        id: &SandboxId,
        then: &str,
    ) -> Result<OwnedRwLockWriteGuard<SlotState>> {
        let slot = self.slot(id);
        tokio::time::timeout(self.cfg.drain_timeout, slot.state.clone().write_owned())
            .await
            .map_err(|_| {
                ControlError::Busy(format!(
                    "sandbox {id} still has calls in flight (execs, proxied requests or an open \
                     WebSocket) after {} ms; {then}",
                    self.cfg.drain_timeout.as_millis()
                ))
            })
    }

    /// Makes `count` new sandboxes from `id`'s latest snapshot, without copying: the snapshot
    /// goes into the store (deduplicated), and each fork is a manifest sharing its chunks. A
    /// resident source is parked first. The forks are Suspended; their first call wakes them.
    pub async fn fork(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        count: usize,
    ) -> Result<Vec<SandboxRecord>> {
        self.check_running()?;
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ControlError::Invalid(format!(
                "count must be between 1 and {MAX_FORKS}"
            )));
        }
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let mut guard = slot.state.clone().write_owned().await;
        let rec = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        self.adopt_if_passed(&mut guard, &rec).await?;
        if guard.live.is_some() {
            self.park_locked(&mut guard, id, "fork").await?;
        }
        let mut source = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        if matches!(source.image, ImageRef::Worker { .. }) {
            // Cluster mode: forks share chunks in the store, so the image goes there first.
            self.upload_locked(id, "fork").await?;
            source = self.store.sandbox(id)?.ok_or_else(|| not_found(id))?;
        }
        let snapshot = match &source.image {
            ImageRef::Worker { node, .. } => {
                return Err(ControlError::Snapshot(format!(
                    "the checkpoint is still only on worker {node}; retry"
                )))
            }
            ImageRef::Store(s) => torpor_snapshot::SnapshotId::new(s.as_str())
                .map_err(|e| ControlError::Snapshot(format!("snapshot id {s:?}: {e}")))?,
            ImageRef::Local(dir) => self.put_snapshot(&source.tenant, id, dir.clone()).await?,
            ImageRef::Golden => {
                let tpl = self
                    .store
                    .template_for(&source.tenant, &source.template)?
                    .ok_or_else(|| ControlError::NotFound {
                        kind: "template",
                        id: source.template.to_string(),
                    })?;
                let golden = match self.image_host() {
                    // Cluster mode: published when the template was built.
                    Some(_) => {
                        torpor_snapshot::SnapshotId::new(worker_images::golden_snapshot(&tpl))
                            .map_err(|e| {
                                ControlError::Snapshot(format!("golden snapshot id: {e}"))
                            })?
                    }
                    None => {
                        self.snapshots
                            .golden(
                                &source.tenant,
                                tpl.name.as_str(),
                                tpl.created_at,
                                tpl.golden_dir,
                            )
                            .await?
                    }
                };
                self.store
                    .set_snapshot_bytes(golden.as_str(), tpl.golden_bytes)?;
                golden
            }
        };
        // Each fork is charged what its source's snapshot holds (quotas count before
        // deduplication).
        let snapshot_bytes = self.store.snapshot_bytes(snapshot.as_str())?;
        drop(guard);
        let ids = self.snapshots.fork(&source.tenant, snapshot, count).await?;
        let mut forks = Vec::with_capacity(count);
        for snap in ids {
            let now = now_millis();
            // Not the marks of the source's next wake: the fork starts from its memory.
            let mut metadata = super::reboot::forked_metadata(&source.metadata, now);
            metadata.insert("forked_from".into(), source.id.to_string());
            let rec = SandboxRecord {
                id: SandboxId::generate(),
                tenant: source.tenant.clone(),
                template: source.template.clone(),
                state: SandboxState::Suspended,
                tier: Tier::Suspended,
                limits: source.limits,
                env: source.env.clone(),
                metadata,
                created_at: now,
                last_active_at: now,
                generation: source.generation,
                image: ImageRef::Store(snap.to_string()),
                last_error: None,
                oom_killed: false,
                controller: None,
                version: Default::default(),
            };
            self.store
                .set_snapshot_bytes(snap.as_str(), snapshot_bytes)?;
            let inserted = {
                let _quota = self.quota_guard(&rec.tenant).await?;
                self.check_quota(
                    &rec.tenant,
                    Charge {
                        sandboxes: 1,
                        ..Charge::default()
                    },
                )
                .and_then(|()| Ok(self.store.insert_sandbox(&rec)?))
            };
            if let Err(e) = inserted {
                // Forks made so far stay; the rest of the snapshots are dropped.
                self.remove_image(&rec.tenant, &rec.image).await;
                if forks.is_empty() {
                    return Err(e);
                }
                tracing::warn!(sandbox = %id, made = forks.len(), error = %e, "fork stopped early");
                break;
            }
            self.copy_gpu_request(id, &rec.id);
            // A fork of a networked sandbox is networked, with the same policy.
            if let Some(policy) = self.store.network(id)? {
                self.store.set_network(&rec.id, &policy)?;
            }
            forks.push(rec);
        }
        Ok(forks)
    }

    /// Puts a checkpoint directory into the snapshot store.
    pub(super) async fn put_snapshot(
        &self,
        tenant: &TenantId,
        sandbox: &SandboxId,
        dir: PathBuf,
    ) -> Result<torpor_snapshot::SnapshotId> {
        let labels = vec![(
            torpor_snapshot::store::LABEL_SANDBOX.to_string(),
            sandbox.to_string(),
        )];
        let report = self.snapshots.put(tenant, labels, dir).await?;
        self.store
            .set_snapshot_bytes(report.id.as_str(), report.stats.input_bytes)?;
        self.metrics
            .checkpoint_bytes
            .with_label_values(&["store_new"])
            .inc_by(report.stats.bytes_written);
        Ok(report.id)
    }

    /// Wakes a sandbox to Running without running anything in it.
    pub async fn resume(&self, tenant: &TenantId, id: &SandboxId) -> Result<SandboxRecord> {
        drop(self.use_sandbox(tenant, id).await?);
        self.sandbox(tenant, id)
    }

    /// Sets (`Some`) or removes (`None`) metadata keys of a sandbox; answers the new record.
    pub fn patch_sandbox_metadata(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        patch: &BTreeMap<String, Option<String>>,
    ) -> Result<SandboxRecord> {
        let mut rec = self.sandbox(tenant, id)?;
        for (k, v) in patch {
            match v {
                Some(v) => rec.metadata.insert(k.clone(), v.clone()),
                None => rec.metadata.remove(k),
            };
        }
        self.store.set_sandbox_metadata(id, &rec.metadata)?;
        Ok(rec)
    }

    #[tracing::instrument(name = "transition", skip_all, fields(sandbox = %id, to = "deleted", cause = "api"))]
    pub async fn delete_sandbox(&self, tenant: &TenantId, id: &SandboxId) -> Result<()> {
        let seen = self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        // Calls in flight hold the sandbox (a command that never ends, an open WebSocket).
        // A delete does not wait on them without bound: after a short grace it destroys the
        // container, which ends those calls, and then takes the sandbox.
        let mut guard = match tokio::time::timeout(DELETE_GRACE, slot.state.clone().write_owned())
            .await
        {
            Ok(g) => g,
            Err(_) => {
                tracing::info!(sandbox = %id, "delete cuts the calls still in flight");
                self.node.kill(&seen.container_id()).await;
                tokio::time::timeout(DELETE_CUT_WAIT, slot.state.clone().write_owned())
                    .await
                    .map_err(|_| {
                        ControlError::Busy(
                            "the sandbox's calls did not end after its container was destroyed; retry the delete"
                                .into(),
                        )
                    })?
            }
        };
        let Some(mut rec) = self.store.sandbox(id)? else {
            return Err(not_found(id));
        };
        self.check_held_here(&rec)?;
        let resident = matches!(rec.state, SandboxState::Running | SandboxState::Frozen);
        self.move_to(&mut rec, SandboxState::Deleting, "delete")?;
        match guard.live.take() {
            Some(live) => {
                self.note_cpu_at_release(&rec.tenant, id, &*live.resident);
                live.resident.destroy().await;
            }
            // Passed here by another controller and not adopted yet: its container runs on
            // its worker all the same.
            None if resident => self.node.kill(&rec.container_id()).await,
            None => {}
        }
        self.forget_gpu(id);
        self.remove_image(&rec.tenant, &rec.image).await;
        self.snapshots
            .forget_sandbox(&rec.tenant, id.as_str())
            .await;
        self.remove_sandbox_files(id);
        self.store.delete_sandbox(id)?;
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.metrics.workers_busy.set(self.workers.busy() as i64);
        Ok(())
    }
}

pub(super) fn check_metadata(m: &BTreeMap<String, String>) -> Result<()> {
    super::reboot::check_reserved(m)?;
    if m.len() > MAX_METADATA_ENTRIES {
        return Err(ControlError::Invalid(format!(
            "metadata may hold at most {MAX_METADATA_ENTRIES} entries"
        )));
    }
    if m.iter()
        .any(|(k, v)| k.is_empty() || k.len() > MAX_METADATA_LEN || v.len() > MAX_METADATA_LEN)
    {
        return Err(ControlError::Invalid(format!(
            "metadata keys must be non-empty and keys and values at most {MAX_METADATA_LEN} bytes"
        )));
    }
    Ok(())
}
