-- Schema 8: wake tickets a controller asked a worker to drop and could not (the worker was
-- unreachable then). Any controller asks again (at its start, then every minute) until the
-- worker answers or an hour has passed, so a controller restart does not leave the ticket
-- behind. `since` is the server's clock at the first failure.
CREATE TABLE gpu_ticket_forgets (
    worker TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    since TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (worker, sandbox)
);
