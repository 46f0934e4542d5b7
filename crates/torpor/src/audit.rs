//! `torpor audit verify|tail`: read the audit log (`DATA_DIR/audit`, see
//! `torpor_api::audit`) straight from the data directory on this machine; no daemon needed.
//!
//! Exit codes: 0 done (`verify`: the chain is intact); 1 an error (no log, unreadable, no key);
//! 2 `verify` found a bad record (its file, line and why are printed).

use std::path::PathBuf;

use clap::Subcommand;
use torpor_api::audit::{self, Event, Record, VerifyError};

use crate::common::{print_json, CliError};
use crate::daemon;

/// Exit code of `torpor audit verify` when the chain is broken.
pub const EXIT_BROKEN: i32 = 2;

#[derive(Subcommand)]
pub enum AuditCmd {
    /// Check every record's hash, the chain, the checkpoint signatures and the signed head;
    /// exit 0 when intact, 2 naming the first bad record.
    Verify {
        #[arg(long, env = daemon::ENV_DATA_DIR)]
        data_dir: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the last records, oldest first (read as they are; `verify` checks them).
    Tail {
        #[arg(long, env = daemon::ENV_DATA_DIR)]
        data_dir: Option<PathBuf>,
        /// Only calls made by this tenant (`admin`, `anonymous` work too).
        #[arg(long)]
        tenant: Option<String>,
        /// How many records.
        #[arg(short = 'n', long = "lines", default_value_t = 20)]
        n: usize,
        /// Print the records as JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: AuditCmd) -> Result<i32, CliError> {
    match cmd {
        AuditCmd::Verify { data_dir, json } => {
            let dir = data_dir.unwrap_or_else(daemon::default_data_dir);
            match audit::verify(&dir) {
                Ok(r) => {
                    if json {
                        print_json(&serde_json::json!({"ok": true, "report": r}));
                        return Ok(0);
                    }
                    println!(
                        "audit log intact: {} records checked ({} checkpoints) in {} files; \
                         last seq {} hash {}",
                        r.records, r.checkpoints, r.files, r.last_seq, r.last_hash
                    );
                    if r.dropped_calls > 0 {
                        println!(
                            "{} calls went unrecorded (see the `dropped` records)",
                            r.dropped_calls
                        );
                    }
                    if r.recoveries > 0 {
                        println!("{} torn tails were moved aside after crashes", r.recoveries);
                    }
                    if r.unsigned_tail > 0 {
                        println!(
                            "{} records after the signed head: being written, left unsigned by a \
                             crash (the next start signs them), or appended without the key",
                            r.unsigned_tail
                        );
                    }
                    if !r.ends_with_checkpoint && r.records > 0 {
                        println!(
                            "the log does not end with a checkpoint: the daemon is running, or did \
                             not stop cleanly"
                        );
                    }
                    Ok(0)
                }
                Err(VerifyError::Bad(b)) => {
                    if json {
                        print_json(&serde_json::json!({"ok": false, "bad": b}));
                    } else {
                        println!("audit log broken: {b}");
                    }
                    Ok(EXIT_BROKEN)
                }
                Err(VerifyError::Read(e)) => Err(CliError(e.to_string())),
            }
        }
        AuditCmd::Tail {
            data_dir,
            tenant,
            n,
            json,
        } => {
            let dir = data_dir.unwrap_or_else(daemon::default_data_dir);
            let records =
                audit::tail(&dir, tenant.as_deref(), n).map_err(|e| CliError(e.to_string()))?;
            if json {
                for r in &records {
                    println!(
                        "{}",
                        serde_json::to_string(r).map_err(|e| CliError(e.to_string()))?
                    );
                }
                return Ok(0);
            }
            println!(
                "{:<24} {:<7} {:<12} {:<7} {:<36} {:<32} {:>6} {:<18} REQUEST",
                "TIME", "SEQ", "ACTOR", "METHOD", "ROUTE", "OBJECT", "STATUS", "CODE"
            );
            for r in &records {
                println!("{}", row(r));
            }
            Ok(0)
        }
    }
}

fn row(r: &Record) -> String {
    match &r.event {
        Event::Call(c) => format!(
            "{:<24} {:<7} {:<12} {:<7} {:<36} {:<32} {:>6} {:<18} {}",
            r.time,
            r.seq,
            c.actor,
            c.method,
            c.route,
            c.object
                .as_ref()
                .map_or("-".to_string(), |o| format!("{}:{}", o.kind, o.name)),
            c.status,
            c.code.as_deref().unwrap_or("-"),
            c.request_id.as_deref().unwrap_or("-"),
        ),
        Event::Checkpoint { .. } => {
            format!("{:<24} {:<7} checkpoint (signed chain head)", r.time, r.seq)
        }
        Event::Dropped { count } => {
            format!(
                "{:<24} {:<7} {count} calls not recorded before this",
                r.time, r.seq
            )
        }
        Event::Recovered {
            discarded_bytes,
            kept_in,
            missing_records,
            ..
        } => format!(
            "{:<24} {:<7} restart after a crash: {discarded_bytes} torn bytes moved to {kept_in}, \
             {missing_records} records missing",
            r.time, r.seq
        ),
    }
}
