//! The protocol between torpor and its agent inside each sandbox.
//!
//! The agent is the sandbox's init process; torpor talks to it over the container's stdin and
//! stdout. Those pipes are the one channel that survives checkpoint and restore (a host Unix
//! socket makes checkpoint fail, and network is off by default), and they cost no setup on wake:
//! torpor can write a request into the restore's stdin before the restore has finished.
//!
//! Frame: `u32 LE header length | u32 LE body length | header (JSON) | body (raw bytes)`.
//! Requests carry an `id`; every reply names the `id` it answers, so many requests may be in
//! flight at once. Bodies carry bulk bytes (stdin, stdout, file contents) without JSON escaping.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Header bytes a frame may carry; more is a protocol violation.
pub const MAX_HEADER: usize = 1 << 20;
/// Body bytes a frame may carry (a whole file read or written in one piece).
pub const MAX_BODY: usize = 256 << 20;
/// The longest a `ListChanged` waits.
pub const MAX_WAIT_MS: u64 = 5_000;
/// Protocol version; the agent reports it in its hello.
/// 2: `ReadRange`. 3: `SetMetadata`, `ListWithMetadata` (E2B's file metadata). 4: `Reboot`,
/// and the agent keeps `/proc/sys/kernel/random/boot_id` ([`BOOT_ID_PATH`]). 5: `WatchStart`,
/// `WatchEvents`, `WatchStop` (inotify watches, E2B's `watch_dir`). 6: a followed `Spawn`
/// ([`SpawnRequest::follow_ms`]). 7: a followed `Spawn` answered once when its process ends
/// soon ([`SpawnRequest::spawned_within_ms`]).
pub const VERSION: u32 = 7;
/// The first version that answers `ReadRange`.
pub const READ_RANGE_SINCE: u32 = 2;
/// The first version that answers `SetMetadata` and `ListWithMetadata`. An older agent cannot
/// parse them (it answers `bad_request` under id 0, never under the request's id), so a
/// caller asks only an agent whose hello said at least this.
pub const METADATA_SINCE: u32 = 3;
/// The first version that answers `Reboot`. An older agent cannot parse it (as for
/// [`METADATA_SINCE`]), so a caller asks only an agent whose hello said at least this.
pub const REBOOT_SINCE: u32 = 4;
/// The first version that answers `WatchStart`, `WatchEvents` and `WatchStop`. An older agent
/// cannot parse them (as for [`METADATA_SINCE`]), so a caller asks only an agent whose hello
/// said at least this (and polls otherwise).
pub const WATCH_SINCE: u32 = 5;
/// The first version that follows a `Spawn` ([`SpawnRequest::follow_ms`]). An older agent
/// cannot parse the field (as for [`METADATA_SINCE`]), so a caller sets it only for an agent
/// whose hello said at least this.
pub const SPAWN_FOLLOW_SINCE: u32 = 6;
/// The first version that holds a followed `Spawn`'s `Spawned` back
/// ([`SpawnRequest::spawned_within_ms`]). An older agent cannot parse the field (as for
/// [`METADATA_SINCE`]), so a caller sets it only for an agent whose hello said at least this.
pub const SPAWNED_WITHIN_SINCE: u32 = 7;
/// The most of each of a followed `Spawn`'s output files (`out`, `err`) its `Progress` reply
/// carries; a follower reads the rest.
pub const SPAWN_FOLLOW_OUTPUT: u64 = 1 << 20;
/// How long a followed `Spawn` that saw output waits on for the process's exit before it
/// answers, so that a short command's output and exit come back in one reply.
pub const SPAWN_FOLLOW_LINGER_MS: u64 = 3;
/// Events one agent watch queues until they are asked for; past that the oldest go and the
/// next `WatchEvents` says so (`overflowed`).
pub const MAX_WATCH_EVENTS: usize = 10_000;
/// Watches one agent keeps; a new one past that ends the oldest (a watch whose host side went
/// away without `WatchStop`, e.g. while the sandbox slept).
pub const MAX_WATCHES: usize = 128;
/// Where the agent writes the sandbox's boot id (a UUID line, as Linux's): a fresh one when it
/// starts, on `Configure` (a sandbox made from a template's snapshot is a new boot) and on
/// `Reboot`. The directory is a small tmpfs in every sandbox's spec (gVisor's procfs has no
/// `random/`), so the id is checkpointed with the sandbox and unchanged by a restore.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Answered with `Reply::Hello` once the agent is ready.
    Hello,
    /// Sets environment applied to every later exec (per-sandbox env after a golden restore).
    /// Agents of [`REBOOT_SINCE`] also start a new boot id: a sandbox made from a template's
    /// snapshot is a boot of its own.
    Configure {
        env: BTreeMap<String, String>,
    },
    /// Runs a command. The body is its stdin.
    Exec(ExecRequest),
    /// Reads a file; the reply body holds it.
    ReadFile {
        path: String,
        max_bytes: u64,
    },
    /// Reads at most `max_bytes` of a file from `offset`; the reply is `Data` whose
    /// `truncated` says more follows. Agents before it answer `bad_request`.
    ReadRange {
        path: String,
        offset: u64,
        max_bytes: u64,
    },
    /// Writes the body to a file, creating parent directories.
    WriteFile {
        path: String,
        mode: Option<u32>,
    },
    List {
        path: String,
    },
    /// Lists a directory as soon as its listing differs from `known` (name → size), or when
    /// `timeout_ms` (at most [`MAX_WAIT_MS`]) has passed; a directory that does not exist yet
    /// is waited for too. Lets a caller follow files that a process inside writes without
    /// polling over the channel.
    ListChanged {
        path: String,
        known: BTreeMap<String, u64>,
        timeout_ms: u64,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    /// Replaces the user metadata of the file at `path` (not followed if a symlink): every
    /// `user.e2b.*` extended attribute not in `metadata` is removed, each key is set as
    /// `user.e2b.<key>` (the agent writes no other namespace). Checked with
    /// [`validate_metadata`]. Answered with `Metadata`: what the file holds afterwards (empty
    /// where its filesystem keeps no extended attributes).
    SetMetadata {
        path: String,
        metadata: BTreeMap<String, String>,
    },
    /// As `List`, each entry with its user metadata (within [`MAX_METADATA_READ_ENTRY`] each
    /// and [`MAX_METADATA_READ_REPLY`] in all); with `name`, only that entry of the directory
    /// (none if it does not exist). Answered with `MetaEntries`.
    ListWithMetadata {
        path: String,
        #[serde(default)]
        name: Option<String>,
    },
    /// The main process's state.
    MainStatus,
    /// Starts a process whose state lives in files under `dir` (E2B's processes): the body is
    /// written to `dir/config`, output goes to `dir/out` and `dir/err` (a terminal's to
    /// `dir/out`), `dir/pid` holds its pid, `index_dir/<pid>` holds `key`, and once it has
    /// ended the agent writes `dir/signaled` (killed by a signal) and then an empty
    /// `dir/exit-<status>` (128 + the signal for a signal). Answered with `Started`. Its stdin
    /// (with `stdin` or `pty`) stays open in the agent for `ProcInput` until `ProcCloseInput`.
    /// With `follow_ms` ([`SPAWN_FOLLOW_SINCE`]) answered twice: `Spawned` at once, then
    /// `Progress` (see [`SpawnRequest::follow_ms`]).
    Spawn(SpawnRequest),
    /// Writes the body to the stdin (or terminal) of a process started by `Spawn`.
    ProcInput {
        pid: u32,
    },
    /// Closes the stdin of a process started by `Spawn`.
    ProcCloseInput {
        pid: u32,
    },
    /// Sets the window size of a `Spawn` process's terminal.
    ProcResize {
        pid: u32,
        cols: u16,
        rows: u16,
    },
    /// Reboots the sandbox's processes, keeping its files (E2B's filesystem-only pause): every
    /// process but the agent is killed (SIGKILL) and reaped, the template's main process is
    /// started again as at boot, and a new boot id is written. Answered with `Main` (the new
    /// main process). Agents before [`REBOOT_SINCE`] cannot parse it.
    Reboot,
    /// Watches the directory `path` (and, `recursive`, every directory under it, including
    /// ones made later) with inotify; answered with `Watch`. Agents before [`WATCH_SINCE`]
    /// cannot parse it.
    WatchStart {
        path: String,
        recursive: bool,
    },
    /// The events a watch queued since the last ask (never waits); answered with
    /// `WatchEvents`, or `not_found` for a watch that is gone.
    WatchEvents {
        watch: u64,
    },
    /// Ends a watch (`Ok`, also for one that is gone).
    WatchStop {
        watch: u64,
    },
}

/// What happened to a watched entry, as envd (fsnotify) names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchOp {
    Create,
    Write,
    Remove,
    /// The entry's old name, as it was renamed (the new name gets a `Create`).
    Rename,
    Chmod,
}

/// One event of a watch: the entry's path relative to the watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchEvent {
    pub name: String,
    pub op: WatchOp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    pub dir: String,
    pub index_dir: String,
    pub key: String,
    /// Keep a pipe to its stdin open.
    #[serde(default)]
    pub stdin: bool,
    /// Run it on a new pseudo-terminal of this size (its stdin, stdout and stderr).
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// Run it as this user and group (with no supplementary groups) instead of the agent's
    /// root. Absent from the frame when unset, so agents that predate it still parse requests
    /// that do not need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<RunAs>,
    /// Follow the process for up to this long (at most [`MAX_WAIT_MS`]) after it starts: the
    /// agent answers `Spawned` as soon as it runs, then `Progress` once it has ended, or once
    /// it has written output (after [`SPAWN_FOLLOW_LINGER_MS`] more for its exit), or when the
    /// time is up, whichever is first. Its state lives in its files as without it: this only
    /// saves the follower its first `ListChanged` and reads (a short command's whole run
    /// comes back on the request that started it), and watches with inotify instead of
    /// re-listing. 0 (absent from the frame, so older agents parse the request): `Started`,
    /// once. Agents before [`SPAWN_FOLLOW_SINCE`] cannot parse it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub follow_ms: u64,
    /// With `follow_ms`: answer `Spawned` only once the process has run this long (at most
    /// [`MAX_WAIT_MS`]) without the follow's `Progress` being due. A process that ends (or
    /// writes output) sooner is answered once: `Progress` with its `pid`, which stands for both
    /// replies (one reply less to carry for a short command). Its `config`, `pid` and index
    /// entry are written before a reply that tells the pid while the process runs (`Spawned`,
    /// or a `Progress` without `exit`), and not at all when it ended by its only reply: an
    /// ended process is not listed, and one without an index entry is answered not found, as
    /// one that ended is. 0 (absent): `Spawned` at once, the files written before it. Agents before
    /// [`SPAWNED_WITHIN_SINCE`] cannot parse it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spawned_within_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A numeric user and group a process runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Start it and answer at once with its pid; it keeps running on its own.
    #[serde(default)]
    pub detach: bool,
    /// Send output as `Reply::Output` frames while it runs, instead of all at the end.
    #[serde(default)]
    pub stream: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    Hello {
        version: u32,
        pid: u32,
    },
    Ok,
    /// An exec finished. Unless streamed, the body is stdout followed by stderr, split at
    /// `stdout_len`.
    Exit {
        exit_code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        duration_us: u64,
        stdout_len: u64,
    },
    /// A streamed chunk of output; body holds the bytes.
    Output {
        fd: u8,
    },
    /// A detached exec started.
    Started {
        pid: u32,
    },
    /// A followed `Spawn`'s process started; `Progress` follows under the same id.
    Spawned {
        pid: u32,
    },
    /// A followed `Spawn`'s process after its wait (the request's last reply). `exit` is the
    /// status its exit marker records (`exit-<status>`; 128 + the signal, with `signaled`) once
    /// it has ended; `out_len` and `err_len` are the sizes of `dir/out` and `dir/err` as the
    /// reply was made (final once it has ended). The body holds the first `out_sent` bytes of
    /// `dir/out`, then the first bytes of `dir/err` (each at most [`SPAWN_FOLLOW_OUTPUT`]).
    /// `pid` is there when it is the request's only reply, `Spawned` held back and not sent
    /// ([`SpawnRequest::spawned_within_ms`]).
    Progress {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pid: Option<u32>,
        exit: Option<i32>,
        signaled: bool,
        out_len: u64,
        err_len: u64,
        out_sent: u64,
    },
    /// A file's bytes are in the body.
    Data {
        truncated: bool,
    },
    Entries {
        entries: Vec<DirEntry>,
    },
    /// Entries with their user metadata (`ListWithMetadata`): the body holds the `count`
    /// entries as a JSON array of [`MetaEntry`] (metadata can be more than a header holds).
    MetaEntries {
        count: u32,
    },
    /// A file's user metadata (`SetMetadata`).
    Metadata {
        metadata: BTreeMap<String, String>,
    },
    Main {
        pid: Option<u32>,
        running: bool,
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
    Error {
        code: AgentErrorCode,
        message: String,
    },
    /// A watch started (`WatchStart`).
    Watch {
        watch: u64,
    },
    /// A watch's queued events, oldest first; `overflowed` when some were lost since the last
    /// ask (the agent's queue or the kernel's was full).
    WatchEvents {
        events: Vec<WatchEvent>,
        overflowed: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub modified_ms: i64,
    /// Owner and group (numeric). Agents before them send neither: read as root's.
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
}

/// A directory entry and its user metadata: the `user.e2b.*` extended attributes of what it
/// names (a symlink's are its target's), keys without the prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaEntry {
    pub entry: DirEntry,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// The extended-attribute namespace of E2B's file metadata: key `k` is stored as
/// `user.e2b.k`. The `user.` namespace is the only one an unprivileged process may write; the
/// agent never builds a name outside this prefix.
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";
/// The longest key: Linux limits an attribute name (prefix included) to 255 bytes.
pub const MAX_METADATA_KEY_LEN: usize = 255 - METADATA_XATTR_PREFIX.len();
/// The most metadata one file may be given, counted as envd counts it: per key the prefix,
/// the key and the value. (So at most 409 keys.)
pub const MAX_METADATA_TOTAL: usize = 4096;
/// The most metadata surfaced for one entry, counted the same way: what an upload may set
/// always shows whole; of more, set inside the sandbox by other means, the attributes beyond
/// it (in name order) are left out.
pub const MAX_METADATA_READ_ENTRY: usize = MAX_METADATA_TOTAL;
/// The most metadata one `ListWithMetadata` reply carries (2048 entries with as much as an
/// upload may set); past it the agent answers `too_large`.
pub const MAX_METADATA_READ_REPLY: usize = 8 << 20;

/// Why a metadata set is refused (the rules of envd's `ValidateMetadata`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata key must not be empty")]
    EmptyKey,
    #[error("metadata key {key:?} exceeds {MAX_METADATA_KEY_LEN} bytes")]
    KeyTooLong { key: String },
    #[error("metadata key {key:?} contains a byte that is not printable ASCII")]
    KeyNotPrintable { key: String },
    #[error("metadata value for key {key:?} contains a byte that is not printable ASCII")]
    ValueNotPrintable { key: String },
    #[error("total metadata size {total} exceeds {MAX_METADATA_TOTAL} bytes")]
    TooLarge { total: usize },
}

/// Checks a metadata set as envd does: keys non-empty and at most [`MAX_METADATA_KEY_LEN`]
/// bytes, keys and values printable US-ASCII (0x20–0x7E), and at most [`MAX_METADATA_TOTAL`]
/// bytes in all.
pub fn validate_metadata(metadata: &BTreeMap<String, String>) -> Result<(), MetadataError> {
    let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let mut total = 0usize;
    for (k, v) in metadata {
        if k.is_empty() {
            return Err(MetadataError::EmptyKey);
        }
        if k.len() > MAX_METADATA_KEY_LEN {
            return Err(MetadataError::KeyTooLong {
                key: k.chars().take(32).collect(),
            });
        }
        if !printable(k) {
            return Err(MetadataError::KeyNotPrintable {
                key: k.escape_default().take(32).collect(),
            });
        }
        if !printable(v) {
            return Err(MetadataError::ValueNotPrintable { key: k.clone() });
        }
        total += METADATA_XATTR_PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_METADATA_TOTAL {
        return Err(MetadataError::TooLarge { total });
    }
    Ok(())
}

/// What one metadata entry costs against [`MAX_METADATA_READ_ENTRY`] and
/// [`MAX_METADATA_READ_REPLY`].
pub fn read_metadata_budget(key: &str, value: &str) -> usize {
    METADATA_XATTR_PREFIX.len() + key.len() + value.len()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentErrorCode {
    NotFound,
    NotADirectory,
    IsADirectory,
    PermissionDenied,
    InvalidPath,
    SpawnFailed,
    TooLarge,
    Io,
    BadRequest,
    /// The working directory a process was asked to start in does not exist (agents before
    /// this answered `not_found` with a "cwd ..." message).
    NoSuchCwd,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header<T> {
    pub id: u64,
    #[serde(flatten)]
    pub msg: T,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("channel closed")]
    Closed,
    #[error("frame header of {0} bytes exceeds the limit")]
    HeaderTooLarge(usize),
    #[error("frame body of {0} bytes exceeds the limit")]
    BodyTooLarge(usize),
    #[error("malformed frame header")]
    Json(#[from] serde_json::Error),
    #[error("i/o on the agent channel")]
    Io(#[from] io::Error),
}

/// Encodes one frame into a single buffer, so that one `write` puts it on the pipe whole.
pub fn encode<T: Serialize>(id: u64, msg: &T, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let header = serde_json::to_vec(&Header { id, msg })?;
    if header.len() > MAX_HEADER {
        return Err(FrameError::HeaderTooLarge(header.len()));
    }
    if body.len() > MAX_BODY {
        return Err(FrameError::BodyTooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(8 + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(body);
    Ok(out)
}

/// Parses the 8-byte prefix into (header length, body length), enforcing the caps.
pub fn parse_prefix(prefix: [u8; 8]) -> Result<(usize, usize), FrameError> {
    let hlen = u32::from_le_bytes(prefix[0..4].try_into().expect("4 bytes")) as usize;
    let blen = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes")) as usize;
    if hlen > MAX_HEADER {
        return Err(FrameError::HeaderTooLarge(hlen));
    }
    if blen > MAX_BODY {
        return Err(FrameError::BodyTooLarge(blen));
    }
    Ok((hlen, blen))
}

/// Reads one frame from a blocking reader (the agent's side).
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
) -> Result<(Header<T>, Vec<u8>), FrameError> {
    let mut prefix = [0u8; 8];
    match r.read_exact(&mut prefix) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let (hlen, blen) = parse_prefix(prefix)?;
    let mut header = vec![0u8; hlen];
    r.read_exact(&mut header)?;
    let mut body = vec![0u8; blen];
    r.read_exact(&mut body)?;
    Ok((serde_json::from_slice(&header)?, body))
}

/// Writes one frame to a blocking writer and flushes it.
pub fn write_frame<T: Serialize>(
    w: &mut impl Write,
    id: u64,
    msg: &T,
    body: &[u8],
) -> Result<(), FrameError> {
    w.write_all(&encode(id, msg, body)?)?;
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let req = Request::Exec(ExecRequest {
            cmd: vec!["echo".into(), "hi".into()],
            env: BTreeMap::new(),
            cwd: None,
            timeout_ms: Some(5),
            detach: false,
            stream: true,
        });
        let buf = encode(7, &req, b"stdin").unwrap();
        let (h, body) = read_frame::<Request>(&mut &buf[..]).unwrap();
        assert_eq!(h.id, 7);
        assert_eq!(h.msg, req);
        assert_eq!(body, b"stdin");
    }

    #[test]
    fn metadata_is_checked_as_envd_checks_it() {
        let m = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            validate_metadata(&m(&[("author", "mish"), ("e", "")])),
            Ok(())
        );
        // A key naming another namespace is only a key: it is stored under `user.e2b.`.
        assert_eq!(validate_metadata(&m(&[("trusted.x", "v")])), Ok(()));
        assert_eq!(
            validate_metadata(&m(&[("", "v")])),
            Err(MetadataError::EmptyKey)
        );
        assert!(matches!(
            validate_metadata(&m(&[(&"k".repeat(MAX_METADATA_KEY_LEN + 1), "v")])),
            Err(MetadataError::KeyTooLong { .. })
        ));
        assert_eq!(
            validate_metadata(&m(&[(&"k".repeat(MAX_METADATA_KEY_LEN), "")])),
            Ok(())
        );
        assert!(matches!(
            validate_metadata(&m(&[("k\u{0}", "v")])),
            Err(MetadataError::KeyNotPrintable { .. })
        ));
        assert!(matches!(
            validate_metadata(&m(&[("k", "\u{7f}")])),
            Err(MetadataError::ValueNotPrintable { .. })
        ));
        // The total counts the prefix of every key: exactly at the limit passes, one more fails.
        let at_limit = "v".repeat(MAX_METADATA_TOTAL - METADATA_XATTR_PREFIX.len() - 1);
        assert_eq!(validate_metadata(&m(&[("k", &at_limit)])), Ok(()));
        let over = format!("{at_limit}v");
        assert!(matches!(
            validate_metadata(&m(&[("k", &over)])),
            Err(MetadataError::TooLarge { total }) if total == MAX_METADATA_TOTAL + 1
        ));
    }

    #[test]
    fn requests_of_older_versions_keep_their_shape() {
        // What an agent of version 2 parses: a `WriteFile` and a `List` as they always were.
        let w = encode(
            1,
            &Request::WriteFile {
                path: "/a".into(),
                mode: None,
            },
            b"",
        )
        .unwrap();
        assert!(String::from_utf8_lossy(&w)
            .contains(r#"{"id":1,"op":"write_file","path":"/a","mode":null}"#));
        let r = Request::ListWithMetadata {
            path: "/d".into(),
            name: Some("f".into()),
        };
        let buf = encode(2, &r, b"").unwrap();
        assert_eq!(read_frame::<Request>(&mut &buf[..]).unwrap().0.msg, r);
    }

    #[test]
    fn hostile_prefixes_are_refused_without_allocating() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&u32::MAX.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            read_frame::<Request>(&mut &buf[..]),
            Err(FrameError::HeaderTooLarge(_))
        ));
        assert!(matches!(
            read_frame::<Request>(&mut &b""[..]),
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame::<Request>(&mut &b"\x02\0\0\0\0\0\0\0{}"[..]),
            Err(FrameError::Json(_))
        ));
    }
}
