-- Schema 10: rate limits across controllers. Every controller appends, a few times a second,
-- how many requests it let through per (tenant, route class) since its last report; every
-- other controller reads the reports of the last seconds (once each, by id) and takes as many
-- tokens from its own bucket, so a tenant's rate holds across the controllers it calls.
-- Reports older than a minute are removed by any controller.
CREATE TABLE rate_usage (
    id BIGSERIAL PRIMARY KEY,
    controller TEXT NOT NULL,
    tenant TEXT NOT NULL,
    class TEXT NOT NULL,
    count BIGINT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX rate_usage_at ON rate_usage (at);
