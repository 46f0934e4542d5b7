-- Schema 7: what each tenant holds of each worker's GPUs, as the newest report a controller
-- got (a GPU start's reply). Controllers take turns at a tenant's GPU starts (a lease) and
-- read these first, so that a start another controller just made counts before that worker's
-- next heartbeat reaches this one. `seq` orders one worker's reports (it grows across the
-- worker's restarts): an older report never replaces a newer one.
CREATE TABLE gpu_holdings (
    tenant TEXT NOT NULL,
    worker TEXT NOT NULL,
    seq BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    compute BIGINT NOT NULL,
    reported_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, worker)
);
