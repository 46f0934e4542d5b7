//! Marks for a sandbox's next wake, kept in its metadata under [`Engine::WAKE_PREFIX`] (so in
//! the state store: a wake on any node of a cluster sees them, as it sees the image) and used
//! up by that wake:
//!
//! - the filesystem-only pause (E2B's `keep_memory=False`, `on_resume="reboot"`): the sandbox
//!   is checkpointed whole as for any pause, and its next wake, by whatever path (connect,
//!   traffic to its ports, any call), reboots it: the agent kills every other process, starts
//!   the template's main process again and writes a new boot id ([`proto::Request::Reboot`]).
//!   Its files (rootfs overlay, /tmp, the home) are the image's;
//! - a metadata patch for the wake ([`Engine::wake_unset_key`], [`Engine::wake_deadline_key`]):
//!   what a layer above (E2B's "paused" mark and deadline) says a sandbox that is running
//!   again must look like, whichever call woke it.
//!
//! The prefix is reserved: a tenant can neither set such a key (create refuses it) nor read it
//! (the API answers [`Engine::public_metadata`]). So is the E2B adapter's ([`Engine::E2B_PREFIX`]:
//! its deadline, its pause mark, its snapshots' names), which the adapter alone writes, through
//! [`Engine::patch_sandbox_metadata`], a call no tenant route reaches: a tenant that could set
//! them at create would forge E2B's state (a paused mark, a deadline, a snapshot holder).
//!
//! A fork ([`Engine::fork`]) inherits no mark (`forked_metadata`): it starts from its
//! source's memory, so the source's pending reboot is not its own, and the rest of the wake's
//! patch (E2B's "no longer paused", a deadline from now) is applied at once, as for a sandbox
//! woken from that image: a fork was never paused through E2B.

use super::*;

/// The key whose presence makes the next wake a reboot.
const REBOOT_KEY: &str = "torpor.wake.reboot";
/// `torpor.wake.unset.<key>`: the wake removes `<key>`.
const UNSET_PREFIX: &str = "torpor.wake.unset.";
/// `torpor.wake.in_ms.<key>` = `N`: the wake sets `<key>` to the wake's time (Unix ms) plus
/// `N`, unless `<key>` was set since.
const DEADLINE_PREFIX: &str = "torpor.wake.in_ms.";

impl Engine {
    /// The metadata keys the engine keeps for a sandbox's next wake; reserved.
    pub const WAKE_PREFIX: &'static str = "torpor.wake.";
    /// The metadata keys the E2B adapter keeps for a sandbox's E2B lifecycle; reserved.
    pub const E2B_PREFIX: &'static str = "torpor.e2b.";
    /// E2B's traffic access: `public`, or the token a host-routed request must carry. A
    /// credential of one sandbox: a fork never inherits a token (see [`forked_metadata`]).
    pub const E2B_TRAFFIC_KEY: &'static str = "torpor.e2b.traffic";

    /// Whether a metadata key is reserved to the engine or the E2B adapter (no tenant sets or
    /// reads it).
    pub fn is_reserved_metadata(key: &str) -> bool {
        key.starts_with(Self::WAKE_PREFIX) || key.starts_with(Self::E2B_PREFIX)
    }

    /// A sandbox's metadata as its tenant sees it: without the reserved keys.
    pub fn public_metadata(metadata: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        metadata
            .iter()
            .filter(|(k, _)| !Self::is_reserved_metadata(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The key that makes the next wake remove `key` from the metadata.
    pub fn wake_unset_key(key: &str) -> String {
        format!("{UNSET_PREFIX}{key}")
    }

    /// The key whose value `N` (ms) makes the next wake set `key` to its time plus `N`, unless
    /// `key` was set again before the wake.
    pub fn wake_deadline_key(key: &str) -> String {
        format!("{DEADLINE_PREFIX}{key}")
    }

    /// Makes the next wake of a sandbox the tenant owns reboot its processes (`true`), or
    /// takes that back (`false`). A sandbox that is resident now is rebooted only when it wakes
    /// after its next sleep: the caller marks it and then suspends it.
    pub fn reboot_on_next_wake(&self, tenant: &TenantId, id: &SandboxId, on: bool) -> Result<()> {
        let rec = self.sandbox(tenant, id)?;
        if rec.metadata.contains_key(REBOOT_KEY) == on {
            return Ok(());
        }
        let mut metadata = rec.metadata;
        if on {
            metadata.insert(REBOOT_KEY.into(), "1".into());
        } else {
            metadata.remove(REBOOT_KEY);
        }
        self.store
            .set_sandbox_metadata(id, &metadata)
            .map_err(|e| {
                tracing::error!(sandbox = %id, error = %e, "cannot mark the sandbox's next wake");
                ControlError::Unsupported(format!(
                    "cannot record the filesystem-only pause of sandbox {id}"
                ))
            })?;
        tracing::info!(sandbox = %id, reboot = on, "next wake");
        Ok(())
    }

    /// Whether the next wake of a sandbox reboots it (its record, as the caller was allowed
    /// to read it: no store read here).
    pub fn reboots_on_next_wake(&self, rec: &SandboxRecord) -> bool {
        rec.metadata.contains_key(REBOOT_KEY)
    }

    /// Called right after a wake, under the slot's lock (no call is in flight): applies the
    /// wake's metadata patch and reboots the sandbox if its last pause was without memory.
    /// The marks are used up either way. An agent older than [`proto::REBOOT_SINCE`] is not
    /// asked (it could not parse the request): the sandbox stays woken with its memory and the
    /// caller gets an error saying so.
    pub(super) async fn reboot_if_marked(
        &self,
        guard: &OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
    ) -> Result<()> {
        let Some(live) = guard.live.as_ref() else {
            return Ok(());
        };
        let Some(rec) = self.store.sandbox(id)? else {
            return Ok(());
        };
        let Some((metadata, reboot)) = woken_metadata(&rec.metadata, now_millis()) else {
            return Ok(());
        };
        self.store.set_sandbox_metadata(id, &metadata)?;
        if !reboot {
            return Ok(());
        }
        let version = live.resident.agent_version();
        if version < proto::REBOOT_SINCE {
            tracing::warn!(sandbox = %id, version, "agent predates reboots; woken with its memory");
            return Err(ControlError::Unsupported(format!(
                "sandbox {id} was resumed with its memory, not rebooted: its agent (protocol \
                 {version}) predates reboots (it was restored from an older torpor's snapshot)"
            )));
        }
        let t = Instant::now();
        match live.resident.call(&Request::Reboot, &[]).await {
            Ok((Reply::Main { pid, .. }, _)) => {
                tracing::info!(sandbox = %id, main_pid = ?pid, ms = t.elapsed().as_millis() as u64, "rebooted after a filesystem-only pause");
                Ok(())
            }
            Ok((Reply::Error { code, message }, _)) => {
                tracing::warn!(sandbox = %id, ?code, %message, "reboot failed");
                Err(ControlError::Agent { code, message })
            }
            Ok((other, _)) => {
                tracing::warn!(sandbox = %id, reply = ?other, "unexpected reply to a reboot");
                Err(ControlError::Unsupported(format!(
                    "sandbox {id}'s agent did not reboot it"
                )))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Create refuses the reserved keys (wired into the engine's metadata check): 400
/// `invalid_request`, as any invalid metadata.
pub(super) fn check_reserved(m: &BTreeMap<String, String>) -> Result<()> {
    if let Some(key) = m.keys().find(|k| Engine::is_reserved_metadata(k)) {
        return Err(ControlError::Invalid(format!(
            "metadata key {key:?} is reserved: keys starting with {:?} or {:?} are torpor's own",
            Engine::WAKE_PREFIX,
            Engine::E2B_PREFIX
        )));
    }
    Ok(())
}

/// A fork's metadata, made at `now` from its source's: no mark of the source's next wake. The
/// reboot is dropped (the fork runs on from the source's memory); the rest of the wake's patch
/// is applied now, so a fork of a sandbox paused through E2B is not paused to E2B and has a
/// deadline of its timeout from now, as if woken. A private E2B traffic token is the source's
/// credential and is not copied: without one, host-routed traffic to the fork needs its
/// tenant's token (E2B's own fork gives the fork a token of its own).
pub(super) fn forked_metadata(
    metadata: &BTreeMap<String, String>,
    now: i64,
) -> BTreeMap<String, String> {
    let mut out = match woken_metadata(metadata, now) {
        Some((metadata, _reboot)) => metadata,
        None => metadata.clone(),
    };
    if out
        .get(Engine::E2B_TRAFFIC_KEY)
        .is_some_and(|t| t != "public")
    {
        out.remove(Engine::E2B_TRAFFIC_KEY);
    }
    out
}

/// The metadata after a wake at `now` (ms) and whether the wake reboots; `None` when the
/// metadata holds no mark for the wake (nothing to write).
fn woken_metadata(
    metadata: &BTreeMap<String, String>,
    now: i64,
) -> Option<(BTreeMap<String, String>, bool)> {
    let marks: Vec<(String, String)> = metadata
        .range(Engine::WAKE_PREFIX.to_string()..)
        .take_while(|(k, _)| k.starts_with(Engine::WAKE_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if marks.is_empty() {
        return None;
    }
    let mut out = metadata.clone();
    let mut reboot = false;
    for (k, _) in &marks {
        out.remove(k);
    }
    for (k, v) in &marks {
        if k == REBOOT_KEY {
            reboot = true;
        } else if let Some(key) = k.strip_prefix(UNSET_PREFIX) {
            out.remove(key);
        } else if let Some(key) = k.strip_prefix(DEADLINE_PREFIX) {
            if let (false, Ok(ms)) = (out.contains_key(key), v.parse::<i64>()) {
                out.insert(key.to_string(), now.saturating_add(ms).to_string());
            }
        }
    }
    Some((out, reboot))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_wake_uses_up_its_marks_and_applies_its_patch() {
        let paused = "torpor.e2b.paused";
        let end = "torpor.e2b.end_at";
        let m = meta(&[
            ("app", "x"),
            (paused, "pause"),
            (REBOOT_KEY, "1"),
            (&Engine::wake_unset_key(paused), ""),
            (&Engine::wake_deadline_key(end), "300000"),
        ]);
        let (after, reboot) = woken_metadata(&m, 1_000).unwrap();
        assert!(reboot);
        assert_eq!(after, meta(&[("app", "x"), (end, "301000")]));
        // A deadline set before the wake (E2B's connect) wins.
        let m = meta(&[(end, "5"), (&Engine::wake_deadline_key(end), "300000")]);
        assert_eq!(
            woken_metadata(&m, 1_000).unwrap(),
            (meta(&[(end, "5")]), false)
        );
        // Nothing marked: nothing to write.
        assert_eq!(
            woken_metadata(&meta(&[("torpor.wakefulness", "1")]), 1),
            None
        );
    }

    #[test]
    fn tenants_cannot_set_or_see_the_marks() {
        let m = meta(&[("a", "1"), (REBOOT_KEY, "1")]);
        assert!(check_reserved(&m).is_err());
        assert!(check_reserved(&meta(&[("torpor.wakeful", "1")])).is_ok());
        assert_eq!(Engine::public_metadata(&m), meta(&[("a", "1")]));
    }

    #[test]
    fn tenants_cannot_set_or_see_e2bs_keys() {
        for key in [
            "torpor.e2b.paused",
            "torpor.e2b.end_at",
            "torpor.e2b.snapshot_of",
        ] {
            let m = meta(&[("a", "1"), (key, "1")]);
            let err = check_reserved(&m).unwrap_err();
            assert!(
                matches!(&err, ControlError::Invalid(msg) if msg.contains(key)),
                "{err:?}"
            );
            assert_eq!(Engine::public_metadata(&m), meta(&[("a", "1")]));
        }
        assert!(check_reserved(&meta(&[("torpor.e2bx", "1"), ("e2b.paused", "1")])).is_ok());
    }

    #[test]
    fn a_fork_inherits_no_mark_of_its_sources_wake() {
        let paused = "torpor.e2b.paused";
        let end = "torpor.e2b.end_at";
        // A source paused through E2B without memory: the fork does not reboot, is not
        // paused, and has a deadline from its making.
        let source = meta(&[
            ("app", "x"),
            (paused, "pause"),
            (REBOOT_KEY, "1"),
            (&Engine::wake_unset_key(paused), ""),
            (&Engine::wake_deadline_key(end), "300000"),
        ]);
        assert_eq!(
            forked_metadata(&source, 1_000),
            meta(&[("app", "x"), (end, "301000")])
        );
        // Only a reboot pending: dropped.
        assert_eq!(
            forked_metadata(&meta(&[("app", "x"), (REBOOT_KEY, "1")]), 1),
            meta(&[("app", "x")])
        );
        // No mark: copied as it is.
        let plain = meta(&[("app", "x"), (end, "5")]);
        assert_eq!(forked_metadata(&plain, 1), plain);
        // Public traffic stays public; a private token is the source's alone.
        let public = meta(&[("app", "x"), (Engine::E2B_TRAFFIC_KEY, "public")]);
        assert_eq!(forked_metadata(&public, 1), public);
        assert_eq!(
            forked_metadata(&meta(&[("app", "x"), (Engine::E2B_TRAFFIC_KEY, "f00d")]), 1),
            meta(&[("app", "x")])
        );
    }
}
