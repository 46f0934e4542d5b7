//! The audit log: every mutating API call and every refused one, appended to a tamper-evident
//! chain of files under `DATA_DIR/audit/` (directory 0700, files 0600), and the axum
//! middleware ([`record_calls`]) that feeds it.
//!
//! This module owns `DATA_DIR/audit/` and nothing else. It never sees request bodies, and of a
//! request it keeps only the method, the route template, the object named in the path, the
//! status and the stable error code: no query string, no header value, no token, no env value.
//!
//! # What is recorded
//!
//! - every call whose method is not GET, HEAD or OPTIONS on a known route: API v1, E2B's
//!   control plane and envd (all POST), and the proxy (`/v1/sandboxes/{id}/ports/..` and
//!   host-routed `{port}-{id}.<domain>`); a POST to a route that does not exist is not;
//! - every denied call, whatever its method: 401, 403, 429, and 404 on a route that names an
//!   object (`/v1/sandboxes/{id}`, `/v1/templates/{name}`, ...).
//!
//! The actor is the tenant whose token the call carried (bearer or E2B `X-API-KEY`), `admin`, or
//! the owner of the sandbox whose envd access token it carried; otherwise `anonymous`.
//!
//! # Format
//!
//! Files `audit-000001.jsonl`, `audit-000002.jsonl`, ... each up to
//! [`AuditConfig::max_file_bytes`] (64 MiB); one JSON object per line:
//!
//! ```text
//! {"v":1,"seq":7,"time":"2025-01-01T10:00:00.123Z","kind":"call","request_id":"..",
//!  "actor":"team-a","remote":"10.0.0.5:51234","method":"DELETE","route":"/v1/sandboxes/{id}",
//!  "object":{"kind":"sandbox","name":"sbx-.."},"status":404,"code":"not_found",
//!  "prev":"<hash of record 6>","hash":"<hash of this record>"}
//! ```
//!
//! `hash` is BLAKE3 (derive-key mode, context `torpor audit record v1`) of the record's
//! canonical bytes: the line exactly as written, without its trailing `,"hash":"…"` member
//! (the closing brace kept). The verifier hashes the bytes on disk, never a re-serialisation,
//! so any change of any byte (whitespace, an escape written another way) is a mismatch. `seq`
//! counts from 1 across files and restarts; `prev` of the first record is 64 zeros.
//!
//! Other kinds: `checkpoint` (`sig`: the chain head signed with the audit key), `dropped`
//! (`count` calls not recorded before this point), `recovered` (a torn tail moved aside at
//! start, see below).
//!
//! # Signatures
//!
//! `DATA_DIR/audit/key` (0600) holds 32 random bytes. A checkpoint record, written every
//! [`AuditConfig::checkpoint_every`] records and on clean shutdown, carries
//! `sig = BLAKE3-keyed(key, "torpor audit checkpoint v1\n{seq}\n{prev}")`; `DATA_DIR/audit/head`
//! carries the last record's `seq` and `hash` signed the same way, rewritten after every batch.
//! The plain chain detects an edit, a removal or a reordering by someone who does not rehash
//! what follows; the signatures detect a rewritten chain (rehashed by someone without the key)
//! and the head detects records removed from the end.
//!
//! A keyed hash rather than ed25519: verification happens on this machine with the same key
//! (`torpor audit verify` reads it), so a public-key signature would prove nothing more, and
//! BLAKE3's keyed mode is a MAC the workspace already depends on. Anyone who can read the key
//! (root, the daemon's user) can forge; an anchor off the machine needs the checkpoints shipped
//! elsewhere, so each checkpoint is also logged (`tracing`, `audit checkpoint`) for a log
//! shipper to carry.
//!
//! # Crashes
//!
//! A batch is written with one `write` and made durable with `fdatasync` before the head moves
//! on, so a crash can only leave a torn tail: bytes after the last newline, or whole lines at
//! the end of the last file that do not verify on their own. At start they are copied to
//! `audit-NNNNNN.torn-OFFSET` (evidence, 0600), cut from the file, and a `recovered` record
//! (how many bytes, their BLAKE3, where they went) continues the chain from the last good
//! record. If the signed head had reached further than what is left, records that had been made
//! durable are gone (truncation, not a crash): the `recovered` record says how many, and
//! `verify` fails on it.
//!
//! # Never blocking a request
//!
//! The middleware hands a record to a writer thread over a bounded channel
//! ([`AuditConfig::channel_capacity`]) with `try_send`: no disk I/O, no await. The thread
//! drains whatever is queued (up to [`MAX_BATCH`]), writes it with one `write` and one
//! `fdatasync`, then signs the head. Batches are made durable at most every
//! [`COMMIT_EVERY`] (group commit): a record that comes sooner after the last batch waits
//! for the rest of that interval with whatever else comes, so a steady stream of calls costs
//! ~20 batches (three syncs each) a second, not one per call. (One exec at a time spent
//! nearly half of the daemon's CPU on the audit thread's syncs before: measured with `perf`,
//! docs/BENCHMARKS.md.) What a crash can lose is what was queued: now up to that interval of
//! calls instead of one sync's time. When the channel is full (the disk stalls) the call still
//! proceeds: `torpor_audit_dropped_total` rises and the next batch starts with a `dropped`
//! record saying how many calls went unrecorded, so the gap is itself in the chain. Blocking
//! instead would let a slow disk stall every tenant's calls, the very outage the tenant
//! boundary forbids; and the writer's throughput (thousands of records per fsync) is far above
//! what the API can produce, so drops mean a stalled disk, not a busy one.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::body::{Body, HttpBody};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::IntCounter;
use serde::{Deserialize, Serialize};
use torpor_core::{SandboxId, TenantId};

use crate::{auth::constant_time_eq, state::ApiState};

/// `DATA_DIR/audit`.
pub const AUDIT_DIR: &str = "audit";
/// The signing key, in the audit directory.
pub const KEY_FILE: &str = "key";
/// The signed chain head, in the audit directory.
pub const HEAD_FILE: &str = "head";
/// [`AuditConfig::commit_every`]'s default: at most 20 batches a second.
pub const COMMIT_EVERY: std::time::Duration = std::time::Duration::from_millis(50);
/// The most records one batch (one write, one fsync) takes from the channel.
pub const MAX_BATCH: usize = 1024;
/// The actor of a call that carried no valid credential.
pub const ANONYMOUS: &str = "anonymous";
/// `prev` of the first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const FORMAT_VERSION: u32 = 1;
const RECORD_CONTEXT: &str = "torpor audit record v1";
/// `,"hash":"` + 64 hex digits + `"}`.
const HASH_MEMBER: &[u8] = b",\"hash\":\"";
const HASH_SUFFIX_LEN: usize = HASH_MEMBER.len() + 64 + 2;
/// Error bodies larger than this are not read for their code.
const MAX_ERROR_BODY: u64 = 16 * 1024;
/// Names from a path longer than this (or with other characters) are not copied.
const MAX_NAME: usize = 128;

/// How the log is written.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// A checkpoint record after this many records.
    pub checkpoint_every: u64,
    /// A file is closed and the next one started before it would grow past this.
    pub max_file_bytes: u64,
    /// Records waiting for the writer; beyond it calls go unrecorded (and counted).
    pub channel_capacity: usize,
    /// The least time between two batches made durable: records that come sooner wait in the
    /// channel and go in the next batch together (group commit). A call is never delayed by
    /// it (the middleware only queues); what it bounds is the writer's syncs, each of which
    /// costs the whole machine CPU (on a virtual disk, a VM exit per block).
    pub commit_every: std::time::Duration,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            checkpoint_every: 1000,
            max_file_bytes: 64 << 20,
            channel_capacity: 8192,
            commit_every: COMMIT_EVERY,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("cannot {action} {}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no audit log in {}", .0.display())]
    NoLog(PathBuf),
    #[error(
        "the audit key {} is missing but the log has records: restore it (or move the log \
         away) before starting",
        .0.display()
    )]
    KeyMissing(PathBuf),
    #[error("the audit key {} is not 64 hex digits", .0.display())]
    BadKey(PathBuf),
    #[error("the last record of {} cannot be read: run `torpor audit verify`", .0.display())]
    Damaged(PathBuf),
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> AuditError + 'a {
    move |source| AuditError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// What a call named in its path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Object {
    /// `sandbox`, `template`, `tenant`, `pool` or `snapshot`.
    pub kind: String,
    pub name: String,
}

/// One API call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    /// The `x-request-id` the response carried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// A tenant name, `admin` or `anonymous`.
    pub actor: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    pub method: String,
    /// The route template (`/v1/sandboxes/{id}/exec`), never the query string.
    pub route: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<Object>,
    pub status: u16,
    /// The stable error code of a refusal (`not_found`, `rate_limited`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

/// What a record says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    Call(Call),
    /// The chain head before this record (`prev`), signed with the audit key.
    Checkpoint {
        sig: String,
    },
    /// `count` calls were not recorded before this point (the writer was behind or failing).
    Dropped {
        count: u64,
    },
    /// At start, a torn tail of the last file was moved aside (see the module doc).
    Recovered {
        discarded_bytes: u64,
        discarded_hash: String,
        kept_in: String,
        /// Records the signed head had reached beyond what was left: removed, not torn.
        missing_records: u64,
    },
}

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub v: u32,
    pub seq: u64,
    /// RFC 3339, milliseconds, UTC.
    pub time: String,
    #[serde(flatten)]
    pub event: Event,
    pub prev: String,
    /// Present on a line read back; absent while encoding (it hashes everything else).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
}

/// The signed chain head (`DATA_DIR/audit/head`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Head {
    v: u32,
    seq: u64,
    hash: String,
    sig: String,
}

fn record_hash(body: &[u8]) -> String {
    let mut h = blake3::Hasher::new_derive_key(RECORD_CONTEXT);
    h.update(body);
    h.finalize().to_hex().to_string()
}

fn checkpoint_sig(key: &[u8; 32], seq: u64, prev: &str) -> String {
    let msg = format!("torpor audit checkpoint v1\n{seq}\n{prev}");
    blake3::keyed_hash(key, msg.as_bytes()).to_hex().to_string()
}

fn head_sig(key: &[u8; 32], seq: u64, hash: &str) -> String {
    let msg = format!("torpor audit head v1\n{seq}\n{hash}");
    blake3::keyed_hash(key, msg.as_bytes()).to_hex().to_string()
}

/// The line of `rec` (newline included) and its hash.
fn encode(rec: &Record) -> Result<(Vec<u8>, String), serde_json::Error> {
    let mut line = serde_json::to_vec(rec)?;
    let hash = record_hash(&line);
    line.pop(); // the closing brace: the hash member goes before it
    line.extend_from_slice(HASH_MEMBER);
    line.extend_from_slice(hash.as_bytes());
    line.extend_from_slice(b"\"}\n");
    Ok((line, hash))
}

/// A line (without its newline) checked against its own hash, and its record.
fn decode(line: &[u8]) -> Result<Record, Problem> {
    if line.len() <= HASH_SUFFIX_LEN {
        return Err(Problem::Malformed);
    }
    let (body, suffix) = line.split_at(line.len() - HASH_SUFFIX_LEN);
    let hex = &suffix[HASH_MEMBER.len()..HASH_MEMBER.len() + 64];
    if !suffix.starts_with(HASH_MEMBER)
        || !suffix.ends_with(b"\"}")
        || !hex
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    {
        return Err(Problem::Malformed);
    }
    let mut canonical = Vec::with_capacity(body.len() + 1);
    canonical.extend_from_slice(body);
    canonical.push(b'}');
    if record_hash(&canonical).as_bytes() != hex {
        return Err(Problem::HashMismatch);
    }
    let mut rec: Record = serde_json::from_slice(&canonical).map_err(|_| Problem::Malformed)?;
    if rec.hash.is_some() || rec.v != FORMAT_VERSION {
        return Err(Problem::Malformed);
    }
    rec.hash = Some(String::from_utf8_lossy(hex).into_owned());
    Ok(rec)
}

fn now_rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

mod files;
mod middleware;
mod verify;
mod writer;

use files::*;
pub use middleware::*;
pub use verify::*;
pub use writer::*;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn call(actor: &str, n: u16) -> Call {
        Call {
            request_id: Some(format!("req-{n}")),
            actor: actor.into(),
            remote: Some("127.0.0.1:4000".into()),
            method: "POST".into(),
            route: "/v1/sandboxes".into(),
            object: Some(Object {
                kind: "sandbox".into(),
                name: format!("sbx-{n}"),
            }),
            status: 201,
            code: None,
        }
    }

    /// A fresh directory, removed afterwards.
    struct TempDir(PathBuf);

    impl TempDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "torpor-audit-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn cfg(checkpoint_every: u64, max_file_bytes: u64) -> AuditConfig {
        AuditConfig {
            checkpoint_every,
            max_file_bytes,
            channel_capacity: 64,
            // Every batch at once, as the tests' timings expect (group commit has its own).
            commit_every: std::time::Duration::ZERO,
        }
    }

    /// Records in the log's files now (durable or not yet read back: what a reader sees).
    fn lines_on_disk(tmp: &TempDir) -> usize {
        let dir = tmp.path().join(AUDIT_DIR);
        list_files(&dir)
            .unwrap()
            .iter()
            .map(|(_, p)| std::fs::read_to_string(p).unwrap().lines().count())
            .sum()
    }

    #[test]
    fn calls_soon_after_a_batch_wait_for_the_next_one_together() {
        let tmp = tempdir();
        let log = AuditLog::open(
            tmp.path(),
            AuditConfig {
                commit_every: std::time::Duration::from_millis(600),
                ..cfg(1000, 1 << 20)
            },
            None,
        )
        .unwrap();
        let wait_for = |n: usize| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while lines_on_disk(&tmp) < n {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{n} records never came"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        // The first call after a quiet spell is written at once.
        log.record(call("team-a", 0));
        wait_for(1);
        let first = std::time::Instant::now();
        // The next ones, right after, wait for the interval and go together.
        log.record(call("team-a", 1));
        log.record(call("team-a", 2));
        std::thread::sleep(std::time::Duration::from_millis(100));
        if first.elapsed() < std::time::Duration::from_millis(500) {
            assert_eq!(
                lines_on_disk(&tmp),
                1,
                "a batch came before the interval was up"
            );
        }
        wait_for(3);
        assert!(
            first.elapsed() >= std::time::Duration::from_millis(450),
            "the second batch came {:?} after the first",
            first.elapsed()
        );
        log.close_blocking();
        verify(tmp.path()).unwrap();
    }

    /// A log of `n` calls in a fresh data directory, closed (so it ends with a checkpoint).
    fn log_of(n: u16, c: AuditConfig) -> TempDir {
        let tmp = tempdir();
        let log = AuditLog::open(tmp.path(), c, None).unwrap();
        for i in 0..n {
            log.record(call("team-a", i));
        }
        log.close_blocking();
        tmp
    }

    fn file(tmp: &TempDir, n: u32) -> PathBuf {
        tmp.path().join(AUDIT_DIR).join(file_name(n))
    }

    fn lines_of(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn write_lines(path: &Path, lines: &[String]) {
        std::fs::write(
            path,
            lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .unwrap();
    }

    fn bad(tmp: &TempDir) -> BadRecord {
        match verify(tmp.path()) {
            Err(VerifyError::Bad(b)) => b,
            other => panic!("expected a bad record, got {other:?}"),
        }
    }

    #[test]
    fn an_untouched_log_verifies_and_ends_with_a_checkpoint() {
        let tmp = log_of(10, cfg(4, 1 << 20));
        let r = verify(tmp.path()).unwrap();
        // 10 calls, a checkpoint after every 4 records, one at close.
        assert_eq!(r.records, 10 + 3);
        assert_eq!(r.checkpoints, 3);
        assert!(r.ends_with_checkpoint);
        assert_eq!(r.files, 1);
        let dir = tmp.path().join(AUDIT_DIR);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        for f in [KEY_FILE, HEAD_FILE, "audit-000001.jsonl"] {
            assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
        }
        let recs = tail(tmp.path(), None, 100).unwrap();
        assert_eq!(recs.len(), 13);
        assert_eq!(recs[0].prev, GENESIS);
        assert!(recs
            .windows(2)
            .all(|w| w[1].prev == *w[0].hash.as_ref().unwrap()));
        assert!(recs.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    }

    #[test]
    fn an_edited_line_is_a_hash_mismatch_naming_it() {
        let tmp = log_of(6, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        let mut lines = lines_of(&path);
        lines[2] = lines[2].replace("\"status\":201", "\"status\":200");
        write_lines(&path, &lines);
        let b = bad(&tmp);
        assert_eq!((b.file.as_str(), b.line), ("audit-000001.jsonl", 3));
        assert_eq!(b.problem, Problem::HashMismatch);
    }

    #[test]
    fn a_rehashed_chain_without_the_key_fails_its_signatures() {
        // The attacker edits a record and recomputes every hash after it: the chain is whole
        // again, but the checkpoint (and head) signatures are not.
        let tmp = log_of(6, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        let mut prev = GENESIS.to_string();
        let mut out = Vec::new();
        for (i, line) in lines_of(&path).iter().enumerate() {
            let mut rec = decode(line.as_bytes()).unwrap();
            rec.hash = None;
            rec.prev = prev.clone();
            if i == 1 {
                if let Event::Call(c) = &mut rec.event {
                    c.actor = "someone-else".into();
                }
            }
            let (l, h) = encode(&rec).unwrap();
            out.push(String::from_utf8(l).unwrap().trim_end().to_string());
            prev = h;
        }
        write_lines(&path, &out);
        let b = bad(&tmp);
        assert_eq!(b.line, 7, "the closing checkpoint");
        assert_eq!(b.problem, Problem::BadSignature);
    }

    #[test]
    fn a_record_appended_without_the_key_is_reported_unsigned() {
        let tmp = log_of(2, cfg(1000, 1 << 20));
        assert_eq!(verify(tmp.path()).unwrap().unsigned_tail, 0);
        let path = file(&tmp, 1);
        let last = decode(lines_of(&path).last().unwrap().as_bytes()).unwrap();
        let forged = Record {
            v: FORMAT_VERSION,
            seq: last.seq + 1,
            time: now_rfc3339(SystemTime::now()),
            event: Event::Call(call("team-a", 7)),
            prev: last.hash.unwrap(),
            hash: None,
        };
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&encode(&forged).unwrap().0).unwrap();
        let r = verify(tmp.path()).unwrap();
        assert_eq!(r.unsigned_tail, 1);
        assert!(!r.ends_with_checkpoint);
    }

    #[test]
    fn a_removed_line_is_named() {
        let tmp = log_of(6, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        let mut lines = lines_of(&path);
        lines.remove(3);
        write_lines(&path, &lines);
        let b = bad(&tmp);
        assert_eq!(b.line, 4);
        assert_eq!(
            b.problem,
            Problem::Removed {
                expected: 4,
                found: 5
            }
        );
    }

    #[test]
    fn reordered_lines_are_named() {
        let tmp = log_of(6, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        let mut lines = lines_of(&path);
        lines.swap(1, 2);
        write_lines(&path, &lines);
        let b = bad(&tmp);
        assert_eq!(b.line, 2);
        assert_eq!(
            b.problem,
            Problem::Reordered {
                expected: 2,
                found: 3
            }
        );
    }

    #[test]
    fn records_removed_from_the_end_are_caught_by_the_signed_head() {
        let tmp = log_of(6, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        let mut lines = lines_of(&path);
        lines.truncate(4);
        write_lines(&path, &lines);
        let b = bad(&tmp);
        assert_eq!(b.file, HEAD_FILE);
        assert_eq!(b.problem, Problem::Truncated { head: 7, last: 4 });
        // A restart does not launder it: the gap is written into the chain and verify
        // still fails, naming the record that says so.
        let log = AuditLog::open(tmp.path(), cfg(1000, 1 << 20), None).unwrap();
        log.close_blocking();
        let b = bad(&tmp);
        assert_eq!(b.line, 5);
        assert_eq!(b.problem, Problem::RecordsLost { missing: 3 });
    }

    #[test]
    fn a_torn_last_line_is_reported_then_moved_aside_at_start() {
        let tmp = log_of(3, cfg(1000, 1 << 20));
        let path = file(&tmp, 1);
        // A crash mid-write: part of a line, no newline.
        const TORN: &[u8] = br#"{"v":1,"seq":5,"time":"2025-"#;
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(TORN).unwrap();
        drop(f);
        let b = bad(&tmp);
        assert_eq!((b.line, b.problem), (5, Problem::TornTail));

        let log = AuditLog::open(tmp.path(), cfg(1000, 1 << 20), None).unwrap();
        log.record(call("team-a", 99));
        log.close_blocking();
        let r = verify(tmp.path()).unwrap();
        assert_eq!(r.recoveries, 1);
        let recs = tail(tmp.path(), None, 3).unwrap();
        assert!(
            matches!(&recs[0].event, Event::Recovered { discarded_bytes, missing_records: 0, kept_in, .. }
                if *discarded_bytes == TORN.len() as u64 && kept_in.starts_with("audit-000001.torn-")),
            "{recs:?}"
        );
        let aside = std::fs::read_dir(tmp.path().join(AUDIT_DIR))
            .unwrap()
            .filter_map(|e| e.ok())
            .find(|e| e.file_name().to_string_lossy().contains(".torn-"))
            .unwrap();
        assert_eq!(std::fs::read(aside.path()).unwrap(), TORN);
    }

    #[test]
    fn the_chain_continues_across_rotation_and_restarts() {
        let tmp = tempdir();
        let c = cfg(5, 2048);
        for round in 0..3u16 {
            let log = AuditLog::open(tmp.path(), c.clone(), None).unwrap();
            for i in 0..20 {
                log.record(call("team-a", round * 100 + i));
            }
            log.close_blocking();
        }
        let r = verify(tmp.path()).unwrap();
        assert!(r.files >= 3, "rotated: {r:?}");
        assert_eq!(r.records - r.checkpoints, 60);
        assert_eq!(r.recoveries, 0);
        for (_, p) in list_files(&tmp.path().join(AUDIT_DIR)).unwrap() {
            assert!(
                std::fs::metadata(&p).unwrap().len() <= 2048,
                "{}",
                p.display()
            );
        }
        // The first record of file 2 links to the last of file 1.
        let last_of_1 = decode(lines_of(&file(&tmp, 1)).last().unwrap().as_bytes()).unwrap();
        let first_of_2 = decode(lines_of(&file(&tmp, 2))[0].as_bytes()).unwrap();
        assert_eq!(first_of_2.prev, last_of_1.hash.unwrap());
        assert_eq!(first_of_2.seq, last_of_1.seq + 1);
        // A whole file removed is named.
        std::fs::remove_file(file(&tmp, 2)).unwrap();
        let b = bad(&tmp);
        assert_eq!(b.file, "audit-000003.jsonl");
        assert_eq!(b.problem, Problem::MissingFile("audit-000002.jsonl".into()));
    }

    #[test]
    fn a_full_queue_records_the_gap_in_the_chain() {
        let tmp = tempdir();
        let log = AuditLog::open(
            tmp.path(),
            AuditConfig {
                channel_capacity: 2,
                ..cfg(1000, 1 << 20)
            },
            None,
        )
        .unwrap();
        let release = log.hold();
        for i in 0..5 {
            log.record(call("team-a", i)); // two fit, three do not
        }
        assert_eq!(log.dropped_total.get(), 3);
        release.send(()).unwrap();
        // Once the writer has taken the two queued calls, there is room again.
        log.hold().send(()).unwrap();
        log.record(call("team-a", 9));
        log.close_blocking();
        let r = verify(tmp.path()).unwrap();
        assert_eq!(r.dropped_calls, 3);
        let kinds: Vec<_> = tail(tmp.path(), None, 10)
            .unwrap()
            .into_iter()
            .map(|r| match r.event {
                Event::Call(c) => c.object.unwrap().name,
                Event::Dropped { count } => format!("dropped {count}"),
                Event::Checkpoint { .. } => "checkpoint".into(),
                Event::Recovered { .. } => "recovered".into(),
            })
            .collect();
        assert_eq!(
            kinds,
            ["dropped 3", "sbx-0", "sbx-1", "sbx-9", "checkpoint"],
            "the gap opens the batch after it"
        );
    }

    #[test]
    fn a_log_without_its_key_does_not_open() {
        let tmp = log_of(2, cfg(1000, 1 << 20));
        std::fs::remove_file(tmp.path().join(AUDIT_DIR).join(KEY_FILE)).unwrap();
        assert!(matches!(
            AuditLog::open(tmp.path(), cfg(1000, 1 << 20), None),
            Err(AuditError::KeyMissing(_))
        ));
        assert!(matches!(
            verify(tmp.path()),
            Err(VerifyError::Read(AuditError::KeyMissing(_)))
        ));
    }

    #[test]
    fn tail_filters_by_tenant() {
        let tmp = tempdir();
        let log = AuditLog::open(tmp.path(), cfg(1000, 1 << 20), None).unwrap();
        for i in 0..6 {
            log.record(call(if i % 2 == 0 { "team-a" } else { "team-b" }, i));
        }
        log.close_blocking();
        let b: Vec<_> = tail(tmp.path(), Some("team-b"), 2)
            .unwrap()
            .into_iter()
            .map(|r| match r.event {
                Event::Call(c) => (c.actor, c.object.unwrap().name),
                e => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(
            b,
            [
                ("team-b".to_string(), "sbx-3".to_string()),
                ("team-b".to_string(), "sbx-5".to_string())
            ]
        );
    }

    #[test]
    fn routes_are_templates_with_their_object_and_no_query() {
        let r = classify(None, "/v1/sandboxes/sbx-1/exec", None).unwrap();
        assert_eq!(r.template, "/v1/sandboxes/{id}/exec");
        assert_eq!(
            r.object,
            Some(Object {
                kind: "sandbox".into(),
                name: "sbx-1".into()
            })
        );
        let r = classify(None, "/v1/sandboxes/sbx-1/ports/8000/cb/secret-token", None).unwrap();
        assert_eq!(r.template, "/v1/sandboxes/{id}/ports/{port}/{*path}");
        assert!(r.proxied);
        let r = classify(None, "/v1/tenants/team-a", None).unwrap();
        assert_eq!(r.object.unwrap().kind, "tenant");
        let r = classify(None, "/v1/templates/a%20b", None).unwrap();
        assert_eq!(r.object.unwrap().name, "(invalid)");
        let r = classify(None, "/process.Process/Start", Some("sbx-9")).unwrap();
        assert_eq!(r.template, "/process.Process/Start");
        assert!(r.envd);
        assert_eq!(r.object.unwrap().name, "sbx-9");
        let r = classify(None, "/process.Process/<script>", None).unwrap();
        assert_eq!(r.template, "/process.Process/{method}");
        let r = classify(Some("8000-sbx-3.localhost:7077"), "/anything", None).unwrap();
        assert_eq!(r.template, "{port}-{id}.localhost/{*path}");
        assert_eq!(r.object.unwrap().name, "sbx-3");
        assert!(classify(None, "/v1/nothing", None).is_none());
        assert!(classify(None, "/v1/sandboxes/", None).is_none());
    }

    #[test]
    fn only_mutating_and_refused_calls_are_audited() {
        let obj = classify(None, "/v1/sandboxes/sbx-1", None);
        let list = classify(None, "/v1/sandboxes", None);
        assert!(audited(&Method::POST, 201, list.as_ref()));
        assert!(audited(&Method::DELETE, 204, obj.as_ref()));
        assert!(!audited(&Method::GET, 200, obj.as_ref()));
        assert!(audited(&Method::GET, 404, obj.as_ref()));
        assert!(!audited(&Method::GET, 404, list.as_ref()));
        assert!(audited(&Method::GET, 401, list.as_ref()));
        assert!(audited(&Method::GET, 429, None));
        assert!(!audited(&Method::POST, 404, None), "no such route");
    }

    #[test]
    fn only_codes_are_taken_from_error_bodies() {
        assert_eq!(
            error_code_of(br#"{"error":{"code":"not_found","message":"sandbox x"}}"#).as_deref(),
            Some("not_found")
        );
        assert_eq!(
            error_code_of(br#"{"code":"unauthenticated","message":"m"}"#).as_deref(),
            Some("unauthenticated")
        );
        assert_eq!(error_code_of(br#"{"code":404,"message":"m"}"#), None);
        assert_eq!(error_code_of(br#"{"error":{"code":"Secret Value"}}"#), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any single byte of any line changed to any other value: verify fails.
        #[test]
        fn any_single_byte_change_is_detected(pick in any::<prop::sample::Index>(), to in any::<u8>()) {
            let tmp = log_of(4, cfg(2, 1 << 20));
            let path = file(&tmp, 1);
            let mut bytes = std::fs::read(&path).unwrap();
            let i = pick.index(bytes.len());
            prop_assume!(bytes[i] != to);
            bytes[i] = to;
            std::fs::write(&path, &bytes).unwrap();
            prop_assert!(matches!(verify(tmp.path()), Err(VerifyError::Bad(_))));
        }
    }
}
