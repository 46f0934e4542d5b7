//! Tenant quotas: what a call is about to add to a tenant's holdings ([`Charge`]) checked
//! against its [`Quotas`], and the node-wide ceiling on one sandbox's limits.
//!
//! Every path that takes something that costs is charged here: a sandbox (count), a resident
//! sandbox or a template build (memory and CPUs: a build boots the template on a worker), a
//! template (count), disk (templates' files, checkpoints on this node, uploads). The check and
//! the state change that consumes the quota are made under the engine's `quota_lock`, so two
//! calls at the last unit cannot both win. Template builds consume their share by their
//! `building` record (counted as resident until the build ends).
//!
//! Disk is measured, not declared: templates' directories once (they are immutable), each
//! sandbox's checkpoint directory on each check (a handful of files), and for a sandbox asleep
//! in the snapshot store the size its checkpoint had when it was stored (forks: their source's).
//! Quotas count before deduplication: sharing chunks is the node's saving, not a tenant's
//! allowance. Snapshots stored by older versions have no recorded size and count zero.

use std::collections::HashMap;
use std::sync::Mutex;

use torpor_core::{Limits, TemplateName, TenantId};

use super::{dir_size, Engine};
use crate::error::{ControlError, Result};
use crate::store::{ImageRef, Quotas, TemplateStatus};

/// Most processes one tenant's sandbox may have: a fork bomb should stay inside its sandbox
/// long before the node's pid table fills.
pub const TENANT_MAX_PIDS: u64 = 32_768;
/// Most bytes a tenant's image may unpack to (its disk quota may allow less).
pub const TENANT_MAX_UNPACKED: u64 = 16 << 30;
/// Most entries a tenant's image may hold.
pub const TENANT_MAX_ENTRIES: u64 = 1 << 20;

/// What a call is about to add for a tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Charge {
    pub sandboxes: u64,
    /// One more resident sandbox (or template build) with these limits.
    pub resident: Option<Limits>,
    pub templates: u64,
    pub disk_bytes: u64,
}

impl Charge {
    pub fn sandbox(limits: Limits) -> Charge {
        Charge {
            sandboxes: 1,
            resident: Some(limits),
            ..Charge::default()
        }
    }
    pub fn wake(limits: Limits) -> Charge {
        Charge {
            resident: Some(limits),
            ..Charge::default()
        }
    }
    pub fn template(limits: Limits) -> Charge {
        Charge {
            templates: 1,
            resident: Some(limits),
            ..Charge::default()
        }
    }
}

/// What a tenant holds now, as quotas count it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Held {
    pub sandboxes: u64,
    pub resident: u64,
    pub memory_mib: u64,
    pub cpus: f64,
    pub templates: u64,
    pub disk_bytes: u64,
}

/// The first quota `charge` would exceed on top of `held`: (name, limit, in use).
pub(crate) fn first_exceeded(
    q: &Quotas,
    held: &Held,
    charge: &Charge,
) -> Option<(&'static str, u64, u64)> {
    let over = |limit: Option<u64>, used: u64, adding: u64| match limit {
        Some(limit) if adding > 0 && used.saturating_add(adding) > limit => Some((limit, used)),
        _ => None,
    };
    let mib = |b: u64| b.div_ceil(1 << 20);
    let mut checks: Vec<(&'static str, Option<(u64, u64)>)> = vec![
        (
            "sandboxes",
            over(q.max_sandboxes, held.sandboxes, charge.sandboxes),
        ),
        (
            "templates",
            over(q.max_templates, held.templates, charge.templates),
        ),
    ];
    if let Some(l) = &charge.resident {
        checks.push(("running", over(q.max_running, held.resident, 1)));
        checks.push((
            "memory_mib",
            over(q.max_memory_mib, held.memory_mib, l.memory_mib),
        ));
        // CPUs are fractional: compare in thousandths, report whole CPUs (rounded up).
        if let Some(limit) = q.max_cpus {
            let used = (held.cpus * 1000.0).round() as u64;
            let adding = (l.cpus * 1000.0).round() as u64;
            if used + adding > limit * 1000 {
                checks.push(("cpus", Some((limit, used.div_ceil(1000)))));
            }
        }
    }
    if charge.disk_bytes > 0 || charge.sandboxes > 0 || charge.templates > 0 {
        // Anything new that will take disk is refused once the tenant is at its disk quota.
        if let Some(limit) = q.max_disk_mib {
            let used = mib(held.disk_bytes);
            if mib(held.disk_bytes + charge.disk_bytes) > limit || used >= limit {
                checks.push(("disk_mib", Some((limit, used))));
            }
        }
    }
    checks
        .into_iter()
        .find_map(|(what, hit)| hit.map(|(limit, used)| (what, limit, used)))
}

/// What one upload may bring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadAllowance {
    pub bytes: u64,
    /// When the tenant's disk quota is what limits it: (limit, in use), in MiB.
    pub disk_quota: Option<(u64, u64)>,
}

/// Sizes of templates' directories: they do not change once built.
#[derive(Default)]
pub(crate) struct TemplateSizes(Mutex<HashMap<(TenantId, TemplateName), u64>>);

impl TemplateSizes {
    pub fn forget(&self, tenant: &TenantId, name: &TemplateName) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(tenant.clone(), name.clone()));
    }
}

impl Engine {
    /// Serialises a quota check with the state change that consumes the quota: the engine's
    /// mutex and, in cluster mode, the tenant's lock in the store (two controllers at the
    /// last unit take turns). Held across store reads and writes only.
    pub(super) async fn quota_guard(
        &self,
        tenant: &TenantId,
    ) -> Result<(tokio::sync::MutexGuard<'_, ()>, crate::store::StoreLock)> {
        let local = self.quota_lock.lock().await;
        let shared = match self.cfg.controller {
            Some(_) => self.store.lock(&format!("quota:{tenant}"))?,
            None => Default::default(),
        };
        Ok((local, shared))
    }

    /// Refuses when `tenant` would exceed a quota by adding `charge`. Call under `quota_lock`,
    /// and consume the quota (write the state) before releasing it.
    pub(crate) fn check_quota(&self, tenant: &TenantId, charge: Charge) -> Result<()> {
        let Some(t) = self.store.tenant(tenant)? else {
            return Ok(()); // the operator
        };
        let held = self.held(tenant, &t.quotas)?;
        match first_exceeded(&t.quotas, &held, &charge) {
            None => Ok(()),
            Some((what, limit, used)) => {
                self.metrics
                    .quota_rejections
                    .with_label_values(&[tenant.as_str(), what])
                    .inc();
                Err(ControlError::QuotaExceeded { what, limit, used })
            }
        }
    }

    /// What the tenant holds now. Disk is walked only when the tenant has a disk quota.
    fn held(&self, tenant: &TenantId, q: &Quotas) -> Result<Held> {
        let u = self.store.usage(tenant)?;
        let templates: Vec<_> = self
            .store
            .templates()?
            .into_iter()
            .filter(|t| t.tenant == *tenant)
            .collect();
        let mut held = Held {
            sandboxes: u.sandboxes,
            resident: u.resident,
            memory_mib: u.resident_memory_mib,
            cpus: u.resident_millicpus as f64 / 1000.0,
            templates: templates.len() as u64,
            disk_bytes: 0,
        };
        // A template being built holds a worker with its limits.
        for t in templates
            .iter()
            .filter(|t| t.status == TemplateStatus::Building)
        {
            held.resident += 1;
            held.memory_mib += t.spec.limits.memory_mib;
            held.cpus += t.spec.limits.cpus;
        }
        if q.max_disk_mib.is_some() {
            let mut bytes = 0;
            {
                let mut sizes = self
                    .template_sizes
                    .0
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                for t in &templates {
                    let key = (t.tenant.clone(), t.name.clone());
                    bytes += match sizes.get(&key) {
                        Some(b) => *b,
                        None if t.status == TemplateStatus::Ready => {
                            let dir = t.rootfs.parent().map(dir_size).unwrap_or(0);
                            sizes.insert(key, dir);
                            dir
                        }
                        None => t.rootfs.parent().map(dir_size).unwrap_or(0),
                    };
                }
            }
            for s in self
                .store
                .sandboxes()?
                .iter()
                .filter(|s| s.tenant == *tenant)
            {
                bytes += dir_size(&self.sandbox_dir(&s.id));
                if let ImageRef::Store(snapshot) = &s.image {
                    bytes += self.store.snapshot_bytes(snapshot)?;
                }
            }
            bytes += self.uploads_in_flight(tenant);
            held.disk_bytes = bytes;
        }
        Ok(held)
    }

    /// Bytes of uploads being received for `tenant` (files `uploads/<tenant>.*`).
    fn uploads_in_flight(&self, tenant: &TenantId) -> u64 {
        let prefix = format!("{tenant}.");
        std::fs::read_dir(self.upload_dir())
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// How many bytes `tenant` may upload now: its disk quota's headroom (after a check that it
    /// may add a template at all), at most `cap`.
    pub async fn upload_allowance(&self, tenant: &TenantId, cap: u64) -> Result<UploadAllowance> {
        let unlimited = UploadAllowance {
            bytes: cap,
            disk_quota: None,
        };
        let Some(t) = self.store.tenant(tenant)? else {
            return Ok(unlimited);
        };
        let _quota = self.quota_guard(tenant).await?;
        self.check_quota(
            tenant,
            Charge {
                templates: 1,
                ..Charge::default()
            },
        )?;
        match t.quotas.max_disk_mib {
            None => Ok(unlimited),
            Some(limit) => {
                let held = self.held(tenant, &t.quotas)?;
                let headroom = (limit << 20).saturating_sub(held.disk_bytes);
                Ok(UploadAllowance {
                    bytes: headroom.min(cap),
                    disk_quota: (headroom < cap).then_some((limit, held.disk_bytes >> 20)),
                })
            }
        }
    }

    /// How much an import for `tenant` may unpack: at most [`TENANT_MAX_UNPACKED`], and no
    /// more than its disk quota's headroom (a gzip bomb stops at the quota, not at the disk).
    pub(crate) fn unpack_options(&self, tenant: &TenantId) -> Result<torpor_image::UnpackOptions> {
        let mut options = torpor_image::UnpackOptions::default();
        if *tenant == TenantId::admin() {
            return Ok(options);
        }
        let mut limit = TENANT_MAX_UNPACKED;
        if let Some(t) = self.store.tenant(tenant)? {
            if let Some(max) = t.quotas.max_disk_mib {
                let held = self.held(tenant, &t.quotas)?;
                limit = limit.min((max << 20).saturating_sub(held.disk_bytes));
            }
        }
        options.limits.max_unpacked_bytes = limit;
        options.limits.max_entries = TENANT_MAX_ENTRIES;
        Ok(options)
    }

    /// Refuses limits no tenant's sandbox may have on this node: more memory than the machine
    /// has, more CPUs than it has, more processes than [`TENANT_MAX_PIDS`]. (Limits are
    /// ceilings, not reservations: the memory budget is kept against what sandboxes use.) The
    /// operator's own sandboxes are not held to this.
    pub(crate) fn check_limits_fit(&self, tenant: &TenantId, l: &Limits) -> Result<()> {
        if *tenant == TenantId::admin() {
            return Ok(());
        }
        if let Some(total_mib) = machine_memory_mib() {
            if l.memory_mib > total_mib {
                return Err(ControlError::Invalid(format!(
                    "limits.memory_mib {} is more than this node's memory ({total_mib} MiB)",
                    l.memory_mib
                )));
            }
        }
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        if l.cpus > cpus {
            return Err(ControlError::Invalid(format!(
                "limits.cpus {} is more than this node has ({cpus})",
                l.cpus
            )));
        }
        if l.pids > TENANT_MAX_PIDS {
            return Err(ControlError::Invalid(format!(
                "limits.pids {} is more than a tenant's sandbox may have ({TENANT_MAX_PIDS})",
                l.pids
            )));
        }
        Ok(())
    }
}

/// The machine's memory (MemTotal), in MiB.
fn machine_memory_mib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib / 1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(memory_mib: u64, cpus: f64) -> Limits {
        Limits {
            memory_mib,
            cpus,
            pids: 64,
        }
    }

    #[test]
    fn every_quota_is_checked_and_named() {
        let q = Quotas {
            max_sandboxes: Some(2),
            max_running: Some(1),
            max_memory_mib: Some(1024),
            max_cpus: Some(2),
            max_templates: Some(1),
            max_disk_mib: Some(10),
            ..Quotas::default()
        };
        let none = Held::default();
        assert_eq!(
            first_exceeded(&q, &none, &Charge::sandbox(limits(512, 1.0))),
            None
        );
        let held = Held {
            sandboxes: 2,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(&q, &held, &Charge::sandbox(limits(512, 1.0))),
            Some(("sandboxes", 2, 2))
        );
        let held = Held {
            resident: 1,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(&q, &held, &Charge::wake(limits(512, 1.0))),
            Some(("running", 1, 1))
        );
        assert_eq!(
            first_exceeded(&q, &none, &Charge::wake(limits(2048, 1.0))),
            Some(("memory_mib", 1024, 0))
        );
        assert_eq!(
            first_exceeded(&q, &none, &Charge::wake(limits(64, 2.5))),
            Some(("cpus", 2, 0))
        );
        let held = Held {
            cpus: 1.5,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(&q, &held, &Charge::wake(limits(64, 0.5))),
            None
        );
        assert_eq!(
            first_exceeded(&q, &held, &Charge::wake(limits(64, 0.75))),
            Some(("cpus", 2, 2))
        );
        let held = Held {
            templates: 1,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(&q, &held, &Charge::template(limits(64, 0.5))),
            Some(("templates", 1, 1))
        );
        let held = Held {
            disk_bytes: 10 << 20,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(&q, &held, &Charge::sandbox(limits(64, 0.5))),
            Some(("disk_mib", 10, 10))
        );
        // A wake of an existing sandbox is not refused for disk: nothing new is stored.
        assert_eq!(
            first_exceeded(&q, &held, &Charge::wake(limits(64, 0.5))),
            None
        );
    }

    #[test]
    fn no_quota_means_unlimited() {
        let held = Held {
            sandboxes: u64::MAX - 1,
            templates: 1 << 40,
            disk_bytes: u64::MAX / 2,
            cpus: 1e9,
            ..Held::default()
        };
        assert_eq!(
            first_exceeded(
                &Quotas::default(),
                &held,
                &Charge::sandbox(limits(1 << 20, 1024.0))
            ),
            None
        );
    }
}
