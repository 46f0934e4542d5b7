//! Listing sandboxes a page at a time (`GET /v1/sandboxes?limit=&cursor=`): keyset pages of
//! the store, so a list costs the page, not the fleet.

use super::*;
use crate::store::SandboxCursor;

impl Engine {
    /// One page of the sandboxes `tenant` may see (the operator: every tenant's), in creation
    /// order: those after `after`, at most `limit`, of state or tier `state` when given.
    pub fn sandboxes_page(
        &self,
        tenant: &TenantId,
        state: Option<&str>,
        after: Option<&SandboxCursor>,
        limit: usize,
    ) -> Result<Vec<SandboxRecord>> {
        // Only what the caller owns, as `sandboxes` answers.
        let only = (*tenant != TenantId::admin()).then_some(tenant);
        let mut page = self.store.sandboxes_page(only, state, after, limit)?;
        for s in &mut page {
            self.fresh_activity(s);
        }
        Ok(page)
    }
}
