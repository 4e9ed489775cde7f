-- The workers table: one row per process start, heartbeat every heartbeat_interval.

-- name: upsert_worker
INSERT INTO leasework.workers (id, host, pid, started_at, heartbeat_at, current_run)
VALUES (%(id)s, %(host)s, %(pid)s, leasework.now(), leasework.now(), %(current_run)s)
ON CONFLICT (id) DO UPDATE
   SET heartbeat_at = leasework.now(), current_run = EXCLUDED.current_run, stopped_at = NULL

-- name: stop_worker
UPDATE leasework.workers
   SET stopped_at = leasework.now(), heartbeat_at = leasework.now(), current_run = NULL
 WHERE id = %(id)s

-- name: remove_worker
-- A clean exit (a standalone worker stopping, `worker --once`): its row goes, rather than
-- showing a "gone" worker until maintenance prunes it.
DELETE FROM leasework.workers WHERE id = %(id)s
