//! `torpor usage`: what tenants (and their sandboxes) consumed, from `GET /v1/usage`, as a table
//! for people, `--json` or `--csv` for billing systems.

use clap::Args;
use torpor_control::usage::{UsageReport, UsageRow};

use crate::common::{client, print_json, CliError, CliResult, Conn};

#[derive(Args)]
pub struct UsageArgs {
    /// One tenant (the admin's default: every tenant; a tenant sees only its own).
    #[arg(long)]
    tenant: Option<String>,
    /// Start: Unix seconds, or an age such as `24h`, `7d`, `90m` (default: 30 days ago).
    #[arg(long)]
    from: Option<String>,
    /// End (exclusive): Unix seconds or an age (default: now).
    #[arg(long)]
    to: Option<String>,
    /// Rows by `tenant` (default), `sandbox`, `interval` (hourly), comma-separated.
    #[arg(long = "group-by")]
    group_by: Option<String>,
    /// Print CSV (one row per group, one column per measure and tier).
    #[arg(long, conflicts_with = "json")]
    csv: bool,
    #[command(flatten)]
    conn: Conn,
}

/// Unix seconds from `s`: a number, or an age (`30m`, `24h`, `7d`) before `now_s`.
pub fn parse_time(s: &str, now_s: i64) -> Result<i64, CliError> {
    if let Ok(t) = s.parse::<i64>() {
        return Ok(t);
    }
    let (n, unit) = s.split_at(s.len().saturating_sub(1));
    let secs = match unit {
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => 0,
    };
    match n.parse::<i64>() {
        Ok(n) if secs > 0 && n >= 0 => Ok(now_s - n * secs),
        _ => Err(CliError(format!(
            "{s:?}: give Unix seconds or an age such as 90m, 24h, 7d"
        ))),
    }
}

pub async fn run(args: UsageArgs) -> CliResult {
    let now_s = torpor_core::now_millis() / 1000;
    let mut q = Vec::new();
    if let Some(t) = &args.tenant {
        q.push(format!("tenant={}", encode(t)));
    }
    if let Some(f) = &args.from {
        q.push(format!("from={}", parse_time(f, now_s)?));
    }
    if let Some(t) = &args.to {
        q.push(format!("to={}", parse_time(t, now_s)?));
    }
    if let Some(g) = &args.group_by {
        q.push(format!("group_by={}", encode(g)));
    }
    let query = if q.is_empty() {
        String::new()
    } else {
        format!("?{}", q.join("&"))
    };
    let report = client(&args.conn)?
        .usage(&query)
        .await
        .map_err(|e| CliError(e.to_string()))?;
    if args.conn.json {
        print_json(&report);
    } else if args.csv {
        print!("{}", csv(&report));
    } else {
        print!("{}", table(&report));
    }
    Ok(0)
}

pub(crate) fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

const WAKE_TIERS: [&str; 4] = ["golden", "frozen", "parked", "suspended"];

/// GPU-hours over every share (`fold` from +0.0: an empty `sum` of f64 is -0.0).
fn gpu_total(r: &UsageRow) -> f64 {
    r.gpu_hours.values().fold(0.0, |a, b| a + b)
}

fn mem(r: &UsageRow, tier: &str) -> f64 {
    r.memory_gib_hours.get(tier).copied().unwrap_or(0.0)
}

/// The CSV billing systems read: one row per group, fixed columns.
pub fn csv(report: &UsageReport) -> String {
    let mut out = String::from(
        "tenant,sandbox,interval_start_s,memory_gib_hours_running,memory_gib_hours_frozen,\
         cpu_seconds,gpu_hours,snapshot_gib_hours,wakes_golden,wakes_frozen,wakes_parked,\
         wakes_suspended,egress_bytes\n",
    );
    for r in &report.rows {
        let field = |s: &str| {
            if s.contains([',', '"', '\n']) {
                format!("\"{}\"", s.replace('"', "\"\""))
            } else {
                s.to_string()
            }
        };
        let wakes: Vec<String> = WAKE_TIERS
            .iter()
            .map(|t| r.wakes.get(*t).copied().unwrap_or(0).to_string())
            .collect();
        out.push_str(&format!(
            "{},{},{},{:.6},{:.6},{:.3},{:.6},{:.6},{},{}\n",
            field(&r.tenant),
            field(r.sandbox.as_deref().unwrap_or("")),
            r.interval_start_s
                .map(|s| s.to_string())
                .unwrap_or_default(),
            mem(r, "running"),
            mem(r, "frozen"),
            r.cpu_seconds,
            gpu_total(r),
            r.snapshot_gib_hours,
            wakes.join(","),
            r.egress_bytes
        ));
    }
    out
}

/// The table for people.
pub fn table(report: &UsageReport) -> String {
    let by_sandbox = report.rows.iter().any(|r| r.sandbox.is_some());
    let by_interval = report.rows.iter().any(|r| r.interval_start_s.is_some());
    let mut out = format!("{:<20}", "TENANT");
    if by_sandbox {
        out.push_str(&format!(" {:<22}", "SANDBOX"));
    }
    if by_interval {
        out.push_str(&format!(" {:<12}", "INTERVAL"));
    }
    out.push_str(&format!(
        " {:>12} {:>12} {:>10} {:>9} {:>11} {:>7} {:>12}\n",
        "MEM_GIB_H", "FROZEN_GIB_H", "CPU_S", "GPU_H", "SNAP_GIB_H", "WAKES", "EGRESS_B"
    ));
    for r in &report.rows {
        out.push_str(&format!("{:<20}", r.tenant));
        if by_sandbox {
            out.push_str(&format!(" {:<22}", r.sandbox.as_deref().unwrap_or("-")));
        }
        if by_interval {
            out.push_str(&format!(
                " {:<12}",
                r.interval_start_s
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            ));
        }
        out.push_str(&format!(
            " {:>12.4} {:>12.4} {:>10.1} {:>9.4} {:>11.4} {:>7} {:>12}\n",
            mem(r, "running"),
            mem(r, "frozen"),
            r.cpu_seconds,
            gpu_total(r),
            r.snapshot_gib_hours,
            r.wakes.values().sum::<u64>(),
            r.egress_bytes
        ));
    }
    if report.rows.is_empty() {
        out.push_str("(no usage recorded in this window)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> UsageReport {
        let mut r = UsageRow {
            tenant: "team-a".into(),
            sandbox: Some("sb-aaaaaaaaaaaaaaaa".into()),
            cpu_seconds: 12.5,
            snapshot_gib_hours: 0.25,
            egress_bytes: 4096,
            ..Default::default()
        };
        r.memory_gib_hours.insert("running".into(), 1.5);
        r.memory_gib_hours.insert("frozen".into(), 0.5);
        r.gpu_hours.insert("mig:3g.71gb".into(), 0.75);
        r.wakes.insert("parked".into(), 3);
        r.wakes.insert("golden".into(), 1);
        UsageReport {
            from_s: 0,
            to_s: 3600,
            interval_s: 3600,
            rows: vec![r],
        }
    }

    #[test]
    fn csv_has_fixed_columns_for_billing() {
        assert_eq!(
            csv(&report()),
            "tenant,sandbox,interval_start_s,memory_gib_hours_running,memory_gib_hours_frozen,\
             cpu_seconds,gpu_hours,snapshot_gib_hours,wakes_golden,wakes_frozen,wakes_parked,\
             wakes_suspended,egress_bytes\n\
             team-a,sb-aaaaaaaaaaaaaaaa,,1.500000,0.500000,12.500,0.750000,0.250000,1,0,3,0,4096\n"
        );
    }

    #[test]
    fn table_shows_sandbox_column_only_when_grouped_by_sandbox() {
        let t = table(&report());
        assert!(t.starts_with("TENANT"), "{t}");
        assert!(t.contains("SANDBOX"), "{t}");
        assert!(t.contains("sb-aaaaaaaaaaaaaaaa"), "{t}");
        let mut r = report();
        r.rows[0].sandbox = None;
        assert!(!table(&r).contains("SANDBOX"));
    }

    #[test]
    fn times_are_unix_seconds_or_ages() {
        assert_eq!(parse_time("1700000000", 5).unwrap(), 1_700_000_000);
        assert_eq!(parse_time("2h", 10_000).unwrap(), 10_000 - 7200);
        assert_eq!(parse_time("7d", 1_000_000).unwrap(), 1_000_000 - 604_800);
        assert!(parse_time("soon", 5).is_err());
        assert!(parse_time("h", 5).is_err());
    }
}
