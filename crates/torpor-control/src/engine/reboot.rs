//! Filesystem-only pauses (E2B's `keep_memory=False`, `on_resume="reboot"`): the sandbox is
//! checkpointed whole as for any pause, and a marker in its directory says that its next wake,
//! by whatever path (connect, traffic to its ports, any call), reboots it: the agent kills every
//! other process, starts the template's main process again and writes a new boot id
//! ([`proto::Request::Reboot`]). Its files (rootfs overlay, /tmp, the home) are the image's.

use super::*;

/// The file in a sandbox's directory whose presence makes its next wake a reboot.
const REBOOT_MARKER: &str = "reboot-on-wake";

impl Engine {
    fn reboot_marker(&self, id: &SandboxId) -> PathBuf {
        self.sandbox_dir(id).join(REBOOT_MARKER)
    }

    /// Makes the next wake of a sandbox the tenant owns reboot its processes (`true`), or
    /// takes that back (`false`). A sandbox that is resident now is rebooted only when it wakes
    /// after its next sleep: the caller marks it and then suspends it.
    pub fn reboot_on_next_wake(&self, tenant: &TenantId, id: &SandboxId, on: bool) -> Result<()> {
        self.sandbox(tenant, id)?;
        let marker = self.reboot_marker(id);
        let result = if on {
            std::fs::create_dir_all(self.sandbox_dir(id))
                .and_then(|()| std::fs::write(&marker, b""))
        } else {
            match std::fs::remove_file(&marker) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        };
        result.map_err(|e| {
            tracing::error!(sandbox = %id, error = %e, "cannot mark the sandbox's next wake");
            ControlError::Unsupported(format!(
                "cannot record the filesystem-only pause of sandbox {id}"
            ))
        })?;
        tracing::info!(sandbox = %id, reboot = on, "next wake");
        Ok(())
    }

    /// Whether the next wake of a sandbox reboots it (its record, as the caller was allowed
    /// to read it: no store read here, so a listing pays one `stat` per paused sandbox).
    pub fn reboots_on_next_wake(&self, rec: &SandboxRecord) -> bool {
        self.reboot_marker(&rec.id).exists()
    }

    /// Called right after a wake, under the slot's lock (no call is in flight): reboots the
    /// sandbox if its last pause was without memory. The marker is used up either way. An
    /// agent older than [`proto::REBOOT_SINCE`] is not asked (it could not parse the request):
    /// the sandbox stays woken with its memory and the caller gets an error saying so.
    pub(super) async fn reboot_if_marked(
        &self,
        guard: &OwnedRwLockWriteGuard<SlotState>,
        id: &SandboxId,
    ) -> Result<()> {
        let marker = self.reboot_marker(id);
        if !marker.exists() {
            return Ok(());
        }
        let Some(live) = guard.live.as_ref() else {
            return Ok(());
        };
        let _ = std::fs::remove_file(&marker);
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
