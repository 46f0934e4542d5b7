-- Schema 5: E2B metric samples (CPU, memory, disk) of each sandbox, kept an hour, so that any
-- controller answers `get_metrics` and a restart keeps the series.
CREATE TABLE metric_samples (
    sandbox TEXT NOT NULL,
    ts_ms BIGINT NOT NULL,
    sample TEXT NOT NULL,
    PRIMARY KEY (sandbox, ts_ms)
);
CREATE INDEX metric_samples_ts ON metric_samples(ts_ms);
