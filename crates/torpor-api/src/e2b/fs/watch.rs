//! Directory watches (`CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`, and the `WatchDir`
//! stream).
//!
//! With an agent of protocol [`proto::WATCH_SINCE`] or later (every sandbox this torpor made
//! or rebooted), a watch is an inotify watch inside the sandbox, as envd's: the agent queues
//! every change (create, write, remove, rename of the old name, chmod) in order, also those
//! undone at once, and a recursive watch follows folders made later (see the agent's
//! `watch`). `GetWatcherEvents` and the `WatchDir` stream take the queued events (the stream
//! every [`WATCH_POLL`], by a call that neither wakes the sandbox nor counts as its
//! activity); a `CreateWatcher` watch needs no background poll, since its events wait in the
//! agent (at most [`proto::MAX_WATCH_EVENTS`]). With `includeEntry`, each event of an entry
//! that still exists carries its `EntryInfo`, read when the event is handed out.
//!
//! No look at a watch wakes its sandbox ([`Look`]): nothing changes in a sleeping sandbox's
//! files, so `GetWatcherEvents` of a sandbox that sleeps (frozen, parked, suspended, paused
//! through E2B with auto-resume) answers what is buffered here, usually nothing, and leaves it
//! asleep; what the agent queued before it slept comes at the first poll once it runs again.
//! Of a running sandbox the poll is its activity, as any call, so a polled sandbox stays
//! awake.
//!
//! An older agent (a sandbox restored from an older torpor's snapshot) is watched as before:
//! snapshots of the directory (recursive: every level, so folders made after the watch
//! started are watched too), diffed into envd's events. A watcher made by `CreateWatcher` is polled in the background every [`WATCH_POLL`] while its
//! sandbox runs (never waking it), and its events queue up until the client asks for them, as
//! envd's inotify queue does: a file made, written and removed between two
//! `GetWatcherEvents` gives its three events, in that order. Within one poll, events are
//! ordered by modification time (a created folder before what it holds, a create before its
//! write, removes last, deepest first). A change that is undone within one poll is not seen.
//! With `includeEntry`, create and write events carry the entry's `EntryInfo`, as `get_info`
//! gives it (a symlink's target type and `symlink_target`, the file's metadata).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde_json::json;
use torpor_core::{SandboxId, TenantId, Tier};
use torpor_runtime::proto::{self, DirEntry, FileKind, MetaEntry, Reply, Request, WatchOp};

use super::super::connect::{self, Code, Item, RpcError};
use super::super::envd::Ctx;
use super::super::{is_running, E2b};
use super::{describe, join, metadata, stat, walk};

/// Who looks at a watch. Neither look wakes a sleeping sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// A background look (a `WatchDir` stream's, a polled watcher's poller): not the
    /// sandbox's activity.
    Background,
    /// The client's `GetWatcherEvents`: the sandbox's activity while it runs, as any call.
    Client,
}

/// How often a watcher looks at its directory.
pub const WATCH_POLL: Duration = Duration::from_millis(200);
/// A watcher nobody asked for events for this long is removed.
pub const WATCHER_IDLE: Duration = Duration::from_secs(60);
/// Watchers (CreateWatcher) one sandbox may have.
pub const MAX_WATCHERS_PER_SANDBOX: usize = 64;
/// Watchers one tenant's sandboxes may have together.
pub const MAX_WATCHERS_PER_TENANT: usize = 256;
/// Events one watcher keeps for its client; past that the oldest go (logged).
pub const MAX_PENDING: usize = 10_000;

/// Removes the watchers unpolled for [`WATCHER_IDLE`] (called by the adapter's sweep and
/// before a watcher is made); answers how many went.
pub fn expire_watchers(st: &E2b) -> usize {
    let mut all = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
    expire_at(&mut all, Instant::now())
}

pub(super) fn expire_at(all: &mut HashMap<String, Watcher>, now: Instant) -> usize {
    let before = all.len();
    all.retain(|_, w| now.saturating_duration_since(w.polled) < WATCHER_IDLE);
    before - all.len()
}

pub(super) fn room_for_watcher(st: &E2b, c: &Ctx) -> Result<(), RpcError> {
    expire_watchers(st);
    let all = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
    check_watcher_caps(&all, c)
}

pub(super) fn check_watcher_caps(all: &HashMap<String, Watcher>, c: &Ctx) -> Result<(), RpcError> {
    let of_sandbox = all.values().filter(|w| w.sandbox == c.id).count();
    let of_tenant = all.values().filter(|w| w.tenant == c.tenant).count();
    if of_sandbox >= MAX_WATCHERS_PER_SANDBOX || of_tenant >= MAX_WATCHERS_PER_TENANT {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!(
                "too many watchers ({MAX_WATCHERS_PER_SANDBOX} per sandbox, \
                 {MAX_WATCHERS_PER_TENANT} per tenant); remove one (RemoveWatcher) or let \
                 an unpolled one expire ({} s)",
                WATCHER_IDLE.as_secs()
            ),
        ));
    }
    Ok(())
}

/// The state of a watcher of `c`'s sandbox with id `id`, its last poll marked now.
pub(super) fn watch_state(
    st: &E2b,
    c: &Ctx,
    id: &str,
) -> Result<Arc<tokio::sync::Mutex<WatchState>>, RpcError> {
    let mut all = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
    match all.get_mut(id) {
        Some(w) if w.sandbox == c.id => {
            w.polled = Instant::now();
            Ok(w.state.clone())
        }
        _ => Err(RpcError::new(
            Code::NotFound,
            format!("watcher {id:?} not found"),
        )),
    }
}

pub(super) fn remove_watcher(st: &E2b, c: &Ctx, id: &str) -> Result<(), RpcError> {
    let mut all = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
    match all.get(id) {
        Some(w) if w.sandbox == c.id => {
            all.remove(id);
            Ok(())
        }
        _ => Err(RpcError::new(
            Code::NotFound,
            format!("watcher {id:?} not found"),
        )),
    }
}

/// What a snapshot holds of one entry.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    dir: String,
    entry: DirEntry,
}

/// A watch's agent watch (or last snapshot) and the events not yet handed out.
pub struct WatchState {
    root: String,
    recursive: bool,
    include_entry: bool,
    /// The agent's inotify watch; `None`: polled snapshots (`seen`).
    agent_watch: Option<u64>,
    seen: BTreeMap<String, Seen>,
    pending: VecDeque<serde_json::Value>,
}

impl WatchState {
    /// A watch of `root` (a directory, else `invalid_argument`), its first snapshot taken.
    pub(super) async fn new(
        st: &E2b,
        c: &Ctx,
        root: String,
        recursive: bool,
        include_entry: bool,
    ) -> Result<WatchState, RpcError> {
        let e = stat(st, c, &root).await?;
        if e["type"] != "FILE_TYPE_DIRECTORY" {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("path {root:?} is not a directory"),
            ));
        }
        let mut w = WatchState {
            root,
            recursive,
            include_entry,
            agent_watch: None,
            seen: BTreeMap::new(),
            pending: VecDeque::new(),
        };
        if agent_watches(st, c).await {
            let req = Request::WatchStart {
                path: w.root.clone(),
                recursive,
            };
            match st.api.engine.agent_call(&c.tenant, &c.id, req, &[]).await {
                Ok((Reply::Watch { watch }, _)) => {
                    w.agent_watch = Some(watch);
                    return Ok(w);
                }
                Ok((other, _)) => {
                    tracing::warn!(sandbox = %c.id, reply = ?other, "unexpected reply to a watch; polling")
                }
                Err(e) => {
                    tracing::info!(sandbox = %c.id, error = %e, "agent watch refused; polling")
                }
            }
        }
        w.seen = w.snapshot(st, c).await?;
        Ok(w)
    }

    /// Takes the agent's queued events, if the sandbox runs (one that sleeps is not woken:
    /// nothing is taken), and queues them as envd's. A watch the agent no longer has (ended as
    /// its oldest past its bound) goes on as a polled one from now.
    async fn take_agent_events(
        &mut self,
        st: &E2b,
        c: &Ctx,
        watch: u64,
        look: Look,
    ) -> Result<(), RpcError> {
        let req = Request::WatchEvents { watch };
        let engine = &st.api.engine;
        let reply = match look {
            Look::Background => engine.quiet_call_if_running(&c.id, &req, &[]).await?,
            Look::Client => engine.call_if_running(&c.id, &req, &[]).await?,
        };
        let Some((reply, _)) = reply else {
            return Ok(());
        };
        let (events, overflowed) = match reply {
            Reply::WatchEvents { events, overflowed } => (events, overflowed),
            other => {
                tracing::info!(sandbox = %c.id, watch, reply = ?other, "agent watch gone; polling");
                self.agent_watch = None;
                self.seen = self.snapshot(st, c).await?;
                return Ok(());
            }
        };
        if overflowed {
            tracing::debug!(sandbox = %c.id, "e2b watch: the agent's queue overflowed; events lost");
        }
        let mut lookups = 0usize;
        for e in events {
            let ty = match e.op {
                WatchOp::Create => EventType::Create,
                WatchOp::Write => EventType::Write,
                WatchOp::Remove => EventType::Remove,
                WatchOp::Rename => EventType::Rename,
                WatchOp::Chmod => EventType::Chmod,
            };
            let mut ev = json!({"name": e.name, "type": ty.as_str()});
            if self.include_entry
                && matches!(ty, EventType::Create | EventType::Write | EventType::Chmod)
                && lookups < MAX_ENTRY_METADATA_LOOKUPS
            {
                lookups += 1;
                // Gone again since, or unreadable: the event goes without.
                if let Ok(entry) = super::stat(st, c, &join(&self.root, &e.name)).await {
                    ev["entry"] = entry;
                }
            }
            self.queue(c, ev);
        }
        Ok(())
    }

    fn queue(&mut self, c: &Ctx, ev: serde_json::Value) {
        if self.pending.len() >= MAX_PENDING {
            self.pending.pop_front();
            tracing::debug!(sandbox = %c.id, "e2b watcher queue full: oldest event dropped");
        }
        self.pending.push_back(ev);
    }

    async fn snapshot(&self, st: &E2b, c: &Ctx) -> Result<BTreeMap<String, Seen>, RpcError> {
        let depth = if self.recursive { 32 } else { 1 };
        let prefix = if self.root == "/" {
            1
        } else {
            self.root.len() + 1
        };
        // Events carry no metadata: reading every entry's attributes on each look would cost
        // the sandbox more than a watch is worth.
        Ok(walk(st, c, &self.root, depth, false)
            .await?
            .into_iter()
            .map(|(dir, MetaEntry { entry, .. })| {
                let full = join(&dir, &entry.name);
                (
                    full[prefix.min(full.len())..].to_string(),
                    Seen { dir, entry },
                )
            })
            .collect())
    }

    /// Queues what changed since the last look, if the sandbox runs: the agent's events, or
    /// a new snapshot's difference. A sleeping sandbox is not woken: nothing changed in it.
    pub(super) async fn poll(&mut self, st: &E2b, c: &Ctx, look: Look) -> Result<(), RpcError> {
        if let Some(watch) = self.agent_watch {
            return self.take_agent_events(st, c, watch, look).await;
        }
        if !st.api.engine.is_running_now(&c.id) {
            return Ok(());
        }
        let now = self.snapshot(st, c).await?;
        let changes = diff(&self.seen, &now);
        if !changes.is_empty() {
            let entries = if self.include_entry {
                event_entries(st, c, &now, &changes).await
            } else {
                HashMap::new()
            };
            for (name, ty) in changes {
                let mut ev = json!({"name": name, "type": ty.as_str()});
                // (Removes have none: `event_entries` leaves them out.)
                if let (Some(entry), false) = (entries.get(&name), ty == EventType::Remove) {
                    ev["entry"] = entry.clone();
                }
                self.queue(c, ev);
            }
        }
        self.seen = now;
        Ok(())
    }

    pub(super) fn drain(&mut self) -> Vec<serde_json::Value> {
        self.pending.drain(..).collect()
    }
}

/// Most entries of one poll whose metadata is looked up for their events (one agent call
/// each); past that, events' entries carry no metadata.
pub const MAX_ENTRY_METADATA_LOOKUPS: usize = 256;

/// The `EntryInfo` of each created or written entry of one poll, by event name, as
/// `get_info` describes it: a symlink's target type and `symlink_target`, owner and group by
/// name, and its metadata (looked up for these entries only: the snapshots carry none).
async fn event_entries(
    st: &E2b,
    c: &Ctx,
    now: &BTreeMap<String, Seen>,
    changes: &[(String, EventType)],
) -> HashMap<String, serde_json::Value> {
    let touched: Vec<(&String, &Seen)> = changes
        .iter()
        .filter(|(_, ty)| *ty != EventType::Remove)
        .filter_map(|(name, _)| now.get_key_value(name))
        .collect();
    let keeps = matches!(metadata::agent_keeps_metadata(st, c).await, Ok(true));
    let mut found = Vec::with_capacity(touched.len());
    for (i, (_, s)) in touched.iter().enumerate() {
        let mut metadata = BTreeMap::new();
        if keeps && i < MAX_ENTRY_METADATA_LOOKUPS {
            // Gone again since the snapshot, or unreadable: its entry goes without.
            if let Ok(m) = metadata::list(st, c, &s.dir, Some(&s.entry.name)).await {
                if let Some(m) = m.into_iter().find(|m| m.entry.name == s.entry.name) {
                    metadata = m.metadata;
                }
            }
        }
        found.push((
            s.dir.clone(),
            MetaEntry {
                entry: s.entry.clone(),
                metadata,
            },
        ));
    }
    touched
        .into_iter()
        .map(|(name, _)| name.clone())
        .zip(describe(st, c, &found).await)
        .collect()
}

/// A `CreateWatcher` watch: its state, shared with the task that polls it in the background
/// (stopped when the watcher is dropped: removed or expired).
pub struct Watcher {
    pub(super) sandbox: SandboxId,
    pub(super) tenant: TenantId,
    /// When events were last asked for (or it was made): unpolled for [`WATCHER_IDLE`], it goes.
    pub(super) polled: Instant,
    pub(super) state: Arc<tokio::sync::Mutex<WatchState>>,
    poller: Option<tokio::task::AbortHandle>,
    /// The adapter and the agent watch to stop when this goes.
    agent: Option<(Weak<E2b>, u64)>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(p) = &self.poller {
            p.abort();
        }
        if let Some((st, watch)) = self.agent.take() {
            stop_agent_watch(st, self.sandbox.clone(), watch);
        }
    }
}

/// Ends an agent watch in the background, if its sandbox runs (a sleeping one keeps it until
/// the agent's bound ends it: nothing is woken for it).
pub(super) fn stop_agent_watch(st: Weak<E2b>, sandbox: SandboxId, watch: u64) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        if let Some(st) = st.upgrade() {
            let req = Request::WatchStop { watch };
            let _ = st
                .api
                .engine
                .quiet_call_if_running(&sandbox, &req, &[])
                .await;
        }
    });
}

/// Stops an agent watch when dropped (the end of a `WatchDir` stream, however it ends).
struct StopOnDrop(Weak<E2b>, SandboxId, u64);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        stop_agent_watch(self.0.clone(), self.1.clone(), self.2);
    }
}

/// Whether the sandbox's agent has inotify watches (its hello says [`proto::WATCH_SINCE`]).
async fn agent_watches(st: &E2b, c: &Ctx) -> bool {
    matches!(
        st.api.engine.agent_call(&c.tenant, &c.id, Request::Hello, &[]).await,
        Ok((Reply::Hello { version, .. }, _)) if version >= proto::WATCH_SINCE
    )
}

impl Watcher {
    /// A watcher of `state`, polled in the background while the sandbox runs.
    pub(super) fn start(st: &Arc<E2b>, c: &Ctx, state: WatchState) -> Watcher {
        // An agent watch queues its events in the sandbox: nothing to poll meanwhile.
        if let Some(watch) = state.agent_watch {
            return Watcher {
                sandbox: c.id.clone(),
                tenant: c.tenant.clone(),
                polled: Instant::now(),
                state: Arc::new(tokio::sync::Mutex::new(state)),
                poller: None,
                agent: Some((Arc::downgrade(st), watch)),
            };
        }
        let state = Arc::new(tokio::sync::Mutex::new(state));
        let poller = tokio::spawn(poll_forever(
            Arc::downgrade(st),
            Ctx {
                tenant: c.tenant.clone(),
                id: c.id.clone(),
                base: c.base,
            },
            state.clone(),
        ))
        .abort_handle();
        Watcher {
            sandbox: c.id.clone(),
            tenant: c.tenant.clone(),
            polled: Instant::now(),
            state,
            poller: Some(poller),
            agent: None,
        }
    }

    #[cfg(test)]
    pub(super) fn idle(sandbox: SandboxId, tenant: TenantId, polled: Instant) -> Watcher {
        Watcher {
            sandbox,
            tenant,
            polled,
            state: Arc::new(tokio::sync::Mutex::new(WatchState {
                root: "/".into(),
                recursive: false,
                include_entry: false,
                agent_watch: None,
                seen: BTreeMap::new(),
                pending: VecDeque::new(),
            })),
            poller: None,
            agent: None,
        }
    }
}

/// Polls a watcher's directory every [`WATCH_POLL`] while its sandbox is running (a sleeping
/// one is not woken, and is not changing); errors wait for the client's next call, which polls
/// too and answers them.
async fn poll_forever(st: Weak<E2b>, c: Ctx, state: Arc<tokio::sync::Mutex<WatchState>>) {
    loop {
        tokio::time::sleep(WATCH_POLL).await;
        let Some(st) = st.upgrade() else { return };
        match st.api.engine.sandbox(&c.tenant, &c.id) {
            Ok(rec) if rec.tier == Tier::Running => {}
            Ok(_) => continue,
            Err(_) => return,
        }
        if let Err(e) = state.lock().await.poll(&st, &c, Look::Background).await {
            tracing::debug!(sandbox = %c.id, error = %e.message, "e2b watcher poll failed");
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Create => "EVENT_TYPE_CREATE",
            EventType::Write => "EVENT_TYPE_WRITE",
            EventType::Remove => "EVENT_TYPE_REMOVE",
            EventType::Rename => "EVENT_TYPE_RENAME",
            EventType::Chmod => "EVENT_TYPE_CHMOD",
        }
    }
}

/// The events between two snapshots (relative name → entry), in the order they most likely
/// happened: creates and writes by modification time (a folder made in this interval counts
/// from the earliest of what it holds, so it comes before its contents; ties keep name order,
/// a create before its write), then removes, deepest first.
pub(super) fn diff(
    before: &BTreeMap<String, Seen>,
    after: &BTreeMap<String, Seen>,
) -> Vec<(String, EventType)> {
    // (time key, name, type), in name order.
    let mut changed: Vec<(i64, String, EventType)> = Vec::new();
    for (name, now) in after {
        let e = &now.entry;
        let is_dir = e.kind == FileKind::Dir;
        match before.get(name) {
            None => {
                changed.push((e.modified_ms, name.clone(), EventType::Create));
                if !is_dir && e.size > 0 {
                    changed.push((e.modified_ms, name.clone(), EventType::Write));
                }
            }
            Some(old)
                if !is_dir
                    && (old.entry.size != e.size || old.entry.modified_ms != e.modified_ms) =>
            {
                changed.push((e.modified_ms, name.clone(), EventType::Write))
            }
            _ => {}
        }
    }
    // A created folder takes the earliest time of what changed under it.
    let created_dirs: Vec<usize> = changed
        .iter()
        .enumerate()
        .filter(|(_, (_, n, t))| *t == EventType::Create && after[n].entry.kind == FileKind::Dir)
        .map(|(i, _)| i)
        .collect();
    for i in created_dirs {
        let prefix = format!("{}/", changed[i].1);
        let earliest = changed
            .iter()
            .filter(|(_, n, _)| n.starts_with(&prefix))
            .map(|(t, _, _)| *t)
            .min();
        if let Some(t) = earliest {
            changed[i].0 = changed[i].0.min(t);
        }
    }
    changed.sort_by_key(|(t, _, _)| *t);
    let mut out: Vec<(String, EventType)> = changed.into_iter().map(|(_, n, t)| (n, t)).collect();
    let mut removed: Vec<&String> = before.keys().filter(|n| !after.contains_key(*n)).collect();
    removed.sort_by(|a, b| b.cmp(a));
    out.extend(removed.into_iter().map(|n| (n.clone(), EventType::Remove)));
    out
}

/// `WatchDir`: the watch's events as a server stream, polled every [`WATCH_POLL`]; ends with
/// `unavailable` when the sandbox goes to sleep.
pub(super) async fn watch_stream(
    st: Arc<E2b>,
    c: Ctx,
    mut w: WatchState,
    tx: tokio::sync::mpsc::Sender<Item>,
) {
    let _stop = w
        .agent_watch
        .map(|watch| StopOnDrop(Arc::downgrade(&st), c.id.clone(), watch));
    if tx
        .send(Item::Message(connect::message_frame(&json!({"start": {}}))))
        .await
        .is_err()
    {
        return;
    }
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(WATCH_POLL).await;
        if tx.is_closed() {
            return;
        }
        match st.api.engine.sandbox(&c.tenant, &c.id) {
            Ok(rec) if is_running(rec.tier) => {}
            Ok(_) => {
                let _ = tx
                    .send(Item::End(Some(RpcError::new(
                        Code::Unavailable,
                        "the sandbox was paused",
                    ))))
                    .await;
                return;
            }
            Err(e) => {
                let _ = tx.send(Item::End(Some(e.into()))).await;
                return;
            }
        }
        if let Err(e) = w.poll(&st, &c, Look::Background).await {
            let _ = tx.send(Item::End(Some(e))).await;
            return;
        }
        let events = w.drain();
        for ev in &events {
            if tx
                .send(Item::Message(connect::message_frame(
                    &json!({"filesystem": ev}),
                )))
                .await
                .is_err()
            {
                return;
            }
        }
        if !events.is_empty() {
            last = Instant::now();
        } else if last.elapsed() > Duration::from_secs(30) {
            if tx
                .send(Item::Message(connect::message_frame(
                    &json!({"keepalive": {}}),
                )))
                .await
                .is_err()
            {
                return;
            }
            last = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(kind: FileKind, size: u64, modified_ms: i64) -> Seen {
        Seen {
            dir: "/w".into(),
            entry: DirEntry {
                name: "x".into(),
                kind,
                size,
                mode: 0o644,
                modified_ms,
                uid: 1000,
                gid: 1000,
            },
        }
    }

    #[test]
    fn unpolled_watchers_expire_and_polled_ones_stay() {
        let t0 = Instant::now();
        let w = |polled| {
            Watcher::idle(
                SandboxId::new("sb-aaaaaaaaaaaaaaaa").unwrap(),
                TenantId::admin(),
                polled,
            )
        };
        let mut all: HashMap<String, Watcher> = [
            ("old".to_string(), w(t0)),
            ("new".to_string(), w(t0 + WATCHER_IDLE)),
        ]
        .into();
        assert_eq!(
            expire_at(&mut all, t0 + WATCHER_IDLE - Duration::from_millis(1)),
            0
        );
        assert_eq!(expire_at(&mut all, t0 + WATCHER_IDLE), 1);
        assert!(all.contains_key("new") && !all.contains_key("old"));
        assert_eq!(expire_at(&mut all, t0 + 2 * WATCHER_IDLE), 1);
        assert!(all.is_empty());
    }

    #[test]
    fn diffs_come_in_the_order_things_happened() {
        use EventType::*;
        let before: BTreeMap<_, _> = [
            ("x".to_string(), seen(FileKind::File, 1, 1)),
            ("gone".into(), seen(FileKind::File, 0, 0)),
            ("old".into(), seen(FileKind::Dir, 0, 0)),
            ("old/inner".into(), seen(FileKind::File, 0, 0)),
        ]
        .into();
        let after: BTreeMap<_, _> = [
            // written last
            ("x".to_string(), seen(FileKind::File, 2, 50)),
            // a folder made at 10, its file at 20, the folder's mtime moved by a later file
            ("d".into(), seen(FileKind::Dir, 0, 40)),
            ("d/a".into(), seen(FileKind::File, 3, 20)),
            ("d/b".into(), seen(FileKind::File, 0, 40)),
            // made first, though later in name order
            ("zz".into(), seen(FileKind::File, 0, 5)),
        ]
        .into();
        let got = diff(&before, &after);
        assert_eq!(
            got,
            vec![
                ("zz".to_string(), Create),
                ("d".into(), Create),
                ("d/a".into(), Create),
                ("d/a".into(), Write),
                ("d/b".into(), Create),
                ("x".into(), Write),
                ("old/inner".into(), Remove),
                ("old".into(), Remove),
                ("gone".into(), Remove),
            ]
        );
        assert!(diff(&after, &after).is_empty());
    }
}
