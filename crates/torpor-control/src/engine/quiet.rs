//! Calls that neither wake a sandbox nor count as its activity, for background samplers
//! (E2B's metrics, a watch's events): they reach a sandbox only while it is resident, running
//! and not in a transition, and cost a sleeping one nothing.

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
        let slot = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            match slots.get(id) {
                Some(slot) => slot.clone(),
                None => return Ok(None),
            }
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
        Ok(live.resident.call(req, body).await.ok())
    }
}
