//! What `torpor gpu plan` and `torpor gpu ls` print, and the allocation metrics.
//!
//! The binary only reads files and arguments; the lines, tables and metrics are built here so
//! they can be tested without it.
//!
//! `plan` reads one JSON request per line and answers one JSON line per request, each request
//! seeing the placements of the ones before it:
//! `{"request": i, "placed": true, "devices": [...]}` or
//! `{"request": i, "placed": false, "reason": {"code": "...", "message": "..."}}`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::inventory::Inventory;
use crate::ledger::Ledger;
use crate::partition::PartitionMode;
use crate::planner::{commit, describe, plan, PlacedDevice, Policy, RefusalReport};
use crate::quota::{QuotaBook, COMPUTE_PER_GPU};
use crate::request::GpuRequest;

/// Longest request line accepted by [`plan_lines`].
pub const MAX_REQUEST_LINE: usize = 64 * 1024;

/// One output line of `torpor gpu plan --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanLine {
    pub request: usize,
    pub placed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<PlacedDevice>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<RefusalReport>,
}

fn refused(request: usize, code: &'static str, message: String) -> PlanLine {
    PlanLine {
        request,
        placed: false,
        devices: None,
        reason: Some(RefusalReport { code, message }),
    }
}

/// Applies requests (one JSON object per line; blank lines and `#` comments skipped) in
/// order on `ledger`. Request numbers count the requests, from 0. A line that is not a valid
/// request is refused with code `request_malformed` and does not stop the stream.
pub fn plan_lines(
    inventory: &Inventory,
    ledger: &mut Ledger,
    text: &str,
    policy: &Policy,
    quotas: &QuotaBook,
) -> Vec<PlanLine> {
    let mut out = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let index = out.len();
        if line.len() > MAX_REQUEST_LINE {
            out.push(refused(
                index,
                "request_malformed",
                format!("line {}: longer than {MAX_REQUEST_LINE} bytes", line_no + 1),
            ));
            continue;
        }
        let request: GpuRequest = match serde_json::from_str(line) {
            Ok(r) => r,
            Err(e) => {
                out.push(refused(
                    index,
                    "request_malformed",
                    format!("line {}: {e}", line_no + 1),
                ));
                continue;
            }
        };
        let result = plan(inventory, ledger, &request, policy, quotas).and_then(|p| {
            commit(inventory, ledger, &p, policy)?;
            Ok(p)
        });
        out.push(match result {
            Ok(p) => PlanLine {
                request: index,
                placed: true,
                devices: Some(p.shares().map(|s| describe(inventory, s)).collect()),
                reason: None,
            },
            Err(refusal) => PlanLine {
                request: index,
                placed: false,
                devices: None,
                reason: Some(refusal.report()),
            },
        });
    }
    out
}

/// Free capacity of one GPU in its current mode, in words.
fn free_text(gpu: &crate::inventory::Gpu, usage: &crate::ledger::GpuUsage) -> String {
    match usage.mode {
        PartitionMode::Whole => if usage.is_empty() { "whole" } else { "-" }.to_owned(),
        PartitionMode::Mig => match &usage.mig {
            Some(layout) => format!(
                "{}/{} mem slices, {}/{} SM slices",
                layout.free_memory_slices(),
                crate::mig::MEMORY_SLICES,
                layout
                    .geometry()
                    .sm_slices()
                    .saturating_sub(layout.used_sm_slices()),
                layout.geometry().sm_slices()
            ),
            None => "-".to_owned(),
        },
        PartitionMode::Mps => format!(
            "{}% compute, {} MiB, {} clients",
            100 - usage.mps_compute_pct.min(100),
            gpu.memory_mib.saturating_sub(usage.mps_memory_mib),
            gpu.mps_max_clients.saturating_sub(usage.shares)
        ),
        PartitionMode::Timeslice => format!(
            "{}/{} replicas",
            gpu.timeslice_replicas.saturating_sub(usage.shares),
            gpu.timeslice_replicas
        ),
    }
}

/// One GPU as `torpor gpu ls --json` and `GET /v1/gpus` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRow {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    /// MIG geometry label when the GPU can be partitioned with MIG.
    pub mig: Option<String>,
    pub mode: PartitionMode,
    pub shares: u32,
    /// How full the GPU is in its mode, in thousandths.
    pub fill_permille: u32,
    /// Free capacity in the GPU's mode, by resource (the `resource` label of `torpor_gpu_free`).
    pub free: BTreeMap<&'static str, u64>,
}

/// Free capacity of one GPU in its current mode, by resource.
pub fn free_resources(
    gpu: &crate::inventory::Gpu,
    usage: &crate::ledger::GpuUsage,
) -> Vec<(&'static str, u64)> {
    match usage.mode {
        PartitionMode::Whole => vec![("whole_gpus", u64::from(usage.is_empty()))],
        PartitionMode::Mig => usage.mig.as_ref().map_or(Vec::new(), |l| {
            vec![
                ("mig_memory_slices", u64::from(l.free_memory_slices())),
                (
                    "mig_sm_slices",
                    u64::from(l.geometry().sm_slices().saturating_sub(l.used_sm_slices())),
                ),
            ]
        }),
        PartitionMode::Mps => vec![
            (
                "mps_compute_pct",
                u64::from(100u32.saturating_sub(usage.mps_compute_pct)),
            ),
            (
                "mps_memory_mib",
                gpu.memory_mib.saturating_sub(usage.mps_memory_mib),
            ),
            (
                "mps_clients",
                u64::from(gpu.mps_max_clients.saturating_sub(usage.shares)),
            ),
        ],
        PartitionMode::Timeslice => vec![(
            "timeslice_replicas",
            u64::from(gpu.timeslice_replicas.saturating_sub(usage.shares)),
        )],
    }
}

/// The rows of `torpor gpu ls --json`.
pub fn gpu_rows(inventory: &Inventory, ledger: &Ledger) -> Vec<GpuRow> {
    inventory
        .gpus()
        .iter()
        .zip(ledger.usage())
        .map(|(gpu, usage)| GpuRow {
            index: gpu.index.0,
            uuid: gpu.uuid.to_string(),
            model: gpu.model.clone(),
            memory_mib: gpu.memory_mib,
            numa_node: gpu.numa_node,
            pci_bus_id: gpu.pci_bus_id.clone(),
            mig: gpu
                .mig_ready()
                .then(|| gpu.mig_geometry.as_ref().map(|g| g.label().to_owned()))
                .flatten(),
            mode: usage.mode,
            shares: usage.shares,
            fill_permille: usage.fill_permille(gpu),
            free: free_resources(gpu, usage).into_iter().collect(),
        })
        .collect()
}

/// The table `torpor gpu ls` prints.
pub fn inventory_table(inventory: &Inventory, ledger: &Ledger) -> String {
    let mut rows = vec![[
        "GPU".to_owned(),
        "MODEL".to_owned(),
        "MEMORY".to_owned(),
        "NUMA".to_owned(),
        "MIG".to_owned(),
        "MODE".to_owned(),
        "SHARES".to_owned(),
        "FREE".to_owned(),
    ]];
    for (gpu, usage) in inventory.gpus().iter().zip(ledger.usage()) {
        rows.push([
            gpu.index.0.to_string(),
            gpu.model.clone(),
            format!("{} MiB", gpu.memory_mib),
            gpu.numa_node.map_or("-".to_owned(), |n| n.to_string()),
            gpu.mig_model
                .map_or("-".to_owned(), |m| m.label().to_owned()),
            usage.mode.to_string(),
            usage.shares.to_string(),
            free_text(gpu, usage),
        ]);
    }
    let mut widths = [0usize; 8];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Allocation metrics in the Prometheus text format: shares and free capacity by GPU and
/// mode, and quota use by tenant. These exist with or without a driver.
pub fn allocation_metrics(inventory: &Inventory, ledger: &Ledger, quotas: &QuotaBook) -> String {
    let node = escape_label(inventory.node.as_str());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_shares Shares allocated on a GPU.\n# TYPE torpor_gpu_shares gauge"
    );
    for (gpu, usage) in inventory.gpus().iter().zip(ledger.usage()) {
        let _ = writeln!(
            out,
            "torpor_gpu_shares{{node=\"{node}\",gpu=\"{}\",UUID=\"{}\",mode=\"{}\"}} {}",
            gpu.index.0,
            escape_label(gpu.uuid.as_str()),
            usage.mode,
            usage.shares
        );
    }
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_fill_ratio How full a GPU is in its mode (0 to 1).\n# TYPE torpor_gpu_fill_ratio gauge"
    );
    for (gpu, usage) in inventory.gpus().iter().zip(ledger.usage()) {
        let _ = writeln!(
            out,
            "torpor_gpu_fill_ratio{{node=\"{node}\",gpu=\"{}\",UUID=\"{}\",mode=\"{}\"}} {}",
            gpu.index.0,
            escape_label(gpu.uuid.as_str()),
            usage.mode,
            f64::from(usage.fill_permille(gpu)) / 1000.0
        );
    }
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_free Free capacity of a GPU in its mode.\n# TYPE torpor_gpu_free gauge"
    );
    for (gpu, usage) in inventory.gpus().iter().zip(ledger.usage()) {
        let free = free_resources(gpu, usage);
        for (resource, value) in free {
            let _ = writeln!(
                out,
                "torpor_gpu_free{{node=\"{node}\",gpu=\"{}\",UUID=\"{}\",mode=\"{}\",resource=\"{resource}\"}} {value}",
                gpu.index.0,
                escape_label(gpu.uuid.as_str()),
                usage.mode
            );
        }
    }
    let mut by_mode: BTreeMap<PartitionMode, (u32, u32)> = BTreeMap::new();
    for usage in ledger.usage() {
        let entry = by_mode.entry(usage.mode).or_default();
        entry.0 += usage.shares;
        entry.1 += u32::from(usage.is_empty());
    }
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_empty_gpus GPUs with no share, by mode.\n# TYPE torpor_gpu_empty_gpus gauge"
    );
    for mode in PartitionMode::ALL {
        let (_, empty) = by_mode.get(&mode).copied().unwrap_or_default();
        let _ = writeln!(
            out,
            "torpor_gpu_empty_gpus{{node=\"{node}\",mode=\"{mode}\"}} {empty}"
        );
    }
    let usage = QuotaBook::usage(inventory, ledger);
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_quota_used Quota used by a tenant (memory in MiB, compute in units of 1/{COMPUTE_PER_GPU} GPU).\n# TYPE torpor_gpu_quota_used gauge"
    );
    for (tenant, amount) in &usage {
        let t = escape_label(tenant.as_str());
        let _ = writeln!(
            out,
            "torpor_gpu_quota_used{{tenant=\"{t}\",resource=\"memory_mib\"}} {}\ntorpor_gpu_quota_used{{tenant=\"{t}\",resource=\"compute\"}} {}",
            amount.memory_mib, amount.compute
        );
    }
    let _ = writeln!(
        out,
        "# HELP torpor_gpu_quota_guaranteed A tenant's guaranteed quota.\n# TYPE torpor_gpu_quota_guaranteed gauge"
    );
    for (tenant, quota) in &quotas.tenants {
        let t = escape_label(tenant.as_str());
        let _ = writeln!(
            out,
            "torpor_gpu_quota_guaranteed{{tenant=\"{t}\",resource=\"memory_mib\"}} {}\ntorpor_gpu_quota_guaranteed{{tenant=\"{t}\",resource=\"compute\"}} {}",
            quota.guaranteed.memory_mib, quota.guaranteed.compute
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::TenantId;
    use crate::quota::{Amount, TenantQuota};

    fn a100() -> Inventory {
        Inventory::from_toml(
            r#"
node = "a"
[[gpu]]
index = 0
uuid = "GPU-a0"
model = "NVIDIA A100 80GB PCIe"
memory_mib = 81920
mig_capable = true
numa_node = 0
pci_bus_id = "0000:17:00.0"
[[gpu]]
index = 1
uuid = "GPU-a1"
model = "NVIDIA A100 80GB PCIe"
memory_mib = 81920
mig_capable = true
numa_node = 0
pci_bus_id = "0000:31:00.0"
topology = "GPU0 GPU1\nGPU0 X NV12\nGPU1 NV12 X"
"#,
            "a.toml",
        )
        .unwrap()
    }

    #[test]
    fn plan_lines_prints_the_documented_shapes() {
        let inv = a100();
        let mut ledger = Ledger::new(&inv);
        let input = "\
{\"count\":1,\"mode\":\"mig\",\"profile\":\"3g.40gb\"}
# a comment

{\"count\":1,\"mode\":\"mig\",\"profile\":\"3g.71gb\"}
not json
{\"count\":2,\"mode\":\"whole\"}
";
        let lines = plan_lines(
            &inv,
            &mut ledger,
            input,
            &Policy::default(),
            &QuotaBook::unlimited(),
        );
        let json: Vec<String> = lines
            .iter()
            .map(|l| serde_json::to_string(l).unwrap())
            .collect();
        assert_eq!(
            json[0],
            r#"{"request":0,"placed":true,"devices":[{"gpu_index":0,"gpu_uuid":"GPU-a0","mode":"mig","profile":"3g.40gb","start":4}]}"#
        );
        assert!(
            json[1].starts_with(
                r#"{"request":1,"placed":false,"reason":{"code":"unknown_profile","message":"#
            ),
            "{}",
            json[1]
        );
        assert!(
            json[2].contains(r#""code":"request_malformed""#) && json[2].contains("line 5"),
            "{}",
            json[2]
        );
        assert!(
            json[3].contains(r#""code":"no_capacity""#),
            "GPU0 is in MIG mode with a share: {}",
            json[3]
        );
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn table_shows_modes_and_free_capacity() {
        let inv = a100();
        let mut ledger = Ledger::new(&inv);
        plan_lines(
            &inv,
            &mut ledger,
            "{\"mode\":\"mig\",\"profile\":\"2g.20gb\"}\n{\"mode\":\"mps\",\"compute_pct\":30,\"memory_mib\":1000}",
            &Policy::default(),
            &QuotaBook::unlimited(),
        );
        let table = inventory_table(&inv, &ledger);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("GPU  MODEL"));
        assert!(
            lines[1].contains("mig") && lines[1].contains("6/8 mem slices, 5/7 SM slices"),
            "{table}"
        );
        assert!(
            lines[2].contains("mps") && lines[2].contains("70% compute, 80920 MiB, 47 clients"),
            "{table}"
        );
    }

    #[test]
    fn metrics_cover_shares_and_quotas() {
        let inv = a100();
        let mut ledger = Ledger::new(&inv);
        let tenant = TenantId::new("team-a").unwrap();
        let quotas = QuotaBook::unlimited().with(
            tenant,
            TenantQuota {
                guaranteed: Amount {
                    memory_mib: 81920,
                    compute: 700,
                },
                borrow_limit: None,
            },
        );
        plan_lines(
            &inv,
            &mut ledger,
            "{\"mode\":\"mps\",\"compute_pct\":50,\"memory_mib\":2048,\"tenant\":\"team-a\"}",
            &Policy::default(),
            &quotas,
        );
        let text = allocation_metrics(&inv, &ledger, &quotas);
        assert!(
            text.contains("torpor_gpu_shares{node=\"a\",gpu=\"0\",UUID=\"GPU-a0\",mode=\"mps\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "torpor_gpu_fill_ratio{node=\"a\",gpu=\"0\",UUID=\"GPU-a0\",mode=\"mps\"} 0.5"
            ),
            "{text}"
        );
        assert!(
            text.contains("torpor_gpu_empty_gpus{node=\"a\",mode=\"whole\"} 1"),
            "{text}"
        );
        for line in [
            "torpor_gpu_free{node=\"a\",gpu=\"0\",UUID=\"GPU-a0\",mode=\"mps\",resource=\"mps_compute_pct\"} 50",
            "torpor_gpu_free{node=\"a\",gpu=\"0\",UUID=\"GPU-a0\",mode=\"mps\",resource=\"mps_memory_mib\"} 79872",
            "torpor_gpu_free{node=\"a\",gpu=\"1\",UUID=\"GPU-a1\",mode=\"whole\",resource=\"whole_gpus\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(
            text.contains("torpor_gpu_quota_used{tenant=\"team-a\",resource=\"compute\"} 350"),
            "{text}"
        );
        assert!(
            text.contains(
                "torpor_gpu_quota_guaranteed{tenant=\"team-a\",resource=\"memory_mib\"} 81920"
            ),
            "{text}"
        );
    }
}
