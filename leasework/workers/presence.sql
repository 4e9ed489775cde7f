-- The workers table: one row per process start, heartbeat every heartbeat_interval.

-- name: upsert_worker
-- pool / pool_kinds: the worker's pool (config `pools`) and its kinds; NULL kinds with a pool is
-- the pool that takes every kind no other pool of its host names; NULL pool: every kind.
INSERT INTO leasework.workers (id, host, pid, started_at, heartbeat_at, current_run, pool,
                               pool_kinds)
VALUES (%(id)s, %(host)s, %(pid)s, leasework.now(), leasework.now(), %(current_run)s,
        %(pool)s::text, %(pool_kinds)s::text[])
ON CONFLICT (id) DO UPDATE
   SET heartbeat_at = leasework.now(), current_run = EXCLUDED.current_run, stopped_at = NULL,
       pool = EXCLUDED.pool, pool_kinds = EXCLUDED.pool_kinds

-- name: stop_worker
UPDATE leasework.workers
   SET stopped_at = leasework.now(), heartbeat_at = leasework.now(), current_run = NULL
 WHERE id = %(id)s

-- name: remove_worker
-- A clean exit (a standalone worker stopping, `worker --once`): its row goes, rather than
-- showing a "gone" worker until maintenance prunes it.
DELETE FROM leasework.workers WHERE id = %(id)s
