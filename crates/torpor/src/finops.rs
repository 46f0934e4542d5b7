//! `torpor report`: what tenants' agents cost over a window, priced by the operator's price
//! sheet (TOML), against what the same agents would have cost with one always-resident
//! sandbox each and with a whole GPU each — both computed from the measured usage
//! (`GET /v1/usage`), not assumed. A table for the terminal, `--json`, and `--html FILE`: a
//! self-contained page (inline SVG, no scripts, no network) readable on a phone.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};
use torpor_control::usage::{UsageReport, UsageRow};

use crate::common::{client, print_json, CliError, CliResult, Conn};

/// Hours in the month storage prices are quoted for.
const HOURS_PER_MONTH: f64 = 730.0;
const RESIDENT_TIERS: [&str; 2] = ["running", "frozen"];

/// The operator's price sheet.
///
/// ```toml
/// currency = "USD"
/// memory_gib_hour = 0.005
/// vcpu_hour = 0.04
/// storage_gib_month = 0.10
/// gpu_hour_default = 2.0      # a model not listed below (optional)
/// [gpu_hour]                  # one whole GPU for an hour; a share pays its fraction
/// "NVIDIA H200" = 3.5
/// ```
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PriceSheet {
    #[serde(default = "default_currency")]
    pub currency: String,
    pub memory_gib_hour: f64,
    pub vcpu_hour: f64,
    pub storage_gib_month: f64,
    #[serde(default)]
    pub gpu_hour: BTreeMap<String, f64>,
    #[serde(default)]
    pub gpu_hour_default: Option<f64>,
}

fn default_currency() -> String {
    "USD".into()
}

impl PriceSheet {
    pub fn load(path: &Path) -> Result<PriceSheet, CliError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError(format!("prices {}: {e}", path.display())))?;
        let sheet: PriceSheet = toml::from_str(&text)
            .map_err(|e| CliError(format!("prices {}: {e}", path.display())))?;
        let all = [
            ("memory_gib_hour", sheet.memory_gib_hour),
            ("vcpu_hour", sheet.vcpu_hour),
            ("storage_gib_month", sheet.storage_gib_month),
        ]
        .into_iter()
        .chain(sheet.gpu_hour.iter().map(|(m, p)| (m.as_str(), *p)))
        .chain(sheet.gpu_hour_default.map(|p| ("gpu_hour_default", p)));
        for (name, p) in all {
            if !(p.is_finite() && p >= 0.0) {
                return Err(CliError(format!(
                    "prices {}: {name} must be a price of zero or more",
                    path.display()
                )));
            }
        }
        Ok(sheet)
    }

    /// The price of one whole GPU of `model` for an hour.
    fn gpu(&self, model: &str) -> Result<f64, CliError> {
        self.gpu_hour
            .get(model)
            .copied()
            .or(self.gpu_hour_default)
            .ok_or_else(|| {
                CliError(format!(
                    "prices: no gpu_hour for {model:?} and no gpu_hour_default"
                ))
            })
    }
}

#[derive(Args)]
pub struct ReportArgs {
    /// Start: Unix seconds, or an age such as `24h`, `7d` (default: 30 days ago).
    #[arg(long)]
    from: Option<String>,
    /// End (exclusive): Unix seconds or an age (default: now).
    #[arg(long)]
    to: Option<String>,
    /// One tenant (a tenant's token sees only its own).
    #[arg(long)]
    tenant: Option<String>,
    /// The price sheet (TOML).
    #[arg(long)]
    prices: PathBuf,
    /// Also write the report as a self-contained HTML page.
    #[arg(long, value_name = "FILE.html")]
    html: Option<PathBuf>,
    #[command(flatten)]
    conn: Conn,
}

/// Cost of one group (a tenant, an agent, everything), in the sheet's currency.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Cost {
    pub memory: f64,
    pub cpu: f64,
    pub gpu: f64,
    pub storage: f64,
    pub total: f64,
    /// The same agents with one sandbox each, resident all their agent-hours (their measured
    /// mean resident memory, their GPU share held throughout).
    pub always_resident: f64,
    /// As `always_resident`, with a whole GPU of its model for every agent that used one.
    pub whole_gpu_each: f64,
}

impl Cost {
    fn add(&mut self, o: &Cost) {
        self.memory += o.memory;
        self.cpu += o.cpu;
        self.gpu += o.gpu;
        self.storage += o.storage;
        self.total += o.total;
        self.always_resident += o.always_resident;
        self.whole_gpu_each += o.whole_gpu_each;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AgentCost {
    pub tenant: String,
    pub sandbox: String,
    pub agent_hours: f64,
    pub resident_hours: f64,
    pub memory_gib_hours: f64,
    pub cpu_seconds: f64,
    /// CPU-seconds per resident second (1.0: one vCPU busy throughout).
    pub cpu_utilisation: f64,
    /// GiB-hours held while resident and idle: memory × (1 - CPU utilisation).
    pub idle_resident_gib_hours: f64,
    pub cost: Cost,
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantCost {
    pub tenant: String,
    pub agents: usize,
    pub agent_hours: f64,
    pub cost: Cost,
    pub cost_per_agent_hour: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DensityPoint {
    pub interval_start_s: i64,
    pub agents: usize,
    /// Agents resident on average over the part of the interval they existed.
    pub resident: f64,
}

/// GPU use of one kind of share (`mig:3g.71gb` of an `NVIDIA H200`), or of one agent's share.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct GpuShareCost {
    pub share: String,
    pub model: String,
    /// GPUs × hours held (a 3g MIG slice for an hour is 3/7).
    pub gpu_hours: f64,
    pub cost: f64,
    /// Mean utilisation (0–1) of the held device over the GPU-hours it was read for
    /// (`DCGM_FI_DEV_GPU_UTIL`); `null`: never read (a declared inventory, a MIG instance,
    /// a GPU shared by several sandboxes).
    pub utilisation: Option<f64>,
    /// The GPU-hours the utilisation was read for (at most `gpu_hours`).
    pub measured_gpu_hours: f64,
    /// Of the measured GPU-hours, those the device was idle: measured × (1 − utilisation).
    pub idle_gpu_hours: Option<f64>,
    /// What the idle GPU-hours cost.
    pub idle_cost: Option<f64>,
    /// Mean framebuffer used (GiB) while it was read (`DCGM_FI_DEV_FB_USED`), MIG included.
    pub mean_fb_used_gib: Option<f64>,
}

/// One agent's GPU share, for the list of shares held idle.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GpuHolder {
    pub tenant: String,
    pub sandbox: String,
    #[serde(flatten)]
    pub share: GpuShareCost,
}

/// Sums of one share's GPU measures.
#[derive(Default)]
struct ShareSums {
    gpu_hours: f64,
    cost: f64,
    price: f64,
    util_sampled: f64,
    busy: f64,
    fb_sampled: f64,
    fb_gib_hours: f64,
}

impl ShareSums {
    fn add(&mut self, o: &ShareSums) {
        self.gpu_hours += o.gpu_hours;
        self.cost += o.cost;
        self.price = o.price;
        self.util_sampled += o.util_sampled;
        self.busy += o.busy;
        self.fb_sampled += o.fb_sampled;
        self.fb_gib_hours += o.fb_gib_hours;
    }

    fn report(&self, share: &str, model: &str) -> GpuShareCost {
        let utilisation =
            (self.util_sampled > 0.0).then(|| (self.busy / self.util_sampled).clamp(0.0, 1.0));
        let idle = utilisation.map(|u| self.util_sampled * (1.0 - u));
        GpuShareCost {
            share: share.into(),
            model: model.into(),
            gpu_hours: self.gpu_hours,
            cost: self.cost,
            utilisation,
            measured_gpu_hours: self.util_sampled,
            idle_gpu_hours: idle,
            idle_cost: idle.map(|h| h * self.price),
            mean_fb_used_gib: (self.fb_sampled > 0.0).then(|| self.fb_gib_hours / self.fb_sampled),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FinopsReport {
    pub from_s: i64,
    pub to_s: i64,
    pub prices: PriceSheet,
    pub tenants: Vec<TenantCost>,
    pub total: Cost,
    /// Baseline cost over torpor's cost (how many times cheaper sharing and sleeping made it).
    pub savings_vs_always_resident: f64,
    pub savings_vs_whole_gpu_each: f64,
    pub density: Vec<DensityPoint>,
    pub gpu_shares: Vec<GpuShareCost>,
    /// The agents' GPU shares, the most idle cost first, then the most GPU-hours (at most 10).
    pub gpu_holders: Vec<GpuHolder>,
    /// The agents that held the most memory while idle, most first (at most 10).
    pub top_idle_resident: Vec<AgentCost>,
}

fn sum(m: &BTreeMap<String, f64>) -> f64 {
    m.values().fold(0.0, |a, b| a + b)
}

fn resident_hours(r: &UsageRow) -> f64 {
    RESIDENT_TIERS
        .iter()
        .map(|t| r.tier_hours.get(*t).copied().unwrap_or(0.0))
        .sum()
}

/// `share@model` into its parts.
fn split_gpu_dim(dim: &str) -> (&str, &str) {
    dim.split_once('@').unwrap_or((dim, "unknown"))
}

fn ratio(baseline: f64, actual: f64) -> f64 {
    if actual > 0.0 {
        baseline / actual
    } else {
        0.0
    }
}

/// Prices `usage` (rows grouped by sandbox and interval).
pub fn price(usage: &UsageReport, prices: &PriceSheet) -> Result<FinopsReport, CliError> {
    // One agent: the sum of its intervals.
    let mut agents: BTreeMap<(String, String), UsageRow> = BTreeMap::new();
    let mut density: BTreeMap<i64, (usize, f64, f64)> = BTreeMap::new();
    for r in &usage.rows {
        let sandbox = r.sandbox.clone().unwrap_or_default();
        let a = agents
            .entry((r.tenant.clone(), sandbox.clone()))
            .or_insert_with(|| UsageRow {
                tenant: r.tenant.clone(),
                sandbox: Some(sandbox),
                ..Default::default()
            });
        for (k, v) in &r.memory_gib_hours {
            *a.memory_gib_hours.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &r.tier_hours {
            *a.tier_hours.entry(k.clone()).or_default() += v;
        }
        for (src, dst) in [
            (&r.gpu_hours, &mut a.gpu_hours),
            (&r.gpu_util_sampled_hours, &mut a.gpu_util_sampled_hours),
            (&r.gpu_busy_hours, &mut a.gpu_busy_hours),
            (&r.gpu_fb_sampled_hours, &mut a.gpu_fb_sampled_hours),
            (&r.gpu_fb_used_gib_hours, &mut a.gpu_fb_used_gib_hours),
        ] {
            for (k, v) in src {
                *dst.entry(k.clone()).or_default() += v;
            }
        }
        for (k, v) in &r.wakes {
            *a.wakes.entry(k.clone()).or_default() += v;
        }
        a.cpu_seconds += r.cpu_seconds;
        a.snapshot_gib_hours += r.snapshot_gib_hours;
        a.egress_bytes += r.egress_bytes;
        if let Some(start) = r.interval_start_s {
            let d = density.entry(start).or_default();
            d.0 += 1;
            d.1 += resident_hours(r);
            d.2 += sum(&r.tier_hours);
        }
    }
    let mut costs = Vec::new();
    let mut shares: BTreeMap<(String, String), ShareSums> = BTreeMap::new();
    let mut holders = Vec::new();
    for ((tenant, sandbox), a) in &agents {
        let agent_hours = sum(&a.tier_hours);
        let resident = resident_hours(a);
        let mem_gib_h = sum(&a.memory_gib_hours);
        let mut gpu = 0.0;
        let mut gpu_held_always = 0.0;
        let mut whole_gpu = 0.0;
        for (dim, h) in &a.gpu_hours {
            let (share, model) = split_gpu_dim(dim);
            let p = prices.gpu(model)?;
            gpu += h * p;
            let of = |m: &BTreeMap<String, f64>| m.get(dim).copied().unwrap_or(0.0);
            let held = ShareSums {
                gpu_hours: *h,
                cost: h * p,
                price: p,
                util_sampled: of(&a.gpu_util_sampled_hours),
                busy: of(&a.gpu_busy_hours),
                fb_sampled: of(&a.gpu_fb_sampled_hours),
                fb_gib_hours: of(&a.gpu_fb_used_gib_hours),
            };
            shares
                .entry((share.into(), model.into()))
                .or_default()
                .add(&held);
            holders.push(GpuHolder {
                tenant: tenant.clone(),
                sandbox: sandbox.clone(),
                share: held.report(share, model),
            });
            if resident > 0.0 {
                gpu_held_always += h / resident * agent_hours * p;
            }
            whole_gpu = f64::max(whole_gpu, agent_hours * p);
        }
        let memory = mem_gib_h * prices.memory_gib_hour;
        let cpu = a.cpu_seconds / 3600.0 * prices.vcpu_hour;
        let storage = a.snapshot_gib_hours / HOURS_PER_MONTH * prices.storage_gib_month;
        let mean_resident_gib = if resident > 0.0 {
            mem_gib_h / resident
        } else {
            0.0
        };
        let resident_all_along = mean_resident_gib * agent_hours * prices.memory_gib_hour + cpu;
        let utilisation = if resident > 0.0 {
            a.cpu_seconds / (resident * 3600.0)
        } else {
            0.0
        };
        costs.push(AgentCost {
            tenant: tenant.clone(),
            sandbox: sandbox.clone(),
            agent_hours,
            resident_hours: resident,
            memory_gib_hours: mem_gib_h,
            cpu_seconds: a.cpu_seconds,
            cpu_utilisation: utilisation,
            idle_resident_gib_hours: mem_gib_h * (1.0 - utilisation.min(1.0)),
            cost: Cost {
                memory,
                cpu,
                gpu,
                storage,
                total: memory + cpu + gpu + storage,
                always_resident: resident_all_along + gpu_held_always,
                whole_gpu_each: resident_all_along
                    + if a.gpu_hours.is_empty() {
                        0.0
                    } else {
                        whole_gpu
                    },
            },
        });
    }
    let mut tenants: BTreeMap<String, TenantCost> = BTreeMap::new();
    let mut total = Cost::default();
    for c in &costs {
        let t = tenants
            .entry(c.tenant.clone())
            .or_insert_with(|| TenantCost {
                tenant: c.tenant.clone(),
                agents: 0,
                agent_hours: 0.0,
                cost: Cost::default(),
                cost_per_agent_hour: 0.0,
            });
        t.agents += 1;
        t.agent_hours += c.agent_hours;
        t.cost.add(&c.cost);
        total.add(&c.cost);
    }
    for t in tenants.values_mut() {
        t.cost_per_agent_hour = ratio(t.cost.total, t.agent_hours);
    }
    let mut idle = costs;
    idle.sort_by(|a, b| {
        b.idle_resident_gib_hours
            .total_cmp(&a.idle_resident_gib_hours)
    });
    idle.truncate(10);
    holders.sort_by(|a, b| {
        b.share
            .idle_cost
            .unwrap_or(0.0)
            .total_cmp(&a.share.idle_cost.unwrap_or(0.0))
            .then(b.share.gpu_hours.total_cmp(&a.share.gpu_hours))
    });
    holders.truncate(10);
    Ok(FinopsReport {
        from_s: usage.from_s,
        to_s: usage.to_s,
        prices: prices.clone(),
        savings_vs_always_resident: ratio(total.always_resident, total.total),
        savings_vs_whole_gpu_each: ratio(total.whole_gpu_each, total.total),
        tenants: tenants.into_values().collect(),
        total,
        density: density
            .into_iter()
            .map(|(start, (agents, res_h, all_h))| DensityPoint {
                interval_start_s: start,
                agents,
                resident: if all_h > 0.0 {
                    agents as f64 * res_h / all_h
                } else {
                    0.0
                },
            })
            .collect(),
        gpu_shares: shares
            .iter()
            .map(|((share, model), sums)| sums.report(share, model))
            .collect(),
        gpu_holders: holders,
        top_idle_resident: idle,
    })
}

pub async fn run(args: ReportArgs) -> CliResult {
    let prices = PriceSheet::load(&args.prices)?;
    let now_s = torpor_core::now_millis() / 1000;
    let mut q = vec!["group_by=sandbox,interval".to_string()];
    if let Some(t) = &args.tenant {
        q.push(format!("tenant={}", crate::usage::encode(t)));
    }
    if let Some(f) = &args.from {
        q.push(format!("from={}", crate::usage::parse_time(f, now_s)?));
    }
    if let Some(t) = &args.to {
        q.push(format!("to={}", crate::usage::parse_time(t, now_s)?));
    }
    let usage = client(&args.conn)?
        .usage(&format!("?{}", q.join("&")))
        .await
        .map_err(|e| CliError(e.to_string()))?;
    let report = price(&usage, &prices)?;
    if let Some(path) = &args.html {
        std::fs::write(path, html(&report))
            .map_err(|e| CliError(format!("{}: {e}", path.display())))?;
    }
    if args.conn.json {
        print_json(&report);
    } else {
        print!("{}", table(&report));
    }
    Ok(0)
}

/// `MM-DD HH:00` (UTC) of a Unix time, for the density chart's labels.
fn utc_hour(t: i64) -> String {
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = t.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{month:02}-{day:02} {:02}:00", t.rem_euclid(86_400) / 3600)
}

/// An amount with enough decimals to show small figures (a short window costs fractions of a
/// cent).
fn amount(v: f64) -> String {
    if v == 0.0 || v.abs() >= 0.01 {
        format!("{v:.4}")
    } else {
        format!("{v:.3e}")
    }
}

fn money(v: f64, cur: &str) -> String {
    format!("{} {cur}", amount(v))
}

/// The terminal summary.
pub fn table(r: &FinopsReport) -> String {
    let cur = &r.prices.currency;
    let mut out = format!(
        "{:<20} {:>6} {:>10} {:>14} {:>14} {:>16} {:>16}\n",
        "TENANT", "AGENTS", "AGENT_H", "COST", "PER_AGENT_H", "ALWAYS_RESIDENT", "WHOLE_GPU_EACH"
    );
    for t in &r.tenants {
        let _ = writeln!(
            out,
            "{:<20} {:>6} {:>10.3} {:>14.4} {:>14.6} {:>16.4} {:>16.4}",
            t.tenant,
            t.agents,
            t.agent_hours,
            t.cost.total,
            t.cost_per_agent_hour,
            t.cost.always_resident,
            t.cost.whole_gpu_each
        );
    }
    let _ = writeln!(
        out,
        "total {} (memory {}, cpu {}, gpu {}, storage {}); one always-resident sandbox each: {} ({:.1}x); a whole GPU each: {} ({:.1}x)",
        money(r.total.total, cur),
        money(r.total.memory, cur),
        money(r.total.cpu, cur),
        money(r.total.gpu, cur),
        money(r.total.storage, cur),
        money(r.total.always_resident, cur),
        r.savings_vs_always_resident,
        money(r.total.whole_gpu_each, cur),
        r.savings_vs_whole_gpu_each
    );
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Horizontal bars: one group per label, one bar per series.
fn bars(groups: &[(String, Vec<f64>)], series: &[(&str, &str)], unit: &str) -> String {
    // Narrow enough that its text stays legible when a phone scales it to its width.
    let row_h = 16.0 * series.len() as f64 + 20.0;
    let (w, left) = (420.0, 110.0);
    let h = row_h * groups.len().max(1) as f64 + 30.0;
    let max = groups
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0_f64, f64::max)
        .max(1e-12);
    let mut s =
        format!("<svg viewBox=\"0 0 {w} {h}\" role=\"img\" preserveAspectRatio=\"xMinYMin meet\">");
    for (i, (label, values)) in groups.iter().enumerate() {
        let y0 = 10.0 + row_h * i as f64;
        let _ = write!(
            s,
            "<text x=\"0\" y=\"{:.1}\" font-size=\"13\">{}</text>",
            y0 + 13.0,
            esc(&label.chars().take(14).collect::<String>())
        );
        for (j, v) in values.iter().enumerate() {
            let bw = (w - left - 80.0) * v.max(0.0) / max;
            let y = y0 + 16.0 * j as f64;
            let _ = write!(
                s,
                "<rect x=\"{left}\" y=\"{y:.1}\" width=\"{bw:.1}\" height=\"14\" fill=\"{}\"><title>{}: {} {}</title></rect>\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{}</text>",
                series[j].1,
                esc(series[j].0),
                amount(*v),
                esc(unit),
                left + bw + 4.0,
                y + 12.0,
                amount(*v)
            );
        }
    }
    let mut x = 0.0;
    for (name, color) in series {
        let _ = write!(
            s,
            "<rect x=\"{x}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{}</text>",
            h - 14.0,
            x + 14.0,
            h - 5.0,
            esc(name)
        );
        x += 128.0;
    }
    s.push_str("</svg>");
    s
}

/// The self-contained HTML page.
pub fn html(r: &FinopsReport) -> String {
    let cur = esc(&r.prices.currency);
    let mut h = String::from(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>torpor: what it costs</title><style>\
         body{font-family:system-ui,sans-serif;margin:1rem;max-width:60rem;color:#222}\
         svg{width:100%;height:auto;display:block;margin:.5rem 0}\
         table{border-collapse:collapse;font-size:.9rem}td,th{padding:.25rem .5rem;border-bottom:1px solid #ddd;text-align:right}\
         td:first-child,th:first-child{text-align:left}.wrap{overflow-x:auto}\
         .big{font-size:1.6rem;font-weight:bold}</style></head><body>",
    );
    let _ = write!(
        h,
        "<h1>What it costs</h1><p>Usage from {} to {} (Unix seconds), priced at {}/GiB-hour of \
         memory, {}/vCPU-hour, {}/GiB-month of storage ({}).</p>",
        r.from_s,
        r.to_s,
        r.prices.memory_gib_hour,
        r.prices.vcpu_hour,
        r.prices.storage_gib_month,
        cur
    );
    let _ = write!(
        h,
        "<p><span class=\"big\">{:.1}x</span> cheaper than one always-resident sandbox per agent \
         ({} vs {}); <span class=\"big\">{:.1}x</span> cheaper than a whole GPU per GPU agent \
         ({}). Both baselines come from the measured usage: each agent's mean resident memory and \
         GPU share, held for all its agent-hours.</p>",
        r.savings_vs_always_resident,
        esc(&money(r.total.total, &r.prices.currency)),
        esc(&money(r.total.always_resident, &r.prices.currency)),
        r.savings_vs_whole_gpu_each,
        esc(&money(r.total.whole_gpu_each, &r.prices.currency))
    );
    h.push_str("<h2>Cost per tenant</h2>");
    let groups: Vec<(String, Vec<f64>)> = r
        .tenants
        .iter()
        .map(|t| {
            (
                t.tenant.clone(),
                vec![t.cost.total, t.cost.always_resident, t.cost.whole_gpu_each],
            )
        })
        .collect();
    h.push_str(&bars(
        &groups,
        &[
            ("torpor", "#4a90d9"),
            ("always resident", "#f5a623"),
            ("whole GPU each", "#d0021b"),
        ],
        &r.prices.currency,
    ));
    h.push_str(
        "<div class=\"wrap\"><table><tr><th>tenant</th><th>agents</th><th>agent-hours</th>\
         <th>memory</th><th>CPU</th><th>GPU</th><th>storage</th><th>total</th>\
         <th>per agent-hour</th></tr>",
    );
    for t in &r.tenants {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&t.tenant),
            t.agents,
            t.agent_hours,
            amount(t.cost.memory),
            amount(t.cost.cpu),
            amount(t.cost.gpu),
            amount(t.cost.storage),
            amount(t.cost.total),
            amount(t.cost_per_agent_hour)
        );
    }
    h.push_str("</table></div><h2>Density: agents and resident agents per hour (UTC)</h2>");
    let groups: Vec<(String, Vec<f64>)> = r
        .density
        .iter()
        .map(|d| {
            (
                utc_hour(d.interval_start_s),
                vec![d.agents as f64, d.resident],
            )
        })
        .collect();
    h.push_str(&bars(
        &groups,
        &[("agents", "#4a90d9"), ("resident (mean)", "#7ed321")],
        "agents",
    ));
    h.push_str("<h2>GPU shares: held and used</h2>");
    if r.gpu_shares.is_empty() {
        h.push_str("<p>No GPU held in this window.</p>");
    } else {
        h.push_str(&gpu_shares_html(r));
    }
    h.push_str(
        "<h2>Idle but resident</h2><p>Agents that held memory while their CPU was idle \
         (GiB-hours × (1 − CPU use)); candidates for a shorter idle policy.</p>\
         <div class=\"wrap\"><table><tr><th>agent</th><th>tenant</th><th>resident h</th>\
         <th>CPU use</th><th>idle GiB-h</th></tr>",
    );
    for a in &r.top_idle_resident {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.1}%</td><td>{:.5}</td></tr>",
            esc(&a.sandbox),
            esc(&a.tenant),
            a.resident_hours,
            a.cpu_utilisation * 100.0,
            a.idle_resident_gib_hours
        );
    }
    h.push_str("</table></div></body></html>\n");
    h
}

/// Percent with one decimal, or "not measured".
fn pct_or_unread(v: Option<f64>) -> String {
    v.map_or_else(|| "not measured".into(), |u| format!("{:.1}%", u * 100.0))
}

fn or_dash(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".into(), |x| format!("{x:.decimals$}"))
}

/// The GPU section: each kind of share's GPU-hours next to its utilisation, a chart of held
/// against busy GPU-hours where measured, and the agents' shares by idle cost.
fn gpu_shares_html(r: &FinopsReport) -> String {
    let mut h = String::from(
        "<p>Utilisation is the held device's (<code>DCGM_FI_DEV_GPU_UTIL</code>) over the \
         GPU-hours it was read for; a GPU several sandboxes share, a MIG instance (NVML reads \
         no utilisation there) and a declared inventory are not measured, which is not idle. \
         Idle GPU-hours are measured GPU-hours × (1 − utilisation): held, paid, unused.</p>\
         <div class=\"wrap\"><table><tr><th>share</th><th>model</th><th>GPU-hours</th>\
         <th>cost</th><th>utilisation</th><th>measured GPU-h</th><th>idle GPU-h</th>\
         <th>idle cost</th><th>framebuffer used (GiB)</th></tr>",
    );
    for g in &r.gpu_shares {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.4}</td><td>{}</td><td>{}</td><td>{:.4}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&g.share),
            esc(&g.model),
            g.gpu_hours,
            amount(g.cost),
            pct_or_unread(g.utilisation),
            g.measured_gpu_hours,
            or_dash(g.idle_gpu_hours, 4),
            g.idle_cost.map_or_else(|| "–".into(), amount),
            or_dash(g.mean_fb_used_gib, 2)
        );
    }
    h.push_str("</table></div>");
    let measured: Vec<(String, Vec<f64>)> = r
        .gpu_shares
        .iter()
        .filter(|g| g.utilisation.is_some())
        .map(|g| {
            (
                format!("{} {}", g.share, g.model),
                vec![
                    g.measured_gpu_hours,
                    g.measured_gpu_hours - g.idle_gpu_hours.unwrap_or(0.0),
                ],
            )
        })
        .collect();
    if !measured.is_empty() {
        h.push_str(&bars(
            &measured,
            &[("held (measured)", "#9b9b9b"), ("busy", "#4a90d9")],
            "GPU-h",
        ));
    }
    h.push_str(
        "<h3>Agents' GPU shares, most idle cost first</h3><div class=\"wrap\"><table>\
         <tr><th>agent</th><th>tenant</th><th>share</th><th>GPU-hours</th>\
         <th>utilisation</th><th>idle cost</th></tr>",
    );
    for a in &r.gpu_holders {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{} {}</td><td>{:.4}</td><td>{}</td><td>{}</td></tr>",
            esc(&a.sandbox),
            esc(&a.tenant),
            esc(&a.share.share),
            esc(&a.share.model),
            a.share.gpu_hours,
            pct_or_unread(a.share.utilisation),
            a.share.idle_cost.map_or_else(|| "–".into(), amount)
        );
    }
    h.push_str("</table></div>");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sheet() -> PriceSheet {
        toml::from_str(
            "currency = \"EUR\"\nmemory_gib_hour = 0.01\nvcpu_hour = 0.1\nstorage_gib_month = 0.73\n\
             [gpu_hour]\n\"NVIDIA H200\" = 7.0\n",
        )
        .unwrap()
    }

    fn row(sandbox: &str, start: i64) -> UsageRow {
        UsageRow {
            tenant: "team-a".into(),
            sandbox: Some(sandbox.into()),
            interval_start_s: Some(start),
            ..Default::default()
        }
    }

    #[test]
    fn costs_and_baselines_follow_the_measured_usage() {
        // One agent, 10 agent-hours: 2 h running at 1 GiB, 8 h parked with a 0.5 GiB image,
        // 1800 CPU-seconds, a 3g MIG share (3/7 GPU) for its 2 resident hours.
        let mut a = row("sb-a", 0);
        a.tier_hours.insert("running".into(), 2.0);
        a.tier_hours.insert("parked".into(), 8.0);
        a.memory_gib_hours.insert("running".into(), 2.0);
        a.cpu_seconds = 1800.0;
        a.snapshot_gib_hours = 4.0;
        a.gpu_hours
            .insert("mig:3g.71gb@NVIDIA H200".into(), 2.0 * 3.0 / 7.0);
        let usage = UsageReport {
            from_s: 0,
            to_s: 36_000,
            interval_s: 3600,
            rows: vec![a],
        };
        let r = price(&usage, &sheet()).unwrap();
        let c = &r.total;
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-9, "{x} != {y}");
        close(c.memory, 2.0 * 0.01);
        close(c.cpu, 0.5 * 0.1);
        close(c.gpu, 6.0);
        close(c.storage, 4.0 / 730.0 * 0.73);
        close(c.total, 0.02 + 0.05 + 6.0 + 0.004);
        // Always resident: 1 GiB mean × 10 h, the same CPU, 3/7 GPU × 10 h.
        close(c.always_resident, 0.1 + 0.05 + 30.0);
        // A whole H200 for 10 h instead of the share.
        close(c.whole_gpu_each, 0.1 + 0.05 + 70.0);
        close(r.savings_vs_whole_gpu_each, 70.15 / 6.074);
        close(r.tenants[0].cost_per_agent_hour, 6.074 / 10.0);
        assert_eq!(r.gpu_shares[0].share, "mig:3g.71gb");
        assert_eq!(r.gpu_shares[0].model, "NVIDIA H200");
        close(r.density[0].resident, 0.2);
    }

    #[test]
    fn gpu_utilisation_per_share_is_shown_next_to_its_share_hours() {
        // sb-w: a whole H200 for 1 h, its utilisation read for 0.8 of it at 25% mean, 4 GiB
        // of framebuffer used. sb-m: a 3g MIG slice (3/7) for 1 h, framebuffer read only
        // (NVML has no MIG utilisation). sb-d: the same slice on a declared inventory, no
        // telemetry at all.
        let whole = "whole@NVIDIA H200";
        let mig = "mig:3g.71gb@NVIDIA H200";
        let mut w = row("sb-w", 0);
        w.tier_hours.insert("running".into(), 1.0);
        w.gpu_hours.insert(whole.into(), 1.0);
        w.gpu_util_sampled_hours.insert(whole.into(), 0.8);
        w.gpu_busy_hours.insert(whole.into(), 0.2);
        w.gpu_fb_sampled_hours.insert(whole.into(), 0.8);
        w.gpu_fb_used_gib_hours.insert(whole.into(), 3.2);
        let mut m = row("sb-m", 0);
        m.tier_hours.insert("running".into(), 1.0);
        m.gpu_hours.insert(mig.into(), 3.0 / 7.0);
        m.gpu_fb_sampled_hours.insert(mig.into(), 1.0);
        m.gpu_fb_used_gib_hours.insert(mig.into(), 10.0);
        let mut d = row("sb-d", 0);
        d.tier_hours.insert("running".into(), 1.0);
        d.gpu_hours.insert(mig.into(), 3.0 / 7.0);
        // The same agent in a second interval adds up.
        let mut w2 = row("sb-w", 3600);
        w2.gpu_hours.insert(whole.into(), 0.0);
        w2.gpu_util_sampled_hours.insert(whole.into(), 0.0);
        let usage = UsageReport {
            from_s: 0,
            to_s: 7200,
            interval_s: 3600,
            rows: vec![w, m, d, w2],
        };
        let r = price(&usage, &sheet()).unwrap();
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-9, "{x} != {y}");
        assert_eq!(r.gpu_shares.len(), 2);
        let (sm, sw) = (&r.gpu_shares[0], &r.gpu_shares[1]);
        assert_eq!(
            (sm.share.as_str(), sw.share.as_str()),
            ("mig:3g.71gb", "whole")
        );
        close(sw.gpu_hours, 1.0);
        close(sw.cost, 7.0);
        close(sw.utilisation.unwrap(), 0.25);
        close(sw.measured_gpu_hours, 0.8);
        close(sw.idle_gpu_hours.unwrap(), 0.6);
        close(sw.idle_cost.unwrap(), 0.6 * 7.0);
        close(sw.mean_fb_used_gib.unwrap(), 4.0);
        close(sm.gpu_hours, 6.0 / 7.0);
        assert_eq!(sm.utilisation, None, "never read is not idle");
        assert_eq!(sm.idle_cost, None);
        close(sm.measured_gpu_hours, 0.0);
        close(sm.mean_fb_used_gib.unwrap(), 10.0);
        // Per agent: the measured idle one first.
        assert_eq!(r.gpu_holders.len(), 3);
        assert_eq!(r.gpu_holders[0].sandbox, "sb-w");
        close(r.gpu_holders[0].share.idle_cost.unwrap(), 4.2);
        assert_eq!(r.gpu_holders[1].share.utilisation, None);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["gpu_shares"][1]["utilisation"], 0.25);
        assert!(json["gpu_shares"][0]["utilisation"].is_null());
        assert_eq!(json["gpu_holders"][0]["sandbox"], "sb-w");
        assert_eq!(json["gpu_holders"][0]["share"], "whole");
        let page = html(&r);
        assert!(page.contains("GPU shares: held and used"), "{page}");
        assert!(page.contains("<td>25.0%</td>"), "{page}");
        assert!(page.contains("<td>not measured</td>"), "{page}");
        assert!(page.contains("<td>4.2000</td>"), "the idle cost: {page}");
        assert!(page.contains("busy"), "the held-against-busy chart: {page}");
        assert_eq!(page.matches("<svg").count(), 3, "tenants, density, GPU");
    }

    #[test]
    fn hours_are_labelled_in_utc() {
        assert_eq!(utc_hour(0), "01-01 00:00");
        // 2026-12-01 15:00:00 UTC
        assert_eq!(utc_hour(1_796_137_200), "12-01 15:00");
        assert_eq!(utc_hour(951_782_400), "02-29 00:00");
    }

    #[test]
    fn an_unpriced_gpu_model_is_an_error_not_free() {
        let mut a = row("sb-a", 0);
        a.tier_hours.insert("running".into(), 1.0);
        a.gpu_hours.insert("whole@NVIDIA L4".into(), 1.0);
        let usage = UsageReport {
            from_s: 0,
            to_s: 3600,
            interval_s: 3600,
            rows: vec![a],
        };
        let e = price(&usage, &sheet()).unwrap_err();
        assert!(e.0.contains("NVIDIA L4"), "{}", e.0);
    }

    #[test]
    fn the_page_is_self_contained_and_escapes_names() {
        let mut a = row("sb-<x>", 0);
        a.tier_hours.insert("running".into(), 1.0);
        a.memory_gib_hours.insert("running".into(), 0.5);
        let usage = UsageReport {
            from_s: 0,
            to_s: 3600,
            interval_s: 3600,
            rows: vec![a],
        };
        let page = html(&price(&usage, &sheet()).unwrap());
        assert!(page.contains("<svg"), "{page}");
        assert!(page.contains("sb-&lt;x&gt;"));
        assert!(!page.contains("sb-<x>"));
        assert!(
            !page.contains("http://") && !page.contains("https://") && !page.contains("<script")
        );
        assert!(page.contains("name=\"viewport\""));
    }
}
