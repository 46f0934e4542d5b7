-- Schema 13: the calls a second each controller's sandboxes take (the agent calls, execs, file
-- and proxied requests it serves for the sandboxes it holds), renewed with its row. Controllers
-- balance their holds by it. NULL: a controller that does not say (built before it, or not
-- balancing); while any live one says nothing, the others weigh busy sandboxes instead.
ALTER TABLE controllers ADD COLUMN call_rate DOUBLE PRECISION;
