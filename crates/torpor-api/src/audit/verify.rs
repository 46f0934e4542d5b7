//! Verification of the whole chain (`torpor audit verify`) and reading its tail (`torpor audit tail`).

use super::*;

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

pub(super) fn display<S: serde::Serializer>(p: &Problem, s: S) -> Result<S::Ok, S::Error> {
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
pub(super) fn seq_appears_later(files: &[(u32, PathBuf)], rest_of_file: &[u8], seq: u64) -> bool {
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
