//! Power-loss tests for the durable write path, by recording and replaying file-system
//! operations.
//!
//! A power loss cannot be produced on this machine (dropping caches does not drop dirty
//! data; a VM's disk honours what the host decides), so these tests check the guarantee
//! against a model of what a POSIX file system may keep after a crash:
//!
//! - file data that was not fsynced may be lost (the file is empty or cut short), even if
//!   the name pointing at it survived (ext4 without `auto_da_alloc`, XFS);
//! - a change to a directory (a new name, a rename, a removal) that was not made durable by
//!   an fsync of that directory may or may not have reached the disk, independently for
//!   every name;
//! - fsynced data and fsynced directories survive.
//!
//! [`RecordingFs`] runs every operation of the real write path (the real
//! [`LocalBackend`] under the real [`Store`]) on a real directory and logs it. Two checks
//! use the log:
//!
//! 1. **Ordering**: replayed into the model, no rename publishes an inode whose data (or,
//!    for a directory, whose whole tree) is not yet durable, and when an operation reports
//!    success every name it published is durable.
//! 2. **Crash at every step**: for every prefix of the log and several adversarial choices
//!    of what survived, the surviving state is written to a fresh directory and opened with
//!    the real store: every snapshot it lists verifies and restores to exactly what was put,
//!    and every snapshot whose `put_dir` returned before the crash is there.
//!
//! What this does not show: that the kernel and the disk keep fsynced data (a drive that
//! lies about flushes defeats any software), that file systems outside the model behave
//! (the model is the weakest common POSIX one, so stronger ones are covered), or anything
//! about writes made outside [`crate::durable`] and the local backend (runsc writes its
//! checkpoint files itself; the model treats them as unsynced until `fsync_tree`).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::backend::{Backend, LocalBackend};
use crate::durable::{self, Fs, RealFs};
use crate::{SnapshotId, Store, StoreConfig};

#[derive(Debug, Clone)]
enum Op {
    CreateDir(PathBuf),
    Write {
        path: PathBuf,
        data: Vec<u8>,
    },
    SyncFile(PathBuf),
    SyncDir(PathBuf),
    Rename(PathBuf, PathBuf),
    Remove(PathBuf),
    /// An operation reported success; these paths must now survive a crash.
    Returned {
        what: String,
        paths: Vec<PathBuf>,
    },
}

/// Runs operations on the real file system below `base` and logs them (relative to it). Each
/// operation and its log entry happen under one lock, so the log's order is the order the file
/// system saw (concurrent chunk writers create the same shard directories).
#[derive(Debug)]
struct RecordingFs {
    base: PathBuf,
    log: Mutex<Vec<Op>>,
    one_at_a_time: Mutex<()>,
}

impl RecordingFs {
    fn new(base: &Path) -> Arc<Self> {
        Arc::new(RecordingFs {
            base: base.to_path_buf(),
            log: Mutex::new(Vec::new()),
            one_at_a_time: Mutex::new(()),
        })
    }

    fn rel(&self, path: &Path) -> PathBuf {
        path.strip_prefix(&self.base)
            .unwrap_or_else(|_| panic!("{} is outside the recorded tree", path.display()))
            .to_path_buf()
    }

    fn push(&self, op: Op) {
        self.log.lock().unwrap().push(op);
    }

    fn returned(&self, what: impl Into<String>, paths: Vec<PathBuf>) {
        let paths = paths.iter().map(|p| self.rel(p)).collect();
        self.push(Op::Returned {
            what: what.into(),
            paths,
        });
    }

    fn ops(&self) -> Vec<Op> {
        self.log.lock().unwrap().clone()
    }
}

impl Fs for RecordingFs {
    fn create_dir(&self, path: &Path) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        let existed = path.is_dir();
        RealFs.create_dir(path)?;
        if !existed {
            self.push(Op::CreateDir(self.rel(path)));
        }
        Ok(())
    }

    fn write_new(&self, path: &Path, data: &[u8], sync: bool) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        RealFs.write_new(path, data, sync)?;
        self.push(Op::Write {
            path: self.rel(path),
            data: data.to_vec(),
        });
        if sync {
            self.push(Op::SyncFile(self.rel(path)));
        }
        Ok(())
    }

    fn sync_file(&self, path: &Path) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        RealFs.sync_file(path)?;
        self.push(Op::SyncFile(self.rel(path)));
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        RealFs.sync_dir(path)?;
        self.push(Op::SyncDir(self.rel(path)));
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        RealFs.rename(from, to)?;
        self.push(Op::Rename(self.rel(from), self.rel(to)));
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> std::io::Result<()> {
        let _serial = self.one_at_a_time.lock().unwrap();
        RealFs.remove_file(path)?;
        self.push(Op::Remove(self.rel(path)));
        Ok(())
    }
}

// ---- The model -------------------------------------------------------------------------

type Ino = usize;

#[derive(Debug, Clone)]
enum Inode {
    File {
        data: Vec<u8>,
        /// What an fsync made durable; `None`: nothing yet.
        durable: Option<Vec<u8>>,
    },
    Dir {
        entries: BTreeMap<OsString, Ino>,
        durable: BTreeMap<OsString, Ino>,
    },
}

/// The file system as the running program sees it, and what of it is durable.
#[derive(Debug, Clone)]
struct Model {
    inodes: Vec<Inode>,
}

const ROOT: Ino = 0;

fn components(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            _ => None,
        })
        .collect()
}

impl Model {
    /// `base` itself exists durably and is empty (the test gives each run a fresh one).
    fn new() -> Self {
        Model {
            inodes: vec![Inode::Dir {
                entries: BTreeMap::new(),
                durable: BTreeMap::new(),
            }],
        }
    }

    fn lookup(&self, path: &Path) -> Option<Ino> {
        let mut ino = ROOT;
        for name in components(path) {
            match &self.inodes[ino] {
                Inode::Dir { entries, .. } => ino = *entries.get(&name)?,
                Inode::File { .. } => return None,
            }
        }
        Some(ino)
    }

    fn split(&self, path: &Path) -> (Ino, OsString) {
        let mut parts = components(path);
        let name = parts.pop().expect("not the root");
        let parent: PathBuf = parts.iter().collect();
        let parent = self
            .lookup(&parent)
            .unwrap_or_else(|| panic!("model: no parent for {}", path.display()));
        (parent, name)
    }

    fn entries_mut(&mut self, dir: Ino) -> &mut BTreeMap<OsString, Ino> {
        match &mut self.inodes[dir] {
            Inode::Dir { entries, .. } => entries,
            Inode::File { .. } => panic!("model: not a directory"),
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::CreateDir(path) => {
                let (parent, name) = self.split(path);
                self.inodes.push(Inode::Dir {
                    entries: BTreeMap::new(),
                    durable: BTreeMap::new(),
                });
                let ino = self.inodes.len() - 1;
                self.entries_mut(parent).entry(name).or_insert(ino);
            }
            Op::Write { path, data } => {
                let (parent, name) = self.split(path);
                self.inodes.push(Inode::File {
                    data: data.clone(),
                    durable: None,
                });
                let ino = self.inodes.len() - 1;
                self.entries_mut(parent).insert(name, ino);
            }
            Op::SyncFile(path) => {
                let ino = self.lookup(path).expect("model: fsync of a missing file");
                if let Inode::File { data, durable } = &mut self.inodes[ino] {
                    *durable = Some(data.clone());
                }
            }
            Op::SyncDir(path) => {
                let ino = self
                    .lookup(path)
                    .expect("model: fsync of a missing directory");
                if let Inode::Dir { entries, durable } = &mut self.inodes[ino] {
                    *durable = entries.clone();
                }
            }
            Op::Rename(from, to) => {
                let (from_parent, from_name) = self.split(from);
                let ino = self
                    .entries_mut(from_parent)
                    .remove(&from_name)
                    .expect("model: rename of a missing name");
                let (to_parent, to_name) = self.split(to);
                self.entries_mut(to_parent).insert(to_name, ino);
                if !self.tree_durable(ino) {
                    return Err(format!(
                        "{} was renamed to {} before its data was fsynced",
                        from.display(),
                        to.display()
                    ));
                }
            }
            Op::Remove(path) => {
                let (parent, name) = self.split(path);
                self.entries_mut(parent).remove(&name);
            }
            Op::Returned { what, paths } => {
                for path in paths {
                    self.path_durable(path)
                        .map_err(|why| format!("{what} returned while {} {why}", path.display()))?;
                }
            }
        }
        Ok(())
    }

    /// Whether the data of `ino`, and for a directory every name and inode below it, is
    /// durable.
    fn tree_durable(&self, ino: Ino) -> bool {
        match &self.inodes[ino] {
            Inode::File { data, durable } => durable.as_ref() == Some(data),
            Inode::Dir { entries, durable } => {
                entries == durable && entries.values().all(|&child| self.tree_durable(child))
            }
        }
    }

    /// Whether every name from the root to `path` and everything at `path` is durable.
    fn path_durable(&self, path: &Path) -> Result<(), &'static str> {
        let mut ino = ROOT;
        for name in components(path) {
            let Inode::Dir { entries, durable } = &self.inodes[ino] else {
                return Err("is below a file");
            };
            let Some(&child) = entries.get(&name) else {
                return Err("does not exist");
            };
            if durable.get(&name) != Some(&child) {
                return Err("has a name that is not fsynced into its directory");
            }
            ino = child;
        }
        if self.tree_durable(ino) {
            Ok(())
        } else {
            Err("has data that is not fsynced")
        }
    }

    /// Writes what survives a crash now into `dest`: for every directory entry whose
    /// durable and current values differ, `choose` says whether the change reached the
    /// disk; file data is what was fsynced, or for data never fsynced, what `torn` keeps.
    fn materialize(
        &self,
        dest: &Path,
        choose: &mut dyn FnMut() -> bool,
        torn: &mut dyn FnMut(&[u8]) -> Vec<u8>,
    ) {
        self.materialize_dir(ROOT, dest, choose, torn, 0);
    }

    fn materialize_dir(
        &self,
        ino: Ino,
        dest: &Path,
        choose: &mut dyn FnMut() -> bool,
        torn: &mut dyn FnMut(&[u8]) -> Vec<u8>,
        depth: usize,
    ) {
        assert!(depth < 64, "model: directory cycle");
        let Inode::Dir { entries, durable } = &self.inodes[ino] else {
            unreachable!()
        };
        let mut names: Vec<&OsString> = entries.keys().chain(durable.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let now = entries.get(name);
            let kept = durable.get(name);
            let survivor = if now == kept || choose() { now } else { kept };
            let Some(&child) = survivor else { continue };
            let path = dest.join(name);
            match &self.inodes[child] {
                Inode::File { data, durable } => {
                    let content = match durable {
                        Some(d) if d == data => d.clone(),
                        Some(d) => d.clone(),
                        None => torn(data),
                    };
                    std::fs::write(&path, content).unwrap();
                }
                Inode::Dir { .. } => {
                    // A directory can survive under two names (a rename half on disk);
                    // the second copy is as good as the first for a reader.
                    std::fs::create_dir_all(&path).unwrap();
                    self.materialize_dir(child, &path, choose, torn, depth + 1);
                }
            }
        }
    }
}

/// A small deterministic generator (xorshift), so failures replay.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The ways a crash may resolve: nothing unsynced survived, every unsynced name survived
/// (with its data lost unless fsynced), and mixtures.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    OnlySynced,
    AllNames,
    Mixed(u64),
}

const OUTCOMES: [Outcome; 4] = [
    Outcome::OnlySynced,
    Outcome::AllNames,
    Outcome::Mixed(0x9e37_79b9_7f4a_7c15),
    Outcome::Mixed(0xd1b5_4a32_d192_ed03),
];

fn crash_state(model: &Model, outcome: Outcome, dest: &Path) {
    std::fs::create_dir_all(dest).unwrap();
    match outcome {
        Outcome::OnlySynced => model.materialize(dest, &mut || false, &mut |_| Vec::new()),
        Outcome::AllNames => model.materialize(dest, &mut || true, &mut |_| Vec::new()),
        Outcome::Mixed(seed) => {
            let dice = std::cell::RefCell::new(Dice(seed));
            model.materialize(
                dest,
                &mut || dice.borrow_mut().next().is_multiple_of(2),
                &mut |data: &[u8]| {
                    let keep = dice.borrow_mut().next() as usize % (data.len() + 1);
                    data[..keep].to_vec()
                },
            )
        }
    }
}

/// Replays `ops`, failing on the first ordering violation.
fn check_order(ops: &[Op]) -> Result<(), String> {
    let mut model = Model::new();
    for (step, op) in ops.iter().enumerate() {
        model
            .apply(op)
            .map_err(|why| format!("step {step} ({op:?}): {why}"))?;
    }
    Ok(())
}

// ---- The tests -------------------------------------------------------------------------

/// A checkpoint-like directory: a file spanning several chunks, a small one, a subdir.
fn make_checkpoint(dir: &Path, seed: u8) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut big = Vec::with_capacity(160 * 1024);
    let mut x = u64::from(seed) + 1;
    while big.len() < 160 * 1024 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        big.extend_from_slice(&x.to_le_bytes());
    }
    files.insert(PathBuf::from("pages.bin"), big);
    files.insert(
        PathBuf::from("state/meta.json"),
        format!("{{\"seed\":{seed}}}").into_bytes(),
    );
    for (rel, data) in &files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
    files
}

/// The crash model's store: loose chunks, or packs of about 64 KiB (so a put writes several).
fn small_chunks(packed: bool) -> StoreConfig {
    StoreConfig {
        pack_bytes: packed.then_some(64 * 1024),
        chunking: crate::manifest::ChunkParams {
            min: 4 * 1024,
            avg: 16 * 1024,
            max: 64 * 1024,
        },
        ..StoreConfig::default()
    }
}

fn read_tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let rel = path.strip_prefix(root).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// Opens the store a crash left at `root` and checks it against what was put.
async fn check_store_after_crash(
    root: &Path,
    scratch: &Path,
    committed: &[SnapshotId],
    contents: &HashMap<SnapshotId, BTreeMap<PathBuf, Vec<u8>>>,
    packed: bool,
) -> Result<(), String> {
    let backend: Arc<dyn Backend> =
        Arc::new(LocalBackend::open(root).map_err(|e| format!("open: {e}"))?);
    let store = Store::new(backend, small_chunks(packed)).map_err(|e| format!("store: {e}"))?;
    let listed = store
        .list_snapshots()
        .await
        .map_err(|e| format!("list: {e}"))?;
    for id in committed {
        if !listed.contains(id) {
            return Err(format!("snapshot {id} was committed but is gone"));
        }
    }
    for id in &listed {
        let report = store
            .verify(id)
            .await
            .map_err(|e| format!("snapshot {id} is listed but unreadable: {e:?}"))?;
        if !report.problems.is_empty() {
            return Err(format!("snapshot {id} is damaged: {:?}", report.problems));
        }
        let dest = scratch.join(id.as_str());
        store
            .get_dir(id, &dest)
            .await
            .map_err(|e| format!("snapshot {id} does not restore: {e:?}"))?;
        let expected = contents
            .get(id)
            .ok_or_else(|| format!("snapshot {id} was never put"))?;
        if &read_tree(&dest) != expected {
            return Err(format!("snapshot {id} restores to other content"));
        }
    }
    Ok(())
}

/// Every prefix of `ops`, under every outcome: `check` must accept the surviving state.
/// `committed_by` lists, per prefix, what had returned.
async fn crash_at_every_step<F, Fut>(ops: &[Op], check: F)
where
    F: FnMut(PathBuf, PathBuf, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    crash_at_every_step_from(ops, 0, check).await
}

/// [`crash_at_every_step`] for the prefixes of at least `from` operations (the ones before
/// are applied, crash-free: covered by another test).
async fn crash_at_every_step_from<F, Fut>(ops: &[Op], from: usize, mut check: F)
where
    F: FnMut(PathBuf, PathBuf, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let mut model = Model::new();
    let mut returned: Vec<String> = Vec::new();
    for step in 0..=ops.len() {
        for &outcome in OUTCOMES.iter().filter(|_| step >= from) {
            let t = tempfile::tempdir().unwrap();
            let state = t.path().join("disk");
            crash_state(&model, outcome, &state);
            if let Err(why) = check(state, t.path().join("scratch"), returned.clone()).await {
                panic!(
                    "crash after {step} of {} operations ({outcome:?}): {why}\nlast: {:?}",
                    ops.len(),
                    step.checked_sub(1).map(|s| &ops[s])
                );
            }
        }
        if let Some(op) = ops.get(step) {
            model.apply(op).unwrap();
            if let Op::Returned { what, .. } = op {
                returned.push(what.clone());
            }
        }
    }
}

/// A store (see [`small_chunks`]) on a recording file system: the temporary directory, the
/// recorder, the store's root and the store.
fn recording_store(packed: bool) -> (tempfile::TempDir, Arc<RecordingFs>, PathBuf, Store) {
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base");
    std::fs::create_dir(&base).unwrap();
    let fs = RecordingFs::new(&base);
    let root = base.join("store");
    let backend = LocalBackend::open_with(root.clone(), fs.clone()).unwrap();
    let store = Store::new(Arc::new(backend), small_chunks(packed)).unwrap();
    (t, fs, root, store)
}

async fn record_two_puts(
    packed: bool,
) -> (
    tempfile::TempDir,
    Vec<Op>,
    HashMap<SnapshotId, BTreeMap<PathBuf, Vec<u8>>>,
) {
    let (t, fs, root, store) = recording_store(packed);
    let mut contents = HashMap::new();
    let mut parent = None;
    for seed in [1u8, 2] {
        let src = t.path().join(format!("ckpt-{seed}"));
        let files = make_checkpoint(&src, seed);
        let put = store.put_dir(&src, parent.as_ref()).await.unwrap();
        let manifest = store.load_manifest(&put.id).await.unwrap();
        let mut paths = vec![root.join(store.manifest_key(&put.id).as_str())];
        for (chunk, _) in manifest.chunk_refs() {
            match manifest.packs.get(chunk) {
                Some(loc) => {
                    paths.push(root.join(store.pack_key(&loc.pack).as_str()));
                    paths.push(root.join(store.pack_index_key(&loc.pack).as_str()));
                }
                None => paths.push(root.join(store.chunk_key(chunk).as_str())),
            }
        }
        assert_eq!(manifest.packs.is_empty(), !packed);
        fs.returned(put.id.as_str(), paths);
        contents.insert(put.id.clone(), files);
        parent = Some(put.id);
    }
    (t, fs.ops(), contents)
}

#[tokio::test]
async fn store_puts_fsync_before_they_publish_and_before_they_return() {
    for packed in [false, true] {
        let (_t, ops, _) = record_two_puts(packed).await;
        assert!(
            ops.iter().filter(|op| matches!(op, Op::Rename(..))).count() > 10,
            "the puts wrote several chunks or packs: {ops:?}"
        );
        check_order(&ops).unwrap();
    }
}

async fn crash_at_every_step_of_two_puts(packed: bool) {
    let (_t, ops, contents) = record_two_puts(packed).await;
    let contents = &contents;
    crash_at_every_step(&ops, |state, scratch, returned| async move {
        let committed: Vec<SnapshotId> = returned
            .iter()
            .map(|id| SnapshotId::new(id.as_str()).unwrap())
            .collect();
        check_store_after_crash(&state.join("store"), &scratch, &committed, contents, packed).await
    })
    .await;
}

#[tokio::test]
async fn a_crash_at_any_step_of_a_put_leaves_every_listed_snapshot_complete() {
    crash_at_every_step_of_two_puts(false).await;
}

#[tokio::test]
async fn a_crash_at_any_step_of_a_packed_put_leaves_every_listed_snapshot_complete() {
    crash_at_every_step_of_two_puts(true).await;
}

/// Two packed puts sharing the first half of a file, the first deleted, then a collector
/// (with `repack`: one that repacks every pack the second does not use whole): each step
/// recorded; the ops, how many were the puts', the second snapshot, what each holds.
async fn record_delete_and_collect(
    repack: bool,
) -> (
    tempfile::TempDir,
    Vec<Op>,
    usize,
    SnapshotId,
    HashMap<SnapshotId, BTreeMap<PathBuf, Vec<u8>>>,
) {
    let (t, fs, _, store) = recording_store(true);
    let (src_a, src_b) = (t.path().join("ckpt-a"), t.path().join("ckpt-b"));
    let files_a = make_checkpoint(&src_a, 1);
    // The same checkpoint with the second half of its pages rewritten.
    let mut files_b = files_a.clone();
    let pages = files_b.get_mut(Path::new("pages.bin")).unwrap();
    let half = pages.len() / 2;
    pages[half..].copy_from_slice(
        &make_checkpoint(&t.path().join("ckpt-x"), 7)[Path::new("pages.bin")][half..],
    );
    for (rel, data) in &files_b {
        let path = src_b.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
    let a = store.put_dir(&src_a, None).await.unwrap();
    let b = store.put_dir(&src_b, None).await.unwrap();
    assert!(b.stats.chunks_reused > 0, "{:?}", b.stats);
    let puts = fs.ops().len();
    store.delete_snapshot(&a.id).await.unwrap();
    let report = store
        .gc(&crate::GcOptions {
            repack_below: repack.then_some(1.0),
            merge_small: repack,
            ..crate::GcOptions::default()
        })
        .await
        .unwrap();
    assert!(report.packs_removed > 0, "{report:?}");
    assert_eq!(
        (report.packs_repacked > 0, report.manifests_rewritten),
        (repack, u64::from(repack)),
        "{report:?}"
    );
    let contents = HashMap::from([(a.id, files_a), (b.id.clone(), files_b)]);
    (t, fs.ops(), puts, b.id, contents)
}

#[tokio::test]
async fn a_crash_at_any_step_of_a_delete_and_a_collection_leaves_every_listed_snapshot_complete() {
    crash_at_every_step_of_a_delete_and_a_collection(false).await;
}

#[tokio::test]
async fn a_crash_at_any_step_of_a_delete_and_a_repacking_collection_leaves_every_listed_snapshot_complete(
) {
    crash_at_every_step_of_a_delete_and_a_collection(true).await;
}

async fn crash_at_every_step_of_a_delete_and_a_collection(repack: bool) {
    let (_t, ops, puts, b, contents) = record_delete_and_collect(repack).await;
    check_order(&ops).unwrap();
    let contents = &contents;
    // Crashes during the puts are the tests above; from the delete on, every step (the puts
    // fsynced before they returned, so they are all there to start from).
    crash_at_every_step_from(&ops, puts, |state, scratch, _| {
        let b = b.clone();
        async move {
            check_store_after_crash(&state.join("store"), &scratch, &[b], contents, true).await
        }
    })
    .await;
}

/// What the engine does with a runsc checkpoint: runsc writes files (unsynced), the engine
/// fsyncs the tree, renames it into place and only then reports it done.
fn record_checkpoint_publish(base: &Path, fs: &RecordingFs, sync: bool) -> Vec<Op> {
    let tmp = base.join(".image.tmp");
    fs.create_dir(&tmp).unwrap();
    fs.create_dir(&tmp.join("fs")).unwrap();
    fs.write_new(&tmp.join("checkpoint.img"), b"all of the memory", false)
        .unwrap();
    fs.write_new(&tmp.join("fs/upper.tar"), b"the rootfs overlay", false)
        .unwrap();
    if sync {
        durable::fsync_tree_with(fs, &tmp).unwrap();
    }
    let dest = base.join("image");
    durable::rename_durably_with(fs, &tmp, &dest).unwrap();
    fs.returned("image", vec![dest]);
    durable::write_file_durably_with(fs, &base.join("record"), b"image").unwrap();
    fs.returned("record", vec![base.join("record")]);
    fs.ops()
}

#[test]
fn a_checkpoint_directory_published_with_fsync_tree_survives_any_crash() {
    let t = tempfile::tempdir().unwrap();
    let fs = RecordingFs::new(t.path());
    let ops = record_checkpoint_publish(t.path(), &fs, true);
    check_order(&ops).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(crash_at_every_step(&ops, |state, _, returned| async move {
        // The record names the image only once it is written; whenever the record is
        // there, the image must be whole.
        let record = std::fs::read(state.join("record")).unwrap_or_default();
        let image_needed = returned.iter().any(|r| r == "image") || record == b"image";
        if !image_needed {
            return Ok(());
        }
        let image = state.join("image");
        let memory = std::fs::read(image.join("checkpoint.img")).unwrap_or_default();
        let overlay = std::fs::read(image.join("fs/upper.tar")).unwrap_or_default();
        if memory == b"all of the memory" && overlay == b"the rootfs overlay" {
            Ok(())
        } else {
            Err(format!("the image is incomplete: {memory:?} {overlay:?}"))
        }
    }));
}

#[test]
fn the_checker_catches_a_rename_before_fsync() {
    // The same steps without fsync_tree: the model must refuse them, or the tests above
    // prove nothing.
    let t = tempfile::tempdir().unwrap();
    let fs = RecordingFs::new(t.path());
    let ops = record_checkpoint_publish(t.path(), &fs, false);
    let err = check_order(&ops).unwrap_err();
    assert!(err.contains("before its data was fsynced"), "{err}");

    // And a crash right after the rename shows the damage the rule prevents.
    let mut model = Model::new();
    for op in ops
        .iter()
        .take_while(|op| !matches!(op, Op::Returned { .. }))
    {
        let _ = model.apply(op);
    }
    let state = t.path().join("crash");
    crash_state(&model, Outcome::AllNames, &state);
    assert_eq!(
        std::fs::read(state.join("image/checkpoint.img")).unwrap(),
        b""
    );
}

#[test]
fn the_checker_catches_a_missing_directory_fsync() {
    let t = tempfile::tempdir().unwrap();
    let fs = RecordingFs::new(t.path());
    let file = t.path().join("object");
    let tmp = t.path().join("object.tmp");
    fs.write_new(&tmp, b"data", true).unwrap();
    fs.rename(&tmp, &file).unwrap();
    fs.returned("object", vec![file]);
    let err = check_order(&fs.ops()).unwrap_err();
    assert!(err.contains("not fsynced into its directory"), "{err}");
}
