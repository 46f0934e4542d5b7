//! `torpor snapshot ls|inspect|verify|gc|stats` (clients of the operator's snapshot routes) and
//! the snapshot flags of `torpor up`.
//!
//! Exit codes: 0 done; 1 an error (the message names it); 2 `verify` found missing or corrupt
//! chunks (each reported with its snapshot, chunk and file).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use torpor_control::{SnapshotConfig, StoreLocation};

use crate::common::{client, human_bytes, print_json, CliError, Conn};
use crate::daemon;

/// Exit code of `torpor snapshot verify` when a chunk is missing or corrupt.
pub const EXIT_CORRUPT: i32 = 2;

#[derive(Subcommand)]
pub enum SnapshotCmd {
    /// List snapshots (every tenant's).
    Ls {
        #[command(flatten)]
        conn: Conn,
    },
    /// Show one snapshot: labels, files, chunks.
    Inspect {
        id: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Check every chunk of one snapshot (or of all) against its hash; exit 2 if any is bad.
    Verify {
        id: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Apply retention and remove chunks no snapshot references.
    Gc {
        /// Report what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Totals: logical bytes, stored bytes, chunks, snapshots.
    Stats {
        #[command(flatten)]
        conn: Conn,
    },
}

/// Snapshot flags of `torpor up`.
#[derive(Args, Clone, Debug)]
pub struct StoreArgs {
    /// Where Suspended sandboxes' snapshots go: a directory or s3://bucket/prefix (endpoint,
    /// region and credentials from AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY). Default: DATA/store.
    #[arg(long, value_parser = str::parse::<StoreLocation>)]
    pub store: Option<StoreLocation>,
    /// Node chunk cache for wakes, e.g. 2G; 0 turns it off (default: 1G for s3://, off for a
    /// local store).
    #[arg(long, value_parser = parse_cache_size)]
    pub chunk_cache: Option<u64>,
    /// Keep this many newest snapshots per sandbox (default: only the current one).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_snapshots: Option<u64>,
    /// Collect unreferenced chunks this often, in seconds (default: only on `snapshot gc`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub gc_interval: Option<u64>,
    /// Encrypt snapshots at rest with one key per tenant, kept in DIR/<tenant>.key.
    #[arg(long)]
    pub snapshot_keys: Option<PathBuf>,
    /// How long one S3 request may keep retrying, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub store_retry_timeout: u64,
    /// Pack new snapshot chunks into objects of about this size, e.g. 4M, so a wake reads a
    /// few ranges and a park writes a few objects instead of one per chunk; 0 stores each
    /// chunk as its own object (default: 4M for s3://, 0 for a local store).
    #[arg(long, value_parser = parse_pack_size)]
    pub pack_size: Option<u64>,
    /// Garbage collection rewrites a pack of which remaining snapshots use less than this
    /// fraction (its used chunks copied into new packs, then the old one removed); 0 keeps
    /// every pack whole while any snapshot uses a chunk in it (default: 0.5).
    #[arg(long, value_parser = parse_fraction)]
    pub repack_below: Option<f64>,
}

/// `--repack-below`: a fraction from 0 to 1.
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "{s} is not a fraction from 0 (never repack) to 1, e.g. 0.5"
        )),
    }
}

pub fn parse_cache_size(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    daemon::parse_size(s)
}

/// `--pack-size`: 0 (no packs) or a size within the store's bounds (64K to 256M).
pub fn parse_pack_size(s: &str) -> Result<u64, String> {
    let n = parse_cache_size(s)?;
    let (min, max) = (
        torpor_control::snapshots::MIN_PACK_TARGET as u64,
        torpor_control::snapshots::MAX_PACK_TARGET as u64,
    );
    if n != 0 && !(min..=max).contains(&n) {
        return Err(format!(
            "{s} is outside 64K..256M (0 stores each chunk as its own object)"
        ));
    }
    Ok(n)
}

impl StoreArgs {
    pub fn config(&self) -> SnapshotConfig {
        SnapshotConfig {
            location: self.store.clone(),
            chunk_cache_bytes: self.chunk_cache,
            keep_snapshots: self.keep_snapshots.map(|n| n as usize),
            gc_interval: self.gc_interval.map(Duration::from_secs),
            key_dir: self.snapshot_keys.clone(),
            s3_retry_timeout: Some(Duration::from_secs(self.store_retry_timeout)),
            pack_bytes: self.pack_size,
            repack_below: self.repack_below,
        }
    }
}

fn when(ms: u64) -> String {
    torpor_api::types::rfc3339(ms as i64)
}

pub async fn run(cmd: SnapshotCmd) -> Result<i32, CliError> {
    match cmd {
        SnapshotCmd::Ls { conn } => {
            let all = client(&conn)?.snapshots().await?;
            if conn.json {
                print_json(&all);
                return Ok(0);
            }
            println!(
                "{:<40} {:<10} {:<20} {:>10} {:>7} {:<6} CREATED",
                "ID", "TENANT", "SANDBOX", "LOGICAL", "CHUNKS", "PINNED"
            );
            for s in all {
                println!(
                    "{:<40} {:<10} {:<20} {:>10} {:>7} {:<6} {}",
                    s.id,
                    s.tenant.as_deref().unwrap_or("-"),
                    s.sandbox.as_deref().unwrap_or("-"),
                    human_bytes(s.logical_bytes),
                    s.chunks,
                    if s.pinned { "yes" } else { "" },
                    when(s.created_unix_ms)
                );
            }
            Ok(0)
        }
        SnapshotCmd::Inspect { id, conn } => {
            let d = client(&conn)?.snapshot(&id).await?;
            if conn.json {
                print_json(&d);
                return Ok(0);
            }
            let s = &d.summary;
            println!("id          {}", s.id);
            println!("created     {}", when(s.created_unix_ms));
            println!("parent      {}", s.parent.as_deref().unwrap_or("-"));
            println!("pinned      {}", s.pinned);
            println!(
                "used by     {}",
                if s.used_by.is_empty() {
                    "-".to_string()
                } else {
                    s.used_by.join(", ")
                }
            );
            for (k, v) in &d.labels {
                println!("label       {k}={v}");
            }
            println!(
                "size        {} in {} chunk refs ({} unique), chunking {:?}",
                human_bytes(s.logical_bytes),
                s.chunks,
                d.unique_chunks,
                d.chunking
            );
            println!(
                "\n{:<14} {:>6} {:>12} {:>8} {:>12}  PATH",
                "KIND", "MODE", "SIZE", "CHUNKS", "ZERO"
            );
            for f in &d.file_list {
                println!(
                    "{:<14} {:>6o} {:>12} {:>8} {:>12}  {}",
                    f.kind,
                    f.mode,
                    human_bytes(f.size),
                    f.chunks,
                    human_bytes(f.zero_bytes),
                    f.path
                );
            }
            Ok(0)
        }
        SnapshotCmd::Verify { id, conn } => {
            let r = client(&conn)?.verify_snapshots(id.as_deref()).await?;
            if conn.json {
                print_json(&r);
            } else {
                for p in &r.problems {
                    eprintln!(
                        "BAD {}: snapshot {} chunk {} file {}: {}",
                        p.code, p.snapshot, p.chunk, p.path, p.message
                    );
                }
                println!(
                    "{} snapshots, {} chunks checked: {}",
                    r.snapshots_checked,
                    r.chunks_checked,
                    if r.ok {
                        "all intact".to_string()
                    } else {
                        format!("{} bad chunks", r.problems.len())
                    }
                );
            }
            Ok(if r.ok { 0 } else { EXIT_CORRUPT })
        }
        SnapshotCmd::Gc { dry_run, conn } => {
            let r = client(&conn)?.gc_snapshots(dry_run).await?;
            if conn.json {
                print_json(&r);
            } else {
                println!(
                    "{}{} snapshots removed, {} kept; {} chunks removed ({}), {} live",
                    if r.dry_run { "(dry run) " } else { "" },
                    r.snapshots_removed.len(),
                    r.snapshots_kept,
                    r.chunks_removed,
                    human_bytes(r.bytes_freed),
                    r.chunks_live
                );
                if r.packs_removed > 0 || r.pack_bytes_live > 0 {
                    println!(
                        "{} packs removed; packs kept hold {} of which snapshots use {}",
                        r.packs_removed,
                        human_bytes(r.pack_bytes_live),
                        human_bytes(r.pack_bytes_used)
                    );
                }
                if r.packs_repacked > 0 {
                    println!(
                        "{} sparse or small packs {}: {} of used chunks into {} new packs, {} manifests rewritten",
                        r.packs_repacked,
                        if r.dry_run { "to repack" } else { "repacked" },
                        human_bytes(r.repack_bytes_written),
                        r.repack_packs_written,
                        r.manifests_rewritten
                    );
                }
            }
            Ok(0)
        }
        SnapshotCmd::Stats { conn } => {
            let s = client(&conn)?.snapshot_stats().await?;
            if conn.json {
                // The contract, spacing included.
                println!(
                    "{{\"logical_bytes\": {}, \"stored_bytes\": {}, \"chunks\": {}, \"snapshots\": {}}}",
                    s.logical_bytes, s.stored_bytes, s.chunks, s.snapshots
                );
            } else {
                println!("snapshots     {}", s.snapshots);
                println!("chunks        {}", s.chunks);
                println!(
                    "logical       {} ({} B)",
                    human_bytes(s.logical_bytes),
                    s.logical_bytes
                );
                println!(
                    "stored        {} ({} B)",
                    human_bytes(s.stored_bytes),
                    s.stored_bytes
                );
                if s.stored_bytes > 0 {
                    println!(
                        "ratio         {:.2}x",
                        s.logical_bytes as f64 / s.stored_bytes as f64
                    );
                }
            }
            Ok(0)
        }
    }
}
