-- Schema 2: several controllers on one database.
-- The controller holding a sandbox (runs its transitions, holds its container's connection);
-- NULL while it sleeps. Written with the state, by compare-and-set on `version`.
ALTER TABLE sandboxes ADD COLUMN controller TEXT;
-- Live controllers: each renews its row while it runs; a row past `expires_at` is a dead
-- controller, whose sandboxes another controller takes over. Times are the server's clock.
CREATE TABLE controllers (
    name TEXT PRIMARY KEY,
    api_addr TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
-- Leases: work one controller does for the cluster (pools and triggers), renewed by its
-- holder, taken over by another once expired.
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX sandboxes_controller ON sandboxes (controller) WHERE controller IS NOT NULL;
