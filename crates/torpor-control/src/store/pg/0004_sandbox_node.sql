-- Schema 4: the worker a resident sandbox's container runs on, written when a container is
-- installed (a plain write, like metadata: no version bump). A restarted controller takes back
-- only the containers a worker announces where its records put them.
ALTER TABLE sandboxes ADD COLUMN node TEXT;
