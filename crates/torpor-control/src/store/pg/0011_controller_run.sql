-- Schema 11: which run of a controller holds its name. Two processes with one controller name
-- (two replicas given one certificate) would both hold every sandbox the name holds and end
-- each other's containers on the workers; a controller claims its row with a random run id and
-- may take it only from itself, from a row that expired, or, at its start, from a previous run
-- that advertised the same addresses (itself, restarted). A controller that finds its name
-- held by another live run refuses to start; one that loses its row while it runs stops.
ALTER TABLE controllers ADD COLUMN run_id TEXT;
