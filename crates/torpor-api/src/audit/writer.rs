//! The writer: one thread appends batches of records to the chain (one write and one fsync per
//! batch), rotates files, signs checkpoints, and recovers a torn tail at start.

use super::*;

pub(super) enum Msg {
    Call(Box<Call>, SystemTime),
    Close,
    /// Tests: the writer acknowledges, then waits for the release before reading on.
    #[cfg(test)]
    Hold(mpsc::Sender<()>, Receiver<()>),
}

/// The handle: [`AuditLog::record`] never blocks; [`AuditLog::close`] writes the final
/// checkpoint.
pub struct AuditLog {
    pub(super) tx: SyncSender<Msg>,
    /// Calls refused by a full channel since the writer last looked; it records them as a gap.
    pub(super) unrecorded: Arc<AtomicU64>,
    pub(super) dropped_total: IntCounter,
    pub(super) writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// The end of the chain as found on disk.
pub(super) struct ChainEnd {
    pub(super) seq: u64,
    pub(super) hash: String,
    pub(super) since_checkpoint: u64,
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
            last_commit: None,
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
    pub(super) fn hold(&self) -> mpsc::Sender<()> {
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
pub(super) fn recover_tail(
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
pub(super) fn chain_end_before(files: &[(u32, PathBuf)]) -> Result<ChainEnd, AuditError> {
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
pub(super) struct Writer {
    pub(super) dir: PathBuf,
    pub(super) key: [u8; 32],
    pub(super) cfg: AuditConfig,
    pub(super) file: File,
    pub(super) file_no: u32,
    /// Bytes of the current file written and synced.
    pub(super) file_len: u64,
    pub(super) seq: u64,
    pub(super) last_hash: String,
    pub(super) since_checkpoint: u64,
    /// (seq, hash, since_checkpoint) as of the last durable write: where a failed write
    /// goes back to.
    pub(super) committed: (u64, String, u64),
    pub(super) head_seq: u64,
    /// Lines encoded, not yet written.
    pub(super) pending: Vec<u8>,
    pub(super) pending_records: u64,
    pub(super) pending_calls: u64,
    pub(super) unrecorded: Arc<AtomicU64>,
    pub(super) records_total: IntCounter,
    pub(super) dropped_total: IntCounter,
    /// When the last batch was made durable ([`AuditConfig::commit_every`]).
    pub(super) last_commit: Option<std::time::Instant>,
}

impl Writer {
    pub(super) fn run(mut self, rx: Receiver<Msg>, recovered: Option<Event>) {
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
            // Group commit: soon after the last batch, the rest of the interval gathers more.
            if let Some(at) = self.last_commit {
                let rest = self.cfg.commit_every.saturating_sub(at.elapsed());
                if !rest.is_zero() && !matches!(first, Msg::Close) {
                    std::thread::sleep(rest);
                }
            }
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
            self.last_commit = Some(std::time::Instant::now());
            if closing {
                return;
            }
        }
    }

    pub(super) fn final_checkpoint(&mut self) {
        if self.since_checkpoint > 0 {
            self.checkpoint();
        }
    }

    pub(super) fn checkpoint(&mut self) {
        let seq = self.seq + 1;
        let sig = checkpoint_sig(&self.key, seq, &self.last_hash);
        tracing::info!(seq, prev = %self.last_hash, sig = %sig, "audit checkpoint");
        self.append(Event::Checkpoint { sig }, SystemTime::now());
    }

    /// Encodes one record after the chain's end (into `pending`), moving to the next file
    /// first when this one is full.
    pub(super) fn append(&mut self, event: Event, time: SystemTime) {
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

    pub(super) fn encode_or_count(
        &mut self,
        rec: &Record,
        is_call: bool,
    ) -> Option<(Vec<u8>, String)> {
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

    pub(super) fn lost(&mut self, calls: u64) {
        self.dropped_total.inc_by(calls);
        self.unrecorded.fetch_add(calls, Ordering::Relaxed);
    }

    /// Writes `pending` with one write and one fdatasync. On failure the file is cut back to
    /// its last durable length and the chain's end goes back with it.
    pub(super) fn write_pending(&mut self) -> bool {
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
    pub(super) fn commit(&mut self) {
        if self.write_pending() && self.seq != self.head_seq {
            match self.write_head() {
                Ok(()) => self.head_seq = self.seq,
                Err(e) => tracing::error!(error = %e, "cannot write the audit head"),
            }
        }
    }

    pub(super) fn write_head(&self) -> std::io::Result<()> {
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

    pub(super) fn rotate(&mut self) -> Result<(), AuditError> {
        let path = self.dir.join(file_name(self.file_no + 1));
        self.file = open_append(&path, true)?;
        sync_dir(&self.dir);
        self.file_no += 1;
        self.file_len = 0;
        Ok(())
    }
}
