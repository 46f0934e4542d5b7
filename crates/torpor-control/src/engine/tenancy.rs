//! Tenants and their bearer tokens (only hashes are kept).

use super::*;

impl Engine {
    /// Creates a tenant and returns it with its bearer token (shown once; only a hash is kept).
    pub fn create_tenant(&self, id: TenantId, quotas: Quotas) -> Result<(TenantRecord, String)> {
        if id == TenantId::admin() {
            return Err(ControlError::AlreadyExists {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        let token = format!("tpr_{id}_{secret}");
        let rec = TenantRecord {
            id: id.clone(),
            created_at: now_millis(),
            quotas,
        };
        if !self.store.insert_tenant(&rec, &token_hash(&token))? {
            return Err(ControlError::AlreadyExists {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        Ok((rec, token))
    }

    pub fn tenants(&self) -> Result<Vec<TenantRecord>> {
        Ok(self.store.tenants()?)
    }

    /// Deletes a tenant that owns nothing any more.
    pub fn delete_tenant(&self, id: &TenantId) -> Result<()> {
        let usage = self.store.usage(id)?;
        if usage.sandboxes > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{} sandboxes", usage.sandboxes),
            ));
        }
        let templates = self
            .store
            .templates()?
            .into_iter()
            .filter(|t| t.tenant == *id)
            .count();
        if templates > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{templates} templates"),
            ));
        }
        let pools = self.store.count_pools(id)?;
        if pools > 0 {
            return Err(ControlError::TenantInUse(
                id.to_string(),
                format!("{pools} pools"),
            ));
        }
        if !self.store.delete_tenant(id)? {
            return Err(ControlError::NotFound {
                kind: "tenant",
                id: id.to_string(),
            });
        }
        Ok(())
    }

    /// The tenant a (non-admin) bearer token belongs to.
    pub fn tenant_for_token(&self, token: &str) -> Result<Option<TenantId>> {
        Ok(self.store.tenant_by_token_hash(&token_hash(token))?)
    }
}

/// Tokens are kept only as hashes.
pub(super) fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}
