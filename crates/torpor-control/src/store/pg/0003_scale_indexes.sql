-- Schema 3: indexes for a database of 10^6 sandboxes (docs/BENCHMARKS.md, "PostgreSQL state at
-- 10^6 sandboxes").
-- The idle policy reads only the sandboxes that are awake (a few thousand at most) and the
-- Parked ones due for the snapshot store, never the sleeping million.
CREATE INDEX sandboxes_awake ON sandboxes (created_at, id)
    WHERE state NOT IN ('parked', 'suspended');
CREATE INDEX sandboxes_parked_by_age ON sandboxes (last_active_at) WHERE state = 'parked';
-- A tenant's count of sandboxes of one template (template delete, quota checks): an index-only
-- scan instead of a million-row filter. It covers what `sandboxes_template` did.
CREATE INDEX sandboxes_template_tenant ON sandboxes (template, tenant);
DROP INDEX sandboxes_template;
-- A tenant's list, in creation order.
CREATE INDEX sandboxes_tenant_created ON sandboxes (tenant, created_at, id);
DROP INDEX sandboxes_tenant;
