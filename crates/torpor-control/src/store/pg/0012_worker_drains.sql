-- Schema 12: workers the operator drained. A drain through one controller is kept here, so
-- every controller (each reads the table once a second) and a controller that starts later
-- sends the worker no new sandboxes; the row goes when the drain is lifted. `since` is the
-- server's clock at the drain.
CREATE TABLE worker_drains (
    worker TEXT PRIMARY KEY,
    since TIMESTAMPTZ NOT NULL DEFAULT now()
);
