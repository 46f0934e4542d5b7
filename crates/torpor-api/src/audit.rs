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
//! `fdatasync`, then signs the head. When the channel is full (the disk stalls) the call still
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
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            checkpoint_every: 1000,
            max_file_bytes: 64 << 20,
            channel_capacity: 8192,
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

// ---------------------------------------------------------------------------------------------
// Files

fn file_name(n: u32) -> String {
    format!("audit-{n:06}.jsonl")
}

/// The log's files, by number.
fn list_files(dir: &Path) -> Result<Vec<(u32, PathBuf)>, AuditError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("read", dir))? {
        let entry = entry.map_err(io_err("read", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(n) = name
            .strip_prefix("audit-")
            .and_then(|r| r.strip_suffix(".jsonl"))
            .filter(|d| d.len() >= 6 && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<u32>().ok())
        else {
            continue;
        };
        files.push((n, entry.path()));
    }
    files.sort();
    Ok(files)
}

/// Complete lines of `bytes` as (start, end) without the newline, and where the torn rest
/// (bytes after the last newline) starts.
fn split_lines(bytes: &[u8]) -> (Vec<(usize, usize)>, usize) {
    let mut lines = Vec::new();
    let mut start = 0;
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'\n' {
            lines.push((start, i));
            start = i + 1;
        }
    }
    (lines, start)
}

fn read_key(dir: &Path) -> Result<[u8; 32], AuditError> {
    let path = dir.join(KEY_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            AuditError::KeyMissing(path.clone())
        } else {
            io_err("read", &path)(e)
        }
    })?;
    let text = text.trim();
    let mut key = [0u8; 32];
    if text.len() != 64 {
        return Err(AuditError::BadKey(path));
    }
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
            .map_err(|_| AuditError::BadKey(path.clone()))?;
    }
    Ok(key)
}

fn create_key(dir: &Path) -> Result<[u8; 32], AuditError> {
    let path = dir.join(KEY_FILE);
    let mut key = [0u8; 32];
    {
        use std::io::Read;
        File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(io_err("read", Path::new("/dev/urandom")))?;
    }
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("create", &path))?;
    f.write_all(hex.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(io_err("write", &path))?;
    sync_dir(dir);
    Ok(key)
}

fn read_head(dir: &Path, key: &[u8; 32]) -> Option<Head> {
    let text = std::fs::read(dir.join(HEAD_FILE)).ok()?;
    let head: Head = serde_json::from_slice(&text).ok()?;
    (head.v == FORMAT_VERSION && head.sig == head_sig(key, head.seq, &head.hash)).then_some(head)
}

fn sync_dir(dir: &Path) {
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot sync the audit directory");
    }
}

fn open_append(path: &Path, create_new: bool) -> Result<File, AuditError> {
    let f = OpenOptions::new()
        .append(true)
        .create(true)
        .create_new(create_new)
        .mode(0o600)
        .open(path)
        .map_err(io_err("open", path))?;
    // Files made before this version (or by hand) may be wider.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(io_err("chmod", path))?;
    Ok(f)
}

// ---------------------------------------------------------------------------------------------
// The writer

enum Msg {
    Call(Box<Call>, SystemTime),
    Close,
    /// Tests: the writer acknowledges, then waits for the release before reading on.
    #[cfg(test)]
    Hold(mpsc::Sender<()>, Receiver<()>),
}

/// The handle: [`AuditLog::record`] never blocks; [`AuditLog::close`] writes the final
/// checkpoint.
pub struct AuditLog {
    tx: SyncSender<Msg>,
    /// Calls refused by a full channel since the writer last looked; it records them as a gap.
    unrecorded: Arc<AtomicU64>,
    dropped_total: IntCounter,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The end of the chain as found on disk.
struct ChainEnd {
    seq: u64,
    hash: String,
    since_checkpoint: u64,
}

impl AuditLog {
    /// Opens (or starts) the log in `data_dir/audit`, repairing a torn tail, and starts its
    /// writer. The caller must hold the data directory (one daemon per directory): the repair
    /// cuts the last file. With `metrics`, `torpor_audit_records_total` and
    /// `torpor_audit_dropped_total` are registered there.
    pub fn open(
        data_dir: &Path,
        cfg: AuditConfig,
        metrics: Option<&torpor_control::metrics::Metrics>,
    ) -> Result<Arc<AuditLog>, AuditError> {
        let dir = data_dir.join(AUDIT_DIR);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io_err("create", &dir))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("chmod", &dir))?;
        let mut files = list_files(&dir)?;
        let key = if dir.join(KEY_FILE).exists() || !files.is_empty() {
            read_key(&dir)?
        } else {
            create_key(&dir)?
        };
        let head = read_head(&dir, &key);
        if head.is_none() && !files.is_empty() {
            tracing::warn!(dir = %dir.display(), "the audit head is missing or its signature is bad");
        }
        if files.is_empty() {
            let path = dir.join(file_name(1));
            drop(open_append(&path, false)?);
            sync_dir(&dir);
            files.push((1, path));
        }
        let (file_no, path) = files.last().cloned().expect("one file at least");
        let (end, recovered) = recover_tail(&dir, &files, head.as_ref(), cfg.checkpoint_every)?;
        let file = open_append(&path, false)?;
        let file_len = file.metadata().map_err(io_err("stat", &path))?.len();

        let records_total = IntCounter::new(
            "torpor_audit_records_total",
            "Records appended to the audit log (calls, checkpoints, gaps).",
        )
        .expect("valid metric");
        let dropped_total = IntCounter::new(
            "torpor_audit_dropped_total",
            "Calls that should have been audited but were not (writer behind or failing).",
        )
        .expect("valid metric");
        if let Some(m) = metrics {
            m.register(Box::new(records_total.clone()));
            m.register(Box::new(dropped_total.clone()));
        }
        let unrecorded = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::sync_channel(cfg.channel_capacity.max(1));
        let writer = Writer {
            dir: dir.clone(),
            key,
            file,
            file_no,
            file_len,
            seq: end.seq,
            last_hash: end.hash.clone(),
            since_checkpoint: end.since_checkpoint,
            committed: (end.seq, end.hash, end.since_checkpoint),
            head_seq: head.as_ref().map_or(0, |h| h.seq),
            pending: Vec::new(),
            pending_records: 0,
            pending_calls: 0,
            unrecorded: unrecorded.clone(),
            records_total,
            dropped_total: dropped_total.clone(),
            cfg,
        };
        let handle = std::thread::Builder::new()
            .name("torpor-audit".into())
            .spawn(move || writer.run(rx, recovered))
            .map_err(io_err("start the writer of", &dir))?;
        Ok(Arc::new(AuditLog {
            tx,
            unrecorded,
            dropped_total,
            writer: Mutex::new(Some(handle)),
        }))
    }

    /// Queues one call; never blocks. A full queue counts it as dropped (and the next batch
    /// records the gap).
    pub fn record(&self, call: Call) {
        match self
            .tx
            .try_send(Msg::Call(Box::new(call), SystemTime::now()))
        {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.unrecorded.fetch_add(1, Ordering::Relaxed);
                self.dropped_total.inc();
            }
            Err(TrySendError::Disconnected(_)) => self.dropped_total.inc(),
        }
    }

    /// Writes what is queued and a final checkpoint, and stops the writer. Later calls to
    /// [`record`](Self::record) are counted as dropped.
    pub async fn close(self: &Arc<Self>) {
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || me.close_blocking()).await;
    }

    /// [`close`](Self::close) for a thread that may block.
    pub fn close_blocking(&self) {
        let handle = match self.writer.lock() {
            Ok(mut w) => w.take(),
            Err(_) => return,
        };
        if let Some(handle) = handle {
            // The queue may be full: this waits for room, off the runtime.
            let _ = self.tx.send(Msg::Close);
            let _ = handle.join();
        }
    }

    #[cfg(test)]
    fn hold(&self) -> mpsc::Sender<()> {
        let (ack_tx, ack_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        self.tx.send(Msg::Hold(ack_tx, release_rx)).unwrap();
        ack_rx.recv().unwrap();
        release_tx
    }
}

impl Drop for AuditLog {
    fn drop(&mut self) {
        self.close_blocking();
    }
}

/// Finds the end of the chain; a torn tail of the last file is moved aside and reported as the
/// `recovered` event to write first.
fn recover_tail(
    dir: &Path,
    files: &[(u32, PathBuf)],
    head: Option<&Head>,
    checkpoint_every: u64,
) -> Result<(ChainEnd, Option<Event>), AuditError> {
    let (file_no, path) = files.last().expect("one file at least");
    let bytes = std::fs::read(path).map_err(io_err("read", path))?;
    let (lines, _) = split_lines(&bytes);
    let mut keep = lines.len();
    let mut last = None;
    while keep > 0 {
        let (s, e) = lines[keep - 1];
        if let Ok(rec) = decode(&bytes[s..e]) {
            last = Some(rec);
            break;
        }
        keep -= 1;
    }
    let good_len = if keep == 0 { 0 } else { lines[keep - 1].1 + 1 };
    let mut end = match last {
        Some(rec) => ChainEnd {
            seq: rec.seq,
            hash: rec.hash.unwrap_or_default(),
            since_checkpoint: 0,
        },
        None => chain_end_before(files)?,
    };
    // Records since the last checkpoint in this file (an estimate across files: a checkpoint
    // comes a little early, never late).
    if keep > 0 {
        for &(s, e) in lines[..keep].iter().rev() {
            match decode(&bytes[s..e]) {
                Ok(Record {
                    event: Event::Checkpoint { .. },
                    ..
                }) => break,
                _ => end.since_checkpoint += 1,
            }
            if end.since_checkpoint >= checkpoint_every {
                break;
            }
        }
    }
    let missing = head.map_or(0, |h| h.seq.saturating_sub(end.seq));
    let discarded = &bytes[good_len..];
    if discarded.is_empty() && missing == 0 {
        return Ok((end, None));
    }
    let mut kept_in = String::new();
    if !discarded.is_empty() {
        kept_in = format!("audit-{file_no:06}.torn-{good_len}");
        let aside = dir.join(&kept_in);
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&aside)
            .map_err(io_err("create", &aside))?;
        f.write_all(discarded)
            .and_then(|_| f.sync_all())
            .map_err(io_err("write", &aside))?;
        let f = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io_err("open", path))?;
        f.set_len(good_len as u64)
            .and_then(|_| f.sync_all())
            .map_err(io_err("truncate", path))?;
        sync_dir(dir);
        tracing::warn!(
            file = %path.display(),
            bytes = discarded.len(),
            kept_in = %kept_in,
            "audit log: a torn tail (a crash during a write) was moved aside"
        );
    }
    if missing > 0 {
        tracing::error!(
            head_seq = head.map_or(0, |h| h.seq),
            last_seq = end.seq,
            "audit log: records the signed head had reached are gone (removed from the end)"
        );
    }
    Ok((
        end,
        Some(Event::Recovered {
            discarded_bytes: discarded.len() as u64,
            discarded_hash: blake3::hash(discarded).to_hex().to_string(),
            kept_in,
            missing_records: missing,
        }),
    ))
}

/// The chain's end when the last file holds no good record: the previous file's last record.
fn chain_end_before(files: &[(u32, PathBuf)]) -> Result<ChainEnd, AuditError> {
    let Some((_, path)) = files.iter().rev().nth(1) else {
        return Ok(ChainEnd {
            seq: 0,
            hash: GENESIS.into(),
            since_checkpoint: 0,
        });
    };
    let bytes = std::fs::read(path).map_err(io_err("read", path))?;
    let (lines, _) = split_lines(&bytes);
    let rec = lines
        .last()
        .and_then(|&(s, e)| decode(&bytes[s..e]).ok())
        .ok_or_else(|| AuditError::Damaged(path.clone()))?;
    Ok(ChainEnd {
        seq: rec.seq,
        hash: rec.hash.unwrap_or_default(),
        since_checkpoint: 0,
    })
}

/// Owns the open file and the chain's end; runs on its own thread.
struct Writer {
    dir: PathBuf,
    key: [u8; 32],
    cfg: AuditConfig,
    file: File,
    file_no: u32,
    /// Bytes of the current file written and synced.
    file_len: u64,
    seq: u64,
    last_hash: String,
    since_checkpoint: u64,
    /// (seq, hash, since_checkpoint) as of the last durable write: where a failed write
    /// goes back to.
    committed: (u64, String, u64),
    head_seq: u64,
    /// Lines encoded, not yet written.
    pending: Vec<u8>,
    pending_records: u64,
    pending_calls: u64,
    unrecorded: Arc<AtomicU64>,
    records_total: IntCounter,
    dropped_total: IntCounter,
}

impl Writer {
    fn run(mut self, rx: Receiver<Msg>, recovered: Option<Event>) {
        let span = tracing::info_span!("audit", dir = %self.dir.display());
        let _enter = span.enter();
        if let Some(ev) = recovered {
            self.append(ev, SystemTime::now());
            self.commit();
        }
        loop {
            let Ok(first) = rx.recv() else {
                // Every handle is gone without a close: finish as for one.
                self.final_checkpoint();
                self.commit();
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let gap = self.unrecorded.swap(0, Ordering::Relaxed);
            if gap > 0 {
                self.append(Event::Dropped { count: gap }, SystemTime::now());
            }
            let mut closing = false;
            for msg in batch {
                match msg {
                    Msg::Call(call, time) => {
                        self.append(Event::Call(*call), time);
                        if self.since_checkpoint >= self.cfg.checkpoint_every {
                            self.checkpoint();
                        }
                    }
                    Msg::Close => closing = true,
                    #[cfg(test)]
                    Msg::Hold(ack, release) => {
                        let _ = ack.send(());
                        let _ = release.recv();
                    }
                }
            }
            if closing {
                self.final_checkpoint();
            }
            self.commit();
            if closing {
                return;
            }
        }
    }

    fn final_checkpoint(&mut self) {
        if self.since_checkpoint > 0 {
            self.checkpoint();
        }
    }

    fn checkpoint(&mut self) {
        let seq = self.seq + 1;
        let sig = checkpoint_sig(&self.key, seq, &self.last_hash);
        tracing::info!(seq, prev = %self.last_hash, sig = %sig, "audit checkpoint");
        self.append(Event::Checkpoint { sig }, SystemTime::now());
    }

    /// Encodes one record after the chain's end (into `pending`), moving to the next file
    /// first when this one is full.
    fn append(&mut self, event: Event, time: SystemTime) {
        let is_call = matches!(event, Event::Call(_));
        let is_checkpoint = matches!(event, Event::Checkpoint { .. });
        let mut rec = Record {
            v: FORMAT_VERSION,
            seq: self.seq + 1,
            time: now_rfc3339(time),
            event,
            prev: self.last_hash.clone(),
            hash: None,
        };
        let Some((mut line, mut hash)) = self.encode_or_count(&rec, is_call) else {
            return;
        };
        let used = self.file_len + self.pending.len() as u64;
        if used > 0 && used + line.len() as u64 > self.cfg.max_file_bytes {
            // What is pending goes to this file; then the next file. A failed write took the
            // chain's end back: this record is made again after it.
            if self.write_pending() {
                if let Err(e) = self.rotate() {
                    tracing::error!(error = %e, "cannot start the next audit file");
                }
            }
            if rec.seq != self.seq + 1 {
                rec.seq = self.seq + 1;
                rec.prev = self.last_hash.clone();
                let Some(again) = self.encode_or_count(&rec, is_call) else {
                    return;
                };
                (line, hash) = again;
            }
        }
        self.pending.extend_from_slice(&line);
        self.pending_records += 1;
        if is_call {
            self.pending_calls += 1;
        }
        self.seq = rec.seq;
        self.last_hash = hash;
        self.since_checkpoint = if is_checkpoint {
            0
        } else {
            self.since_checkpoint + 1
        };
    }

    fn encode_or_count(&mut self, rec: &Record, is_call: bool) -> Option<(Vec<u8>, String)> {
        match encode(rec) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode an audit record");
                if is_call {
                    self.lost(1);
                }
                None
            }
        }
    }

    fn lost(&mut self, calls: u64) {
        self.dropped_total.inc_by(calls);
        self.unrecorded.fetch_add(calls, Ordering::Relaxed);
    }

    /// Writes `pending` with one write and one fdatasync. On failure the file is cut back to
    /// its last durable length and the chain's end goes back with it.
    fn write_pending(&mut self) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let result = self
            .file
            .write_all(&self.pending)
            .and_then(|_| self.file.sync_data());
        let ok = result.is_ok();
        match result {
            Ok(()) => {
                self.file_len += self.pending.len() as u64;
                self.records_total.inc_by(self.pending_records);
                self.committed = (self.seq, self.last_hash.clone(), self.since_checkpoint);
            }
            Err(e) => {
                tracing::error!(
                    error = %e,
                    records = self.pending_records,
                    "cannot write the audit log; the batch is counted as dropped"
                );
                if let Err(e) = self.file.set_len(self.file_len) {
                    tracing::error!(error = %e, "cannot cut the audit file back after a failed write");
                }
                let calls = self.pending_calls;
                self.lost(calls);
                (self.seq, self.last_hash, self.since_checkpoint) = self.committed.clone();
            }
        }
        self.pending.clear();
        self.pending_records = 0;
        self.pending_calls = 0;
        ok
    }

    /// Writes what is pending, then signs the new head.
    fn commit(&mut self) {
        if self.write_pending() && self.seq != self.head_seq {
            match self.write_head() {
                Ok(()) => self.head_seq = self.seq,
                Err(e) => tracing::error!(error = %e, "cannot write the audit head"),
            }
        }
    }

    fn write_head(&self) -> std::io::Result<()> {
        let head = Head {
            v: FORMAT_VERSION,
            seq: self.seq,
            hash: self.last_hash.clone(),
            sig: head_sig(&self.key, self.seq, &self.last_hash),
        };
        let tmp = self.dir.join(format!("{HEAD_FILE}.tmp"));
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec(&head).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.dir.join(HEAD_FILE))
    }

    fn rotate(&mut self) -> Result<(), AuditError> {
        let path = self.dir.join(file_name(self.file_no + 1));
        self.file = open_append(&path, true)?;
        sync_dir(&self.dir);
        self.file_no += 1;
        self.file_len = 0;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Reading: verify and tail

/// Why a record (or the head) fails verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("not a record (malformed, or two lines run together)")]
    Malformed,
    #[error(
        "incomplete last line (a write cut short by a crash, or a truncated file); the next \
         daemon start moves it aside and records that"
    )]
    TornTail,
    #[error("hash mismatch: the record was edited")]
    HashMismatch,
    #[error("sequence {found} where {expected} was expected: records removed")]
    Removed { expected: u64, found: u64 },
    #[error("sequence {found} where {expected} was expected: records reordered or repeated")]
    Reordered { expected: u64, found: u64 },
    #[error("broken prev link: the record before it was changed, removed or reordered")]
    BrokenLink,
    #[error(
        "bad checkpoint signature: the chain before it was rewritten (or signed with another key)"
    )]
    BadSignature,
    #[error("file {0} is missing")]
    MissingFile(String),
    #[error(
        "{missing} records the signed head had reached were gone at a restart: removed from the end"
    )]
    RecordsLost { missing: u64 },
    #[error("the signed head says the log reaches seq {head}, but it ends at seq {last}: records removed from the end")]
    Truncated { head: u64, last: u64 },
    #[error("the signed head names another hash for this record: the chain was rewritten")]
    HeadMismatch,
    #[error("the head is missing or its signature is bad")]
    BadHead,
}

/// The first record that fails verification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BadRecord {
    /// A file of the audit directory (`audit-000001.jsonl`, or `head`).
    pub file: String,
    /// 1-based; 0 for the head.
    pub line: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(serialize_with = "display")]
    pub problem: Problem,
}

fn display<S: serde::Serializer>(p: &Problem, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(p)
}

impl std::fmt::Display for BadRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} line {}", self.file, self.line)?;
        if let Some(seq) = self.seq {
            write!(f, " (seq {seq})")?;
        }
        write!(f, ": {}", self.problem)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Read(#[from] AuditError),
    #[error("{0}")]
    Bad(BadRecord),
}

/// What an intact log holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    pub files: usize,
    pub records: u64,
    pub checkpoints: u64,
    /// Calls the `dropped` records say went unrecorded.
    pub dropped_calls: u64,
    /// Torn tails moved aside at starts after a crash.
    pub recoveries: u64,
    pub last_seq: u64,
    pub last_hash: String,
    /// The last record is a checkpoint: the daemon stopped cleanly (or is idle since).
    pub ends_with_checkpoint: bool,
    /// Records after the one the signed head names: being written, left unsigned by a crash
    /// (the next start signs them), or appended by someone without the key. Zero on a log
    /// whose daemon stopped cleanly.
    pub unsigned_tail: u64,
}

/// Checks every record of the log in `data_dir/audit`: its own hash, its place in the chain
/// (`seq`, `prev`), every checkpoint's signature and the signed head.
pub fn verify(data_dir: &Path) -> Result<VerifyReport, VerifyError> {
    let dir = data_dir.join(AUDIT_DIR);
    if !dir.is_dir() {
        return Err(AuditError::NoLog(dir).into());
    }
    let key = read_key(&dir)?;
    let files = list_files(&dir)?;
    let head_present = dir.join(HEAD_FILE).exists();
    let head = read_head(&dir, &key);
    let mut report = VerifyReport {
        files: files.len(),
        records: 0,
        checkpoints: 0,
        dropped_calls: 0,
        recoveries: 0,
        last_seq: 0,
        last_hash: GENESIS.into(),
        ends_with_checkpoint: false,
        unsigned_tail: 0,
    };
    let bad = |file: &str, line: u64, seq: Option<u64>, problem| {
        VerifyError::Bad(BadRecord {
            file: file.to_string(),
            line,
            seq,
            problem,
        })
    };
    let mut head_hash_seen = None;
    for (i, (n, path)) in files.iter().enumerate() {
        let name = file_name(*n);
        if *n != i as u32 + 1 {
            return Err(bad(
                &name,
                1,
                None,
                Problem::MissingFile(file_name(i as u32 + 1)),
            ));
        }
        let bytes = std::fs::read(path).map_err(io_err("read", path))?;
        let (lines, rest) = split_lines(&bytes);
        for (idx, &(s, e)) in lines.iter().enumerate() {
            let line_no = idx as u64 + 1;
            let rec = decode(&bytes[s..e]).map_err(|p| bad(&name, line_no, None, p))?;
            let seq = Some(rec.seq);
            let expected = report.last_seq + 1;
            if rec.seq > expected {
                let problem = if seq_appears_later(&files[i..], &bytes[e..], expected) {
                    Problem::Reordered {
                        expected,
                        found: rec.seq,
                    }
                } else {
                    Problem::Removed {
                        expected,
                        found: rec.seq,
                    }
                };
                return Err(bad(&name, line_no, seq, problem));
            }
            if rec.seq < expected {
                let problem = Problem::Reordered {
                    expected,
                    found: rec.seq,
                };
                return Err(bad(&name, line_no, seq, problem));
            }
            if rec.prev != report.last_hash {
                return Err(bad(&name, line_no, seq, Problem::BrokenLink));
            }
            report.ends_with_checkpoint = false;
            match &rec.event {
                Event::Call(_) => {}
                Event::Checkpoint { sig } => {
                    if *sig != checkpoint_sig(&key, rec.seq, &rec.prev) {
                        return Err(bad(&name, line_no, seq, Problem::BadSignature));
                    }
                    report.checkpoints += 1;
                    report.ends_with_checkpoint = true;
                }
                Event::Dropped { count } => report.dropped_calls += count,
                Event::Recovered {
                    missing_records, ..
                } => {
                    if *missing_records > 0 {
                        let problem = Problem::RecordsLost {
                            missing: *missing_records,
                        };
                        return Err(bad(&name, line_no, seq, problem));
                    }
                    report.recoveries += 1;
                }
            }
            let hash = rec.hash.unwrap_or_default();
            if head.as_ref().is_some_and(|h| h.seq == rec.seq) {
                head_hash_seen = Some((name.clone(), line_no, hash.clone()));
            }
            report.records += 1;
            report.last_seq = rec.seq;
            report.last_hash = hash;
        }
        if rest < bytes.len() {
            let line_no = lines.len() as u64 + 1;
            let problem = if i + 1 == files.len() {
                Problem::TornTail
            } else {
                Problem::Malformed
            };
            return Err(bad(&name, line_no, None, problem));
        }
    }
    match head {
        None if report.records > 0 || head_present => {
            return Err(bad(HEAD_FILE, 0, None, Problem::BadHead));
        }
        None => {}
        Some(h) if h.seq > report.last_seq => {
            let problem = Problem::Truncated {
                head: h.seq,
                last: report.last_seq,
            };
            return Err(bad(HEAD_FILE, 0, Some(h.seq), problem));
        }
        Some(h) => {
            report.unsigned_tail = report.last_seq - h.seq;
            if let Some((file, line, hash)) = head_hash_seen {
                if hash != h.hash {
                    return Err(bad(&file, line, Some(h.seq), Problem::HeadMismatch));
                }
            } else if h.seq > 0 {
                return Err(bad(HEAD_FILE, 0, Some(h.seq), Problem::HeadMismatch));
            }
        }
    }
    Ok(report)
}

/// Whether a record with `seq` comes later in the log (after `rest_of_file` of the first file,
/// then in the following files): tells a reordering from a removal.
fn seq_appears_later(files: &[(u32, PathBuf)], rest_of_file: &[u8], seq: u64) -> bool {
    let has = |bytes: &[u8]| {
        let (lines, _) = split_lines(bytes);
        lines
            .iter()
            .any(|&(s, e)| decode(&bytes[s..e]).is_ok_and(|r| r.seq == seq))
    };
    if has(rest_of_file) {
        return true;
    }
    files
        .iter()
        .skip(1)
        .any(|(_, p)| std::fs::read(p).is_ok_and(|b| has(&b)))
}

/// The last `n` records (the last `n` calls by `tenant` when given), oldest first, read from
/// the files without verifying them (that is [`verify`]'s job); unreadable lines are skipped.
pub fn tail(data_dir: &Path, tenant: Option<&str>, n: usize) -> Result<Vec<Record>, AuditError> {
    let dir = data_dir.join(AUDIT_DIR);
    if !dir.is_dir() {
        return Err(AuditError::NoLog(dir));
    }
    let mut out = Vec::new();
    for (_, path) in list_files(&dir)?.iter().rev() {
        if out.len() >= n {
            break;
        }
        let bytes = std::fs::read(path).map_err(io_err("read", path))?;
        let (lines, _) = split_lines(&bytes);
        for &(s, e) in lines.iter().rev() {
            if out.len() >= n {
                break;
            }
            let Ok(rec) = serde_json::from_slice::<Record>(&bytes[s..e]) else {
                continue;
            };
            let wanted = match (tenant, &rec.event) {
                (None, _) => true,
                (Some(t), Event::Call(c)) => c.actor == t,
                (Some(_), _) => false,
            };
            if wanted {
                out.push(rec);
            }
        }
    }
    out.reverse();
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The middleware

/// The route templates the log names (axum's, plus E2B's and envd's).
const ROUTES: &[&str] = &[
    "/v1/tenants",
    "/v1/tenants/{name}",
    "/v1/workers",
    "/v1/gpus",
    "/v1/openapi.json",
    "/v1/templates",
    "/v1/templates/{name}",
    "/v1/templates/{name}/image",
    "/v1/sandboxes",
    "/v1/sandboxes/{id}",
    "/v1/sandboxes/{id}/network",
    "/v1/sandboxes/{id}/ports/{port}",
    "/v1/sandboxes/{id}/ports/{port}/{*path}",
    "/v1/sandboxes/{id}/exec",
    "/v1/sandboxes/{id}/files",
    "/v1/sandboxes/{id}/suspend",
    "/v1/sandboxes/{id}/resume",
    "/v1/sandboxes/{id}/fork",
    "/v1/snapshots",
    "/v1/snapshots/stats",
    "/v1/snapshots/gc",
    "/v1/snapshots/verify",
    "/v1/snapshots/{id}",
    "/v1/snapshots/{id}/verify",
    "/v1/pools",
    "/v1/pools/{name}",
    "/sandboxes",
    "/v2/sandboxes",
    "/sandboxes/{id}",
    "/sandboxes/{id}/connect",
    "/v2/sandboxes/{id}/connect",
    "/sandboxes/{id}/resume",
    "/sandboxes/{id}/pause",
    "/sandboxes/{id}/timeout",
    "/sandboxes/{id}/network",
    "/process.Process/{method}",
    "/filesystem.Filesystem/{method}",
    "/files",
    "/health",
    "/healthz",
    "/metrics",
];

/// What the log says of a request's path.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RouteInfo {
    template: String,
    object: Option<Object>,
    /// The proxy: the answer is the sandbox's, its body is not read.
    proxied: bool,
    /// envd: the sandbox is named by `E2b-Sandbox-Id`, the caller by its access token.
    envd: bool,
}

/// A name copied from a path or header, or `(invalid)` when it is long or has characters no
/// torpor name has (so nothing a caller smuggles in lands in the log).
fn clean_name(raw: &str) -> String {
    if !raw.is_empty()
        && raw.len() <= MAX_NAME
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        raw.to_string()
    } else {
        "(invalid)".to_string()
    }
}

fn object_kind(collection: &str) -> Option<&'static str> {
    Some(match collection {
        "sandboxes" => "sandbox",
        "templates" => "template",
        "tenants" => "tenant",
        "pools" => "pool",
        "snapshots" => "snapshot",
        _ => return None,
    })
}

/// Matches `path` against one template; the object is the parameter after a collection.
fn match_template(template: &str, path: &str) -> Option<(Option<Object>, Option<String>)> {
    let mut pat = template.split('/').skip(1);
    let mut segs = path.split('/').skip(1);
    let mut object = None;
    let mut rpc = None;
    let mut previous = "";
    loop {
        match (pat.next(), segs.next()) {
            (None, None) => return Some((object, rpc)),
            (Some(p), _) if p.starts_with("{*") => return Some((object, rpc)),
            (Some(p), Some(s)) if p.starts_with('{') => {
                if s.is_empty() {
                    return None;
                }
                if p == "{method}" {
                    rpc = Some(s.to_string());
                } else if let Some(kind) = object_kind(previous) {
                    object = Some(Object {
                        kind: kind.into(),
                        name: clean_name(s),
                    });
                }
                previous = p;
            }
            (Some(p), Some(s)) if p == s => previous = p,
            _ => return None,
        }
    }
}

/// The route of a request: host-based routing first (as the proxy sees it), then the table.
fn classify(host: Option<&str>, path: &str, envd_sandbox: Option<&str>) -> Option<RouteInfo> {
    let domain = crate::proxy::proxy_domain();
    let label = host
        .map(|h| {
            h.rsplit_once(':')
                .map_or(h, |(name, _)| name)
                .to_ascii_lowercase()
        })
        .and_then(|h| {
            h.strip_suffix(domain)
                .and_then(|l| l.strip_suffix('.'))
                .map(str::to_string)
        });
    if let Some(label) = label {
        return Some(RouteInfo {
            template: format!("{{port}}-{{id}}.{domain}/{{*path}}"),
            object: label.split_once('-').map(|(_, id)| Object {
                kind: "sandbox".into(),
                name: clean_name(id),
            }),
            proxied: true,
            envd: false,
        });
    }
    for template in ROUTES {
        let Some((mut object, rpc)) = match_template(template, path) else {
            continue;
        };
        let envd = template.starts_with("/process.")
            || template.starts_with("/filesystem.")
            || *template == "/files"
            || *template == "/health";
        if envd {
            object = envd_sandbox.map(|id| Object {
                kind: "sandbox".into(),
                name: clean_name(id),
            });
        }
        let template = match rpc {
            Some(m)
                if !m.is_empty() && m.len() <= 40 && m.bytes().all(|b| b.is_ascii_alphabetic()) =>
            {
                template.replace("{method}", &m)
            }
            _ => template.to_string(),
        };
        return Some(RouteInfo {
            proxied: template.contains("/ports/{port}"),
            template,
            object,
            envd,
        });
    }
    None
}

/// The credential headers of a request (cheap clones), kept to name the actor afterwards.
struct Credentials {
    authorization: Option<HeaderValue>,
    api_key: Option<HeaderValue>,
    access_token: Option<HeaderValue>,
    envd_sandbox: Option<HeaderValue>,
    host: Option<HeaderValue>,
}

impl Credentials {
    fn of(h: &HeaderMap) -> Credentials {
        Credentials {
            authorization: h.get(header::AUTHORIZATION).cloned(),
            api_key: h.get("x-api-key").cloned(),
            access_token: h.get("x-access-token").cloned(),
            envd_sandbox: h.get("e2b-sandbox-id").cloned(),
            host: h.get(header::HOST).cloned(),
        }
    }
}

fn header_str(v: &Option<HeaderValue>) -> Option<&str> {
    v.as_ref()
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Who made the call: the tenant (or admin) of the token it carried, the owner of the sandbox
/// whose envd access token it carried, or `anonymous`.
fn actor_of(state: &Arc<ApiState>, creds: &Credentials, route: &RouteInfo) -> String {
    let token = header_str(&creds.authorization)
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .or_else(|| header_str(&creds.api_key));
    if let Some(token) = token {
        if constant_time_eq(token.as_bytes(), state.admin_token.as_bytes()) {
            return TenantId::admin().as_str().to_string();
        }
        return match state.engine.tenant_for_token(token) {
            Ok(Some(t)) => t.as_str().to_string(),
            _ => ANONYMOUS.into(),
        };
    }
    if route.envd {
        let id = header_str(&creds.envd_sandbox).and_then(|id| SandboxId::new(id).ok());
        if let (Some(id), Some(token)) = (id, header_str(&creds.access_token)) {
            let expected = crate::e2b::E2b::new(state.clone()).access_token(&id);
            if constant_time_eq(token.as_bytes(), expected.as_bytes()) {
                if let Ok(rec) = state.engine.sandbox(&TenantId::admin(), &id) {
                    return rec.tenant.as_str().to_string();
                }
            }
        }
    }
    ANONYMOUS.into()
}

/// A request id fit for the log (the edge sets it; a stray header must not smuggle text in).
fn request_id_of(resp: &Response) -> Option<String> {
    let v = resp.headers().get("x-request-id")?.to_str().ok()?;
    (!v.is_empty()
        && v.len() <= MAX_NAME
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')))
    .then(|| v.to_string())
}

/// The stable code of an error body (`{"error":{"code":..}}`, or Connect's `{"code":..}`);
/// only codes (lowercase words), never a message.
fn error_code_of(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let code = v
        .get("error")
        .and_then(|e| e.get("code"))
        .or_else(|| v.get("code"))?
        .as_str()?;
    (!code.is_empty()
        && code.len() <= 64
        && code
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'))
    .then(|| code.to_string())
}

/// Reads the code of a small JSON error answer and puts the body back as it was.
async fn with_error_code(resp: Response) -> (Response, Option<String>) {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    let small = HttpBody::size_hint(resp.body())
        .exact()
        .is_some_and(|n| n <= MAX_ERROR_BODY);
    if !(json && small) {
        return (resp, None);
    }
    let (parts, body) = resp.into_parts();
    match axum::body::to_bytes(body, MAX_ERROR_BODY as usize).await {
        Ok(bytes) => {
            let code = error_code_of(&bytes);
            (Response::from_parts(parts, Body::from(bytes)), code)
        }
        Err(_) => (Response::from_parts(parts, Body::empty()), None),
    }
}

/// Whether a call goes in the log: a mutating method on a known route, or a refusal (401, 403,
/// 429; 404 on a route that names an object).
fn audited(method: &Method, status: u16, route: Option<&RouteInfo>) -> bool {
    let mutating = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    let denied = matches!(status, 401 | 403 | 429)
        || (status == 404 && route.is_some_and(|r| r.object.is_some()));
    (mutating && route.is_some()) || denied
}

/// The middleware: after the answer is made, queues one record for a mutating or refused call.
/// Outermost in the router, so it sees host-routed requests, rate-limit refusals and the
/// `x-request-id` the edge adds.
pub async fn record_calls(
    State(state): State<Arc<ApiState>>,
    req: Request,
    next: Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let creds = Credentials::of(req.headers());
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string());
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let route = classify(
        header_str(&creds.host),
        &path,
        header_str(&creds.envd_sandbox),
    );
    if !audited(&method, status, route.as_ref()) {
        return resp;
    }
    let route = route.unwrap_or_else(|| RouteInfo {
        template: "(no such route)".into(),
        object: None,
        proxied: false,
        envd: false,
    });
    let (resp, code) = if status >= 400 && !route.proxied {
        with_error_code(resp).await
    } else {
        (resp, None)
    };
    let actor = actor_of(&state, &creds, &route);
    state.audit.record(Call {
        request_id: request_id_of(&resp),
        actor,
        remote,
        method: method.as_str().to_string(),
        route: route.template,
        object: route.object,
        status,
        code,
    });
    resp
}

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
        }
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
