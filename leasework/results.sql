-- Queries of a wait for a run's end (results.py), on the caller's connection, in autocommit.

-- name: run_outcome
-- leasework.run_outcome (schema.sql): the run's status, result and error; with %(watch)s a live
-- run is first marked so that its end NOTIFYs `leasework_ended` (the waiter LISTENs before).
-- `watched`: the run is marked (false when another session held its row: read again later).
-- No row: no such run.
SELECT status, result::text, error, watched
  FROM leasework.run_outcome(%(id)s::bigint, %(watch)s::boolean)
