//! Tenant quotas in GPU memory and compute, with borrowing and reclaim.
//!
//! Compute is counted in units where one whole GPU is [`COMPUTE_PER_GPU`] (700): one MIG SM
//! slice is 100 units and one percent of a GPU is 7, so MIG slices and SM fractions add up
//! exactly. Each tenant has a guaranteed amount and may borrow idle capacity above it, up to
//! its borrow limit. Capacity held above the guarantee is reclaimable: when a tenant within its
//! guarantee needs room, the planner may evict the newest allocations of tenants that are over
//! theirs. This module does the arithmetic; choosing what to evict is the planner's job.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{AllocationId, TenantId};
use crate::inventory::{Gpu, Inventory};
use crate::ledger::{Ledger, ShareKind};

/// Compute units of one whole GPU.
pub const COMPUTE_PER_GPU: u64 = 700;
/// Compute units of one MIG SM slice.
pub const COMPUTE_PER_SM_SLICE: u64 = 100;
/// Compute units of one percent of a GPU (MPS active-thread percentage).
pub const COMPUTE_PER_PERCENT: u64 = 7;

/// An amount of GPU memory and compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Amount {
    pub memory_mib: u64,
    /// Compute units (700 per GPU).
    pub compute: u64,
}

impl Amount {
    pub fn plus(self, other: Amount) -> Amount {
        Amount {
            memory_mib: self.memory_mib.saturating_add(other.memory_mib),
            compute: self.compute.saturating_add(other.compute),
        }
    }

    pub fn saturating_sub(self, other: Amount) -> Amount {
        Amount {
            memory_mib: self.memory_mib.saturating_sub(other.memory_mib),
            compute: self.compute.saturating_sub(other.compute),
        }
    }

    /// Whether both dimensions are at most `limit`'s.
    pub fn within(self, limit: Amount) -> bool {
        self.memory_mib <= limit.memory_mib && self.compute <= limit.compute
    }
}

/// What one share costs its tenant. Time-slice shares have no isolation, so they are charged
/// an even split of the GPU (rounded up).
pub fn share_charge(gpu: &Gpu, kind: &ShareKind) -> Amount {
    match kind {
        ShareKind::Whole => Amount {
            memory_mib: gpu.memory_mib,
            compute: COMPUTE_PER_GPU,
        },
        ShareKind::Mig { instance } => {
            let geometry = gpu.mig_geometry.as_deref();
            match geometry.and_then(|g| g.profile_by_id(instance.profile_id).map(|p| (g, p))) {
                // SM slices as a share of the GPU's: exactly 100 units a slice on 7-slice GPUs.
                Some((g, p)) => Amount {
                    memory_mib: p.memory_mib(gpu.memory_mib),
                    compute: u64::from(p.sm_slices) * COMPUTE_PER_GPU
                        / u64::from(g.sm_slices().max(1)),
                },
                None => Amount::default(),
            }
        }
        ShareKind::Mps {
            compute_pct,
            memory_mib,
        } => Amount {
            memory_mib: *memory_mib,
            compute: u64::from(*compute_pct) * COMPUTE_PER_PERCENT,
        },
        ShareKind::Timeslice => {
            let n = u64::from(gpu.timeslice_replicas.max(1));
            Amount {
                memory_mib: gpu.memory_mib.div_ceil(n),
                compute: COMPUTE_PER_GPU.div_ceil(n),
            }
        }
    }
}

/// One tenant's quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantQuota {
    pub guaranteed: Amount,
    /// How far above `guaranteed` the tenant may borrow idle capacity; none when absent.
    #[serde(default)]
    pub borrow_limit: Option<Amount>,
}

impl TenantQuota {
    /// The most the tenant may hold, borrowing included.
    pub fn ceiling(&self) -> Amount {
        self.guaranteed.plus(self.borrow_limit.unwrap_or_default())
    }
}

/// Where a tenant stands after an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// No quotas are configured, or the request names no tenant and none is required.
    Unlimited,
    /// Within the guarantee: not reclaimable, and may reclaim from borrowers.
    Guaranteed,
    /// Above the guarantee: the excess is reclaimable.
    Borrowing,
}

/// Why a tenant may not take more.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error("quotas are configured, so the request must name a tenant")]
    TenantRequired,
    #[error("tenant {tenant} has no quota")]
    NoQuota { tenant: TenantId },
    #[error(
        "tenant {tenant} would hold {would_hold} {unit} of {dimension}, above its limit of {limit}"
    )]
    Exceeded {
        tenant: TenantId,
        dimension: &'static str,
        unit: &'static str,
        would_hold: u64,
        limit: u64,
    },
}

impl QuotaError {
    pub fn code(&self) -> &'static str {
        match self {
            QuotaError::TenantRequired => "quota_tenant_required",
            QuotaError::NoQuota { .. } => "quota_none",
            QuotaError::Exceeded { .. } => "quota_exceeded",
        }
    }
}

/// Why a quota file was refused.
#[derive(Debug, thiserror::Error)]
pub enum QuotaFileError {
    #[error("{file}: cannot read")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}:{line}:{column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
}

impl QuotaFileError {
    pub fn code(&self) -> &'static str {
        match self {
            QuotaFileError::Read { .. } => "quota_file_read",
            QuotaFileError::Parse { .. } => "quota_file_parse",
        }
    }
}

/// Quotas of all tenants. An empty book enforces nothing.
///
/// File format (TOML; unknown keys refused):
///
/// ```toml
/// [tenants.team-a]
/// guaranteed = { memory_mib = 143771, compute = 700 }   # one H200
/// borrow_limit = { memory_mib = 71885, compute = 300 }  # optional
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaBook {
    #[serde(default)]
    pub tenants: BTreeMap<TenantId, TenantQuota>,
}

impl QuotaBook {
    /// Parses a quota file; `file` names the source in errors.
    pub fn from_toml(text: &str, file: &str) -> Result<Self, QuotaFileError> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            let (line, column) =
                crate::inventory::line_column(text, e.span().map_or(0, |s| s.start));
            QuotaFileError::Parse {
                file: file.to_owned(),
                line,
                column,
                message: e.message().trim().to_owned(),
            }
        })
    }

    /// Reads a quota file.
    pub fn load(path: &std::path::Path) -> Result<Self, QuotaFileError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| QuotaFileError::Read {
            file: file.clone(),
            source,
        })?;
        Self::from_toml(&text, &file)
    }

    pub fn unlimited() -> Self {
        QuotaBook::default()
    }

    pub fn with(mut self, tenant: TenantId, quota: TenantQuota) -> Self {
        self.tenants.insert(tenant, quota);
        self
    }

    pub fn enforced(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// Current holdings of every tenant in `ledger`.
    pub fn usage(inventory: &Inventory, ledger: &Ledger) -> BTreeMap<TenantId, Amount> {
        let mut usage: BTreeMap<TenantId, Amount> = BTreeMap::new();
        for allocation in ledger.allocations() {
            let Some(tenant) = &allocation.tenant else {
                continue;
            };
            let entry = usage.entry(tenant.clone()).or_default();
            for share in &allocation.shares {
                if let Some(gpu) = inventory.gpu(share.gpu) {
                    *entry = entry.plus(share_charge(gpu, &share.kind));
                }
            }
        }
        usage
    }

    /// Whether `tenant` may hold `holds + adding`, and how.
    pub fn admit(
        &self,
        tenant: Option<&TenantId>,
        holds: Amount,
        adding: Amount,
    ) -> Result<Standing, QuotaError> {
        if !self.enforced() {
            return Ok(Standing::Unlimited);
        }
        let tenant = tenant.ok_or(QuotaError::TenantRequired)?;
        let quota = self
            .tenants
            .get(tenant)
            .ok_or_else(|| QuotaError::NoQuota {
                tenant: tenant.clone(),
            })?;
        let total = holds.plus(adding);
        let ceiling = quota.ceiling();
        for (dimension, unit, would_hold, limit) in [
            ("memory", "MiB", total.memory_mib, ceiling.memory_mib),
            ("compute", "units", total.compute, ceiling.compute),
        ] {
            if would_hold > limit {
                return Err(QuotaError::Exceeded {
                    tenant: tenant.clone(),
                    dimension,
                    unit,
                    would_hold,
                    limit,
                });
            }
        }
        Ok(if total.within(quota.guaranteed) {
            Standing::Guaranteed
        } else {
            Standing::Borrowing
        })
    }

    /// Allocations that may be evicted to give capacity back to its owners, in eviction order:
    /// for each tenant above its guarantee, its newest allocations while it is still above it.
    /// Tenants in `spare` (the requester) are never listed.
    pub fn reclaimable(
        &self,
        inventory: &Inventory,
        ledger: &Ledger,
        spare: &[&TenantId],
    ) -> Vec<AllocationId> {
        let mut usage = Self::usage(inventory, ledger);
        let mut out = Vec::new();
        let mut newest_first: Vec<_> = ledger.allocations().collect();
        newest_first.sort_by_key(|a| std::cmp::Reverse(a.id));
        for allocation in newest_first {
            let Some(tenant) = &allocation.tenant else {
                continue;
            };
            if spare.contains(&tenant) {
                continue;
            }
            let Some(quota) = self.tenants.get(tenant) else {
                continue;
            };
            let Some(holds) = usage.get_mut(tenant) else {
                continue;
            };
            if holds.within(quota.guaranteed) {
                continue;
            }
            let charge = allocation
                .shares
                .iter()
                .filter_map(|s| inventory.gpu(s.gpu).map(|g| share_charge(g, &s.kind)))
                .fold(Amount::default(), Amount::plus);
            *holds = holds.saturating_sub(charge);
            out.push(allocation.id);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::GpuIndex;
    use crate::mig::MigInstance;

    fn gpu() -> Gpu {
        Gpu {
            index: GpuIndex(0),
            uuid: crate::ids::GpuUuid::new("GPU-0").unwrap(),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
            mig_capable: true,
            mig_model: Some(crate::mig::MigModel::H100Gb80),
            mig_geometry: Some(crate::mig::MigModel::H100Gb80.geometry()),
            numa_node: Some(0),
            pci_bus_id: "0000:01:00.0".into(),
            minor: 0,
            initial_mode: crate::partition::PartitionMode::Whole,
            mps_max_clients: 48,
            timeslice_replicas: 3,
        }
    }

    fn t(name: &str) -> TenantId {
        TenantId::new(name).unwrap()
    }

    #[test]
    fn charges_are_exact_in_compute_units() {
        let g = gpu();
        assert_eq!(share_charge(&g, &ShareKind::Whole).compute, 700);
        let mig3 = ShareKind::Mig {
            instance: MigInstance {
                profile_id: 9,
                start: 4,
            },
        };
        assert_eq!(
            share_charge(&g, &mig3),
            Amount {
                memory_mib: 40779,
                compute: 300
            }
        );
        let mps = ShareKind::Mps {
            compute_pct: 25,
            memory_mib: 2048,
        };
        assert_eq!(share_charge(&g, &mps).compute, 175);
        // 3 replicas: 700/3 rounded up
        assert_eq!(share_charge(&g, &ShareKind::Timeslice).compute, 234);
    }

    #[test]
    fn admit_distinguishes_guarantee_borrowing_and_excess() {
        let book = QuotaBook::unlimited().with(
            t("a"),
            TenantQuota {
                guaranteed: Amount {
                    memory_mib: 1000,
                    compute: 700,
                },
                borrow_limit: Some(Amount {
                    memory_mib: 500,
                    compute: 0,
                }),
            },
        );
        let a = t("a");
        let add = |m| Amount {
            memory_mib: m,
            compute: 100,
        };
        assert_eq!(
            book.admit(Some(&a), Amount::default(), add(900)),
            Ok(Standing::Guaranteed)
        );
        assert_eq!(
            book.admit(Some(&a), Amount::default(), add(1200)),
            Ok(Standing::Borrowing)
        );
        let e = book.admit(Some(&a), add(1000), add(600)).unwrap_err();
        assert!(matches!(
            e,
            QuotaError::Exceeded {
                dimension: "memory",
                would_hold: 1600,
                limit: 1500,
                ..
            }
        ));
        assert_eq!(
            book.admit(None, Amount::default(), add(1))
                .unwrap_err()
                .code(),
            "quota_tenant_required"
        );
        assert_eq!(
            book.admit(Some(&t("b")), Amount::default(), add(1))
                .unwrap_err()
                .code(),
            "quota_none"
        );
        assert_eq!(
            QuotaBook::unlimited().admit(None, Amount::default(), add(1 << 40)),
            Ok(Standing::Unlimited)
        );
    }

    #[test]
    fn quota_book_reads_from_toml_strictly() {
        let book: QuotaBook = toml::from_str(
            "[tenants.team-a]\nguaranteed = { memory_mib = 81920, compute = 700 }\nborrow_limit = { memory_mib = 1024, compute = 100 }\n",
        )
        .unwrap();
        assert_eq!(book.tenants[&t("team-a")].ceiling().compute, 800);
        let err = QuotaBook::from_toml(
            "[tenants.team-a]\nguaranteed = { memory_mib = 1, compute = 1, gpus = 2 }\n",
            "q.toml",
        )
        .unwrap_err();
        assert_eq!(err.code(), "quota_file_parse");
        assert!(err.to_string().starts_with("q.toml:2:"), "{err}");
        assert!(err.to_string().contains("gpus"), "{err}");
        let err = QuotaBook::from_toml(
            "[tenants.\"team a\"]\nguaranteed = { memory_mib = 1, compute = 1 }\n",
            "q.toml",
        )
        .unwrap_err();
        assert!(err.to_string().contains("tenant id"), "{err}");
        assert_eq!(
            QuotaBook::load(std::path::Path::new("/nonexistent/q.toml"))
                .unwrap_err()
                .code(),
            "quota_file_read"
        );
    }
}
