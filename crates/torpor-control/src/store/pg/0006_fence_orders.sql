-- Schema 6: fence orders. A controller that counts a worker lost writes one per container it
-- held there; a controller that still hears the worker hands them over in its heartbeat
-- replies (`relayed`), and removes them once the worker says the containers are gone. Times
-- are the server's clock.
CREATE TABLE fence_orders (
    worker TEXT NOT NULL,
    container TEXT NOT NULL,
    owner TEXT NOT NULL,
    ordered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    relayed BOOLEAN NOT NULL DEFAULT false,
    PRIMARY KEY (worker, container)
);
