//! Templates: registration, the build (root filesystem, boot, warm-up, golden checkpoint) and
//! removal. A template's golden checkpoint is what every new sandbox of it is restored from.

use super::*;

impl Engine {
    /// Templates the tenant may use: its own and the operator's.
    pub fn templates(&self, tenant: &TenantId) -> Result<Vec<TemplateRecord>> {
        Ok(self
            .store
            .templates()?
            .into_iter()
            .filter(|t| visible(tenant, &t.tenant))
            .collect())
    }

    /// The template `name` means for `tenant`: its own, else the operator's. The admin also
    /// reaches a tenant's template when no operator template has that name and exactly one
    /// tenant does.
    pub fn template(&self, tenant: &TenantId, name: &TemplateName) -> Result<TemplateRecord> {
        let found = match self.store.template_for(tenant, name)? {
            Some(t) => Some(t),
            None if *tenant == TenantId::admin() => {
                let mut all: Vec<_> = self
                    .store
                    .templates()?
                    .into_iter()
                    .filter(|t| t.name == *name)
                    .collect();
                if all.len() == 1 {
                    all.pop()
                } else {
                    None
                }
            }
            None => None,
        };
        match found {
            Some(t) if visible(tenant, &t.tenant) => Ok(t),
            _ => Err(ControlError::NotFound {
                kind: "template",
                id: name.to_string(),
            }),
        }
    }

    /// Builds a template: lays out its root filesystem, boots it once and checkpoints it as its
    /// golden snapshot. `progress` hears each step. A tenant may name host paths only inside
    /// the operator's import directory ([`sources`]).
    pub async fn register_template(
        &self,
        tenant: &TenantId,
        mut spec: TemplateSpec,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateRecord> {
        spec.source = self.check_source(tenant, &spec.source)?;
        let read_from = spec.source.clone();
        self.register_template_checked(tenant, spec, read_from, progress)
            .await
    }

    /// [`Engine::register_template`] once the source is known to be the caller's to read:
    /// `read_from` is what is imported (it differs from `spec.source` for an upload, whose
    /// path on the host is not recorded).
    pub(super) async fn register_template_checked(
        &self,
        tenant: &TenantId,
        spec: TemplateSpec,
        read_from: TemplateSource,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateRecord> {
        self.check_running()?;
        spec.validate()
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        self.check_limits_fit(tenant, &spec.limits)?;
        if let Some(gpu) = &spec.gpu {
            crate::gpu::NodeGpus::parse_request(self.gpus.get(), gpu, tenant)?;
        }
        let dir = self.template_dir(tenant, &spec.name);
        let mut rec = TemplateRecord {
            name: spec.name.clone(),
            tenant: tenant.clone(),
            spec,
            status: TemplateStatus::Building,
            rootfs: dir.join("rootfs"),
            mounts: Vec::new(),
            agent_dir: self.node_info.agent_dir.clone(),
            golden_dir: dir.join("golden"),
            golden_bytes: 0,
            created_at: now_millis(),
        };
        // A tenant's template may not shadow an operator's (which every tenant sees, so this
        // tells nothing new): sandboxes name their template by name.
        if *tenant != TenantId::admin()
            && self
                .store
                .template(&TenantId::admin(), &rec.name)?
                .is_some()
        {
            return Err(ControlError::AlreadyExists {
                kind: "template",
                id: rec.name.to_string(),
            });
        }
        {
            // The build takes a worker with the template's limits: charged like a resident
            // sandbox until the record leaves `building`.
            let _quota = self.quota_guard(tenant).await?;
            self.check_quota(tenant, Charge::template(rec.spec.limits))?;
            if !self.store.insert_template(&rec)? {
                return Err(ControlError::AlreadyExists {
                    kind: "template",
                    id: rec.name.to_string(),
                });
            }
        }
        match self.build_template(&mut rec, read_from, progress).await {
            Ok(()) => Ok(rec),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                self.store.delete_template(&rec.tenant, &rec.name)?;
                Err(e)
            }
        }
    }

    pub(super) async fn build_template(
        &self,
        rec: &mut TemplateRecord,
        read_from: TemplateSource,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<()> {
        let dir = rec
            .rootfs
            .parent()
            .expect("rootfs has a parent")
            .to_path_buf();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&rec.rootfs)
            .map_err(ControlError::io("cannot create", &rec.rootfs))?;
        match read_from {
            TemplateSource::Host => {
                progress("preparing the host root filesystem");
                rec.mounts =
                    rootfs::prepare_host_rootfs(&rec.rootfs).map_err(|e| ControlError::Io {
                        what: "cannot prepare the host root filesystem",
                        path: rec.rootfs.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })?;
            }
            TemplateSource::Rootfs { path } => {
                if Path::new(&path).is_file() {
                    progress("unpacking the root filesystem archive");
                    let limits = self.unpack_options(&rec.tenant)?.limits;
                    unpack_rootfs_tar(Path::new(&path), &rec.rootfs, limits).await?;
                } else {
                    progress(&format!("copying root filesystem {path}"));
                    copy_tree(Path::new(&path), &rec.rootfs).await?;
                }
                let root = rec.rootfs.clone();
                let stripped =
                    tokio::task::spawn_blocking(move || sources::strip_privileged(&root))
                        .await
                        .map_err(|e| ControlError::TaskFailed {
                            what: "rootfs check",
                            source: e,
                        })?
                        .map_err(ControlError::io("cannot check", &rec.rootfs))?;
                if stripped > 0 {
                    tracing::info!(template = %rec.name, stripped, "setuid/setgid bits and device nodes removed");
                }
                let agent_mount = rec.rootfs.join(".torpor");
                std::fs::create_dir_all(&agent_mount)
                    .map_err(ControlError::io("cannot create", &agent_mount))?;
            }
            TemplateSource::Image { path, reference } => {
                progress(&format!("importing image {path}"));
                let rootfs = rec.rootfs.clone();
                let name = rec.name.to_string();
                let options = self.unpack_options(&rec.tenant)?;
                let config = tokio::task::spawn_blocking(move || {
                    let _ = std::fs::remove_dir(&rootfs);
                    let src = torpor_image::detect(Path::new(&path))?;
                    torpor_image::unpack_with(
                        &src,
                        reference.as_deref(),
                        &rootfs,
                        &options,
                        &mut |p| {
                            tracing::info!(template = %name, progress = ?p, "image import");
                        },
                    )
                })
                .await
                .map_err(|e| ControlError::TaskFailed {
                    what: "image import",
                    source: e,
                })??;
                apply_image_config(&mut rec.spec, &config);
                let agent_mount = rec.rootfs.join(".torpor");
                std::fs::create_dir_all(&agent_mount)
                    .map_err(ControlError::io("cannot create", &agent_mount))?;
            }
        }
        // Cluster mode: workers read the root filesystem from the store.
        let stored = match self.image_host() {
            Some(_) => {
                progress("publishing the root filesystem to the snapshot store");
                self.publish_rootfs(rec).await?;
                StoredFiles {
                    rootfs: Some(worker_images::rootfs_snapshot(rec)),
                    access: self.snapshots.access_for(&rec.tenant)?,
                    ..StoredFiles::default()
                }
            }
            None => StoredFiles::default(),
        };
        progress("booting the template");
        let permit = self
            .acquire_worker(&rec.tenant, rec.spec.limits.memory_bytes(), None)
            .await?;
        let launch = Launch {
            // runsc names each sandbox's control socket after its container id in the
            // machine-wide abstract namespace: the nonce keeps two daemons (a worker and a
            // test's, two replicas' builds) building one template apart (48 bits; a 16-bit one
            // collided once in a test run: "address already in use").
            container_id: format!(
                "tpl-{}-{:012x}",
                rec.name,
                rand::random::<u64>() & 0xffff_ffff_ffff
            ),
            spec: container_spec(rec, &rec.spec.limits, &rec.spec.env),
            network: None,
            ready_timeout: READY_TIMEOUT,
            stored,
            gpu: None,
        };
        let container = self.node.boot(launch).await?;
        if rec.spec.warmup_ms > 0 {
            progress(&format!("warming up for {} ms", rec.spec.warmup_ms));
            tokio::time::sleep(Duration::from_millis(rec.spec.warmup_ms)).await;
        }
        if let Ok((
            Reply::Main {
                running: false,
                exit_code,
                ..
            },
            _,
        )) = container.call(&Request::MainStatus, &[]).await
        {
            if !rec.spec.command.is_empty() {
                container.destroy().await;
                return Err(ControlError::Invalid(format!(
                    "the template's command exited during boot (exit code {exit_code:?})"
                )));
            }
        }
        progress("checkpointing the golden snapshot");
        let t = Instant::now();
        match (self.image_host(), container.node().map(str::to_string)) {
            (Some(host), Some(node)) => {
                // On the worker's disk, then into the store (pinned) for every worker.
                let name = worker_images::golden_snapshot(rec);
                let result = container.checkpoint(Path::new(&name)).await;
                drop(permit);
                result?;
                progress("publishing the golden snapshot to the snapshot store");
                rec.golden_bytes = self.publish_golden(rec, host, &node, &name).await?;
            }
            _ => {
                let tmp = dir.join(".golden.tmp");
                let result = container.checkpoint(&tmp).await;
                drop(permit);
                result?;
                // Counted as runsc wrote it; kept re-encoded for faster creates.
                rec.golden_bytes = dir_size(&tmp);
                self.reencode_uncommitted(&tmp).await;
                commit_image(&tmp, &rec.golden_dir).await?;
            }
        }
        self.metrics
            .checkpoint_seconds
            .with_label_values(&["golden"])
            .observe(t.elapsed().as_secs_f64());
        self.metrics
            .checkpoint_bytes
            .with_label_values(&["golden"])
            .inc_by(rec.golden_bytes);
        rec.status = TemplateStatus::Ready;
        self.store.update_template(rec)?;
        progress("ready");
        Ok(())
    }

    pub async fn delete_template(&self, tenant: &TenantId, name: &TemplateName) -> Result<()> {
        let t = self.template(tenant, name)?;
        if t.tenant != *tenant && *tenant != TenantId::admin() {
            return Err(ControlError::NotFound {
                kind: "template",
                id: name.to_string(),
            });
        }
        let n = self.store.count_sandboxes_of_template(&t.tenant, name)?;
        if n > 0 {
            return Err(ControlError::TemplateInUse(name.to_string(), n));
        }
        self.store.delete_template(&t.tenant, name)?;
        self.template_sizes.forget(&t.tenant, name);
        let _ = std::fs::remove_dir_all(t.rootfs.parent().unwrap_or(&t.rootfs));
        // Its pinned snapshots (the golden image a fork of a fresh sandbox published; in
        // cluster mode also its root filesystem), and every worker's kept copy of them.
        let mut pinned = vec![worker_images::golden_snapshot(&t)];
        if self.image_host().is_some() {
            pinned.push(worker_images::rootfs_snapshot(&t));
        }
        for snapshot in &pinned {
            self.snapshots.drop_pinned(&t.tenant, snapshot).await;
            if let Some(host) = self.image_host() {
                host.forget(snapshot, true).await;
            }
        }
        Ok(())
    }
}

pub(super) fn container_spec(
    tpl: &TemplateRecord,
    limits: &Limits,
    env: &BTreeMap<String, String>,
) -> ContainerSpec {
    ContainerSpec {
        rootfs: tpl.rootfs.clone(),
        mounts: tpl.mounts.clone(),
        agent_dir: tpl.agent_dir.clone(),
        argv: rootfs::agent_argv(&tpl.spec.command),
        env: env.clone(),
        cwd: tpl.spec.cwd.clone().unwrap_or_else(|| "/".into()),
        limits: *limits,
        hostname: "sandbox".into(),
        netns: None,
        devices: Vec::new(),
    }
}

/// An image's entrypoint, cmd, env and working directory fill what the template left unset.
pub(super) fn apply_image_config(spec: &mut TemplateSpec, config: &torpor_image::ImageConfig) {
    if spec.command.is_empty() {
        spec.command = config
            .entrypoint
            .iter()
            .chain(config.cmd.iter())
            .cloned()
            .collect();
    }
    for kv in &config.env {
        if let Some((k, v)) = kv.split_once('=') {
            spec.env
                .entry(k.to_string())
                .or_insert_with(|| v.to_string());
        }
    }
    if spec.cwd.is_none() {
        spec.cwd = config.working_dir.clone().filter(|d| d.starts_with('/'));
    }
}

/// Unpacks a root-filesystem tarball (plain, gzip or zstd) into `dest`, refusing entries that
/// would land outside it.
pub(super) async fn unpack_rootfs_tar(
    archive: &Path,
    dest: &Path,
    limits: torpor_image::Limits,
) -> Result<()> {
    let (archive, dest) = (archive.to_path_buf(), dest.to_path_buf());
    tokio::task::spawn_blocking(move || {
        // The destination must be missing or empty; the build made it empty.
        let _ = std::fs::remove_dir(&dest);
        torpor_image::unpack_rootfs_tar_with(&archive, &dest, &limits)
    })
    .await
    .map_err(|e| ControlError::TaskFailed {
        what: "rootfs unpack",
        source: e,
    })??;
    Ok(())
}

pub(super) async fn copy_tree(src: &Path, dest: &Path) -> Result<()> {
    if !src.is_dir() {
        return Err(ControlError::Invalid(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    std::fs::create_dir_all(dest).map_err(ControlError::io("cannot create", dest))?;
    let out = tokio::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dest)
        .output()
        .await
        .map_err(ControlError::io("cannot run cp for", src))?;
    if !out.status.success() {
        return Err(ControlError::Io {
            what: "cannot copy",
            path: src.to_path_buf(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(())
}
