//! GPU shares (crate::gpu) as the lifecycle sees them: acquired before a restore, released
//! when a sandbox leaves its worker, cuda-checkpoint around checkpoints.

use super::*;

impl Engine {
    /// Gives the engine the node's GPUs; once, right after start.
    pub fn attach_gpus(&self, mut gpus: crate::gpu::NodeGpus) {
        gpus.set_nvproxy(self.node_info.nvproxy);
        // Stored shares against the states reconcile left: awake holders keep theirs.
        match self.store.sandboxes() {
            Ok(all) => {
                let states: HashMap<SandboxId, SandboxState> =
                    all.into_iter().map(|s| (s.id, s.state)).collect();
                gpus.reconcile(|id| states.get(id).map(|s| s.may_have_container()));
            }
            Err(e) => tracing::error!(error = %e, "cannot read sandboxes to reconcile GPU shares"),
        }
        if self.gpus.set(gpus).is_err() {
            tracing::warn!("GPUs attached twice; the first stays");
        }
    }

    pub fn gpus(&self) -> Option<&crate::gpu::NodeGpus> {
        self.gpus.get()
    }

    /// Cluster mode: gives the engine the workers' GPUs; once, right after start. GPU requests
    /// are then kept in the state store and sent with each start, for the worker to place.
    pub fn attach_fleet_gpus(&self, fleet: Arc<dyn crate::gpu::FleetGpus>) {
        if self.fleet_gpus.set(fleet).is_err() {
            tracing::warn!("fleet GPUs attached twice; the first stays");
        }
    }

    /// Cluster mode without node GPUs: the workers place shares.
    fn gpus_on_workers(&self) -> bool {
        self.gpus.get().is_none() && self.fleet_gpus.get().is_some()
    }

    /// What a start of `id` asks its worker for (cluster mode; `None` on a single machine,
    /// where [`Engine::acquire_gpu`] placed the share already, and for sandboxes without one).
    pub(super) fn launch_gpu(&self, id: &SandboxId) -> Result<Option<torpor_runtime::LaunchGpu>> {
        if !self.gpus_on_workers() {
            return Ok(None);
        }
        match self.store.gpu_request(id)? {
            Some(request) => Ok(Some(crate::gpu::fleet::launch_gpu(&request)?)),
            None => Ok(None),
        }
    }

    /// Gets a sandbox its GPU share before a restore (`request` is saved first on create).
    /// Borrowed shares reclaimed for it are parked in the background.
    pub(super) async fn acquire_gpu(
        &self,
        id: &SandboxId,
        request: Option<&torpor_gpu::request::GpuRequest>,
    ) -> Result<()> {
        let Some(gpus) = self.gpus.get() else {
            if let (true, Some(request)) = (self.gpus_on_workers(), request) {
                self.store.put_gpu_request(id, request)?;
            }
            return Ok(());
        };
        if let Some(request) = request {
            gpus.save_request(id, request).map_err(ControlError::io(
                "cannot save the GPU request of",
                Path::new(id.as_str()),
            ))?;
        }
        for victim in gpus.acquire(id)? {
            let Some(engine) = self.me.upgrade() else {
                break;
            };
            tokio::spawn(async move {
                let slot = engine.slot(&victim);
                let mut guard = slot.state.clone().write_owned().await;
                if let Err(e) = engine
                    .park_locked(&mut guard, &victim, "gpu_reclaimed")
                    .await
                {
                    tracing::warn!(sandbox = %victim, error = %e, "cannot park a sandbox whose GPU share was reclaimed");
                }
            });
        }
        Ok(())
    }

    pub(super) fn release_gpu(&self, id: &SandboxId) {
        if let Some(gpus) = self.gpus.get() {
            gpus.release(id);
        }
    }

    pub(super) fn forget_gpu(&self, id: &SandboxId) {
        if let Some(gpus) = self.gpus.get() {
            gpus.forget(id);
        } else if let (true, Some(fleet)) = (self.gpus_on_workers(), self.fleet_gpus.get()) {
            if let Err(e) = self.store.delete_gpu_toggled(id) {
                tracing::error!(sandbox = %id, error = %e, "cannot forget the cuda-checkpoint record");
            }
            match self.store.delete_gpu_request(id) {
                // Only a sandbox that had a GPU has tickets on workers.
                Ok(true) => fleet.forget_tickets(id),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(sandbox = %id, error = %e, "cannot forget the GPU request");
                    fleet.forget_tickets(id);
                }
            }
        }
    }

    pub(super) fn copy_gpu_request(&self, from: &SandboxId, to: &SandboxId) {
        if self.gpus_on_workers() {
            let copied = self
                .store
                .gpu_request(from)
                .and_then(|r| r.map_or(Ok(()), |r| self.store.put_gpu_request(to, &r)));
            if let Err(e) = copied {
                tracing::warn!(sandbox = %to, error = %e, "cannot copy the GPU request to a fork");
            }
        }
        if let Some(gpus) = self.gpus.get() {
            if let Some(request) = gpus.request_of(from) {
                if let Err(e) = gpus.save_request(to, &request) {
                    tracing::warn!(sandbox = %to, error = %e, "cannot copy the GPU request to a fork");
                }
            }
        }
    }

    /// The exec environment: the GPU share's variables, then the caller's on top.
    pub(super) fn gpu_env(
        &self,
        id: &SandboxId,
        env: BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        match self.gpus.get() {
            Some(gpus) => {
                let mut all = gpus.env(id);
                all.extend(env);
                all
            }
            None => env,
        }
    }

    pub(super) fn gpu_runtime(&self, id: &SandboxId) -> Result<crate::gpu::GpuRuntime> {
        match self.gpus.get() {
            Some(gpus) => Ok(gpus.runtime(id)?),
            None => Ok(crate::gpu::GpuRuntime::default()),
        }
    }

    /// Before a checkpoint: moves the GPU state of `id`'s processes to host memory with
    /// cuda-checkpoint when any holds a GPU context, refused (`checkpoint_gpu_context`) when
    /// none can be run. On a single machine the host's view of the container says whether one
    /// does; on a cluster worker, whose host the controller cannot see, the sandbox's own
    /// `/proc` does (GPU sandboxes only), and the tool is looked for inside it.
    pub(super) async fn gpu_cuda_suspend(
        &self,
        id: &SandboxId,
        container: &dyn Resident,
    ) -> Result<Option<torpor_gpu::cuda_checkpoint::Toggled>> {
        if let Some(gpus) = self.gpus.get() {
            return match self.gpu_checkpoint_gate(id, container.id())? {
                Some(tool) => Ok(Some(gpus.cuda_suspend(container, tool).await?)),
                None => Ok(None),
            };
        }
        if !self.gpus_on_workers() || self.store.gpu_request(id)?.is_none() {
            return Ok(None);
        }
        let pids = crate::gpu::cuda_holders(container).await?;
        if pids.is_empty() {
            return Ok(None);
        }
        let Some(tool) = crate::gpu::cuda_tool_in(container).await? else {
            let refused = torpor_gpu::sleep::CheckpointError::GpuContextWithoutCudaCheckpoint;
            return Err(crate::gpu::GpuError::from(refused).into());
        };
        Ok(Some(crate::gpu::cuda_toggle(container, tool, pids).await?))
    }

    fn gpu_checkpoint_gate(
        &self,
        id: &SandboxId,
        container_id: &str,
    ) -> Result<Option<torpor_gpu::cuda_checkpoint::Tool>> {
        let Some(gpus) = self.gpus.get().filter(|g| g.holds(id)) else {
            return Ok(None);
        };
        // The template's rootfs and bind mounts: where a sandbox's own cuda-checkpoint lives.
        let tpl = match self.store.sandbox(id)? {
            Some(rec) => self.store.template_for(&rec.tenant, &rec.template)?,
            None => None,
        };
        let (rootfs, mounts) = match &tpl {
            Some(t) => (
                t.rootfs.clone(),
                t.mounts
                    .iter()
                    .map(|m| (PathBuf::from(&m.source), m.destination.clone()))
                    .collect::<Vec<_>>(),
            ),
            None => (PathBuf::new(), Vec::new()),
        };
        Ok(gpus.checkpoint_gate(id, container_id, &rootfs, &mounts)?)
    }

    /// After a checkpoint taken with cuda-checkpoint: remembered for the restore. A failed
    /// checkpoint stops the container (runsc), so there is nothing to toggle back: the sandbox
    /// goes back to its previous image, taken before this toggle.
    pub(super) fn gpu_after_checkpoint(
        &self,
        id: &SandboxId,
        toggled: Option<torpor_gpu::cuda_checkpoint::Toggled>,
        ok: bool,
    ) {
        let Some(toggled) = toggled else {
            return;
        };
        if ok {
            // Cluster mode: in the controllers' database, for the restore on any worker.
            let saved = match self.gpus.get() {
                Some(gpus) => gpus.save_toggled(id, &toggled).map_err(|e| e.to_string()),
                None => self
                    .store
                    .put_gpu_toggled(id, &toggled)
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = saved {
                tracing::error!(sandbox = %id, error = %e, "cannot record the cuda-checkpoint toggle");
            }
        } else {
            tracing::warn!(sandbox = %id, "checkpoint failed after cuda-checkpoint; the container is gone and the sandbox goes back to its previous image");
        }
    }

    /// After a restore: brings GPU state that cuda-checkpoint moved to host memory back.
    /// `gpu_launched`: the start carried a GPU share to a worker (cluster mode), so its
    /// record may name toggled processes.
    pub(super) async fn gpu_cuda_resume(
        &self,
        id: &SandboxId,
        container: &dyn Resident,
        gpu_launched: bool,
    ) -> Result<()> {
        if let Some(gpus) = self.gpus.get() {
            if let Some(toggled) = gpus.toggled(id) {
                gpus.cuda_resume(container, &toggled).await?;
                gpus.clear_toggled(id);
            }
            return Ok(());
        }
        if !gpu_launched {
            return Ok(());
        }
        if let Some(toggled) = self.store.gpu_toggled(id)? {
            crate::gpu::cuda_resume_in(container, &toggled).await?;
            if let Err(e) = self.store.delete_gpu_toggled(id) {
                tracing::error!(sandbox = %id, error = %e, "cannot forget the cuda-checkpoint record");
            }
        }
        Ok(())
    }
}
