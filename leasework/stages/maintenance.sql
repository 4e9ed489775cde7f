-- The maintenance stage: self-throttled housekeeping. Each handler has a durable marker row
-- (leasework.maintenance); reading the markers is the whole cost of a poll in which nothing is
-- due, and claim_maintenance lets exactly one worker win each period.

-- name: read_markers
SELECT handler, last_run_at, backlog, leasework.now() AS now FROM leasework.maintenance

-- name: claim_maintenance
-- Atomic: concurrent claimers queue on the marker row, and each re-checks the WHERE against
-- the version the winner wrote, so only the first gets a row back.
INSERT INTO leasework.maintenance AS m (handler, last_run_at, runs)
VALUES (%(handler)s, leasework.now(), 1)
ON CONFLICT (handler) DO UPDATE
   SET last_run_at = leasework.now(), backlog = false, runs = m.runs + 1
 WHERE m.backlog OR m.last_run_at <= leasework.now() - make_interval(secs => %(period)s)
RETURNING runs

-- name: record_maintenance
-- backlog: the handler stopped at its bound with work left, so it is due again next poll.
UPDATE leasework.maintenance
   SET backlog = %(backlog)s, last_result = %(result)s
 WHERE handler = %(handler)s

-- name: prune_runs
-- Finished runs past the retention of their status, oldest first, at most %(limit)s.
WITH doomed AS MATERIALIZED (
    SELECT id
      FROM leasework.runs
     WHERE finished_at IS NOT NULL
       AND finished_at < leasework.now() - make_interval(secs => %(shortest)s)
       AND finished_at < leasework.now() - make_interval(secs => CASE status
               WHEN 'succeeded' THEN %(succeeded)s
               WHEN 'partial' THEN %(partial)s
               WHEN 'failed' THEN %(failed)s
               WHEN 'cancelled' THEN %(cancelled)s
           END::float8)
     ORDER BY finished_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM leasework.runs r USING doomed WHERE r.id = doomed.id
RETURNING r.id

-- name: prune_workers
-- Rows of workers that stopped, or fell silent, longer ago than the retention.
WITH doomed AS MATERIALIZED (
    SELECT id
      FROM leasework.workers
     WHERE coalesce(stopped_at, heartbeat_at) < leasework.now() - make_interval(secs => %(retention)s)
     ORDER BY coalesce(stopped_at, heartbeat_at)
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM leasework.workers w USING doomed WHERE w.id = doomed.id
RETURNING w.id

