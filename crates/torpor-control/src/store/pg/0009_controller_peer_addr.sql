-- Schema 9: where the other controllers reach this one's peer listener (HTTP/2 over mutual
-- TLS, controller certificates only) to forward calls for the sandboxes it holds. NULL for a
-- controller built before the peer listener: during a rolling upgrade the others forward to it
-- over plain HTTP at `api_addr`, as before.
ALTER TABLE controllers ADD COLUMN peer_addr TEXT;
