-- Schema 1 of the PostgreSQL state store: the tables of the SQLite store's schema 3, with the
-- same names, keys and column meanings. Nested records (limits, specs, images, GPU records)
-- are JSON text, as in SQLite; `env` holds the sealed env (crate::secrets).
CREATE TABLE templates (
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    rootfs TEXT NOT NULL,
    mounts TEXT NOT NULL,
    agent_dir TEXT NOT NULL,
    golden_dir TEXT NOT NULL,
    golden_bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    template TEXT NOT NULL,
    state TEXT NOT NULL,
    tier TEXT NOT NULL,
    limits TEXT NOT NULL,
    env TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    last_active_at BIGINT NOT NULL,
    generation BIGINT NOT NULL,
    image TEXT NOT NULL,
    last_error TEXT,
    oom_killed BOOLEAN NOT NULL DEFAULT FALSE,
    -- Bumped by every write of the row: compare-and-set writes only over the version it read.
    version BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX sandboxes_tenant ON sandboxes (tenant);
CREATE INDEX sandboxes_template ON sandboxes (template);
CREATE INDEX sandboxes_created ON sandboxes (created_at, id);
CREATE TABLE sandbox_network (
    id TEXT PRIMARY KEY,
    policy TEXT NOT NULL
);
CREATE TABLE tenants (
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE snapshot_bytes (
    snapshot TEXT PRIMARY KEY,
    bytes BIGINT NOT NULL
);
CREATE TABLE pools (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE gpu_shares (
    sandbox TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE gpu_requests (
    sandbox TEXT PRIMARY KEY,
    request TEXT NOT NULL
);
CREATE TABLE gpu_toggled (
    sandbox TEXT PRIMARY KEY,
    toggled TEXT NOT NULL
);
CREATE TABLE usage_intervals (
    start_s BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    measure TEXT NOT NULL,
    dim TEXT NOT NULL,
    value DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (start_s, tenant, sandbox, measure, dim)
);
CREATE INDEX usage_by_tenant ON usage_intervals (tenant, start_s);
