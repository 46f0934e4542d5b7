//! Calls that never wake a sandbox: they reach it only while it is resident, running and not
//! in a transition, and cost a sleeping one nothing. Background samplers (E2B's metrics, a
//! watch stream's events) do not count as its activity either; a client's poll of state that
//! cannot change while the sandbox sleeps (E2B's `GetWatcherEvents`) does, as any call, while
//! it runs.

use super::*;

impl Engine {
    /// Runs `req` (not streamed) in sandbox `id` if it is resident and running and no
    /// transition holds it right now; `Ok(None)` otherwise (asleep, frozen, mid-transition:
    /// nothing is waited for, woken or read from the store). The call is not activity: the
    /// idle policy sees the sandbox as idle as before it, and nothing waiting for a worker is
    /// poked. For background samplers (E2B's metrics), which must cost a sleeping sandbox
    /// nothing and must not keep a running one awake.
    pub async fn quiet_exec_if_running(
        &self,
        id: &SandboxId,
        req: ExecRequest,
    ) -> Result<Option<ExecResult>> {
        let (timeout_ms, detach) = (req.timeout_ms, req.detach);
        let req = Request::Exec(ExecRequest {
            stream: false,
            ..req
        });
        match self.quiet_call_if_running(id, &req, &[]).await? {
            Some((reply, body)) => {
                super::calls::exec_reply(reply, body, timeout_ms, detach).map(Some)
            }
            None => Ok(None),
        }
    }

    /// [`Engine::quiet_exec_if_running`] for any one-reply request (a watch's events): the
    /// agent's reply, `Ok(None)` when the sandbox is not resident and running right now or its
    /// agent went away (the crash watch records that).
    pub async fn quiet_call_if_running(
        &self,
        id: &SandboxId,
        req: &Request,
        body: &[u8],
    ) -> Result<Option<(Reply, Vec<u8>)>> {
        self.call_if_resident(id, req, body, false).await
    }

    /// [`Engine::quiet_call_if_running`] for a client's poll (E2B's `GetWatcherEvents`): the
    /// call counts as the sandbox's activity, as any call of its tenant does, so a polled
    /// sandbox stays awake; a sleeping one (frozen, parked, suspended, mid-transition) is not
    /// woken, and the answer is `Ok(None)`. The caller has authorised the call for `id`.
    pub async fn call_if_running(
        &self,
        id: &SandboxId,
        req: &Request,
        body: &[u8],
    ) -> Result<Option<(Reply, Vec<u8>)>> {
        self.call_if_resident(id, req, body, true).await
    }

    /// Whether sandbox `id` is resident and running right now (not frozen, no transition
    /// holding it): a look, from memory, that waits for nothing and wakes nothing.
    pub fn is_running_now(&self, id: &SandboxId) -> bool {
        let Some(slot) = self.existing_slot(id) else {
            return false;
        };
        slot.state.clone().try_read_owned().is_ok_and(|guard| {
            guard
                .live
                .as_ref()
                .is_some_and(|l| !l.frozen && l.resident.alive())
        })
    }

    /// The slot of `id` if it has one (unlike [`Engine::slot`], none is made).
    pub(super) fn existing_slot(&self, id: &SandboxId) -> Option<Arc<Slot>> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.get(id).cloned()
    }

    /// The call of [`Engine::quiet_call_if_running`] (`activity`: false) and
    /// [`Engine::call_if_running`] (true).
    async fn call_if_resident(
        &self,
        id: &SandboxId,
        req: &Request,
        body: &[u8],
        activity: bool,
    ) -> Result<Option<(Reply, Vec<u8>)>> {
        let Some(slot) = self.existing_slot(id) else {
            return Ok(None);
        };
        let Ok(guard) = slot.state.clone().try_read_owned() else {
            return Ok(None);
        };
        let Some(live) = guard
            .live
            .as_ref()
            .filter(|l| !l.frozen && l.resident.alive())
        else {
            return Ok(None);
        };
        if activity {
            slot.touch();
        }
        Ok(live.resident.call(req, body).await.ok())
    }
}
