-- Connections, their synced records, and the sync and purge runs' effects (stages/sync.py).
-- None of these writes lease columns: effects run inside ctx.transaction(), which first fences
-- the run (lease.fence_run), so a stale worker's write never commits.

-- name: insert_connection
INSERT INTO leasework.connections (workspace, provider, config, sync_interval_seconds, next_run_at)
VALUES (%(workspace)s, %(provider)s, %(config)s, %(every)s,
        CASE WHEN %(every)s::float8 IS NULL THEN NULL
             ELSE leasework.now() + make_interval(secs => %(every)s::float8) END)
RETURNING id

-- name: get_connection
SELECT id, workspace, provider, status, config, sync_interval_seconds, next_run_at, created_at
  FROM leasework.connections
 WHERE id = %(id)s

-- name: lock_connection
-- FOR NO KEY UPDATE, not FOR UPDATE: it serializes status changes of one connection without
-- waiting on a sync's publish, whose record inserts hold a KEY SHARE lock on the row (the FK).
SELECT id, workspace, provider, status, config, sync_interval_seconds, next_run_at, created_at
  FROM leasework.connections
 WHERE id = %(id)s
   FOR NO KEY UPDATE

-- name: set_connection_status
-- A connection that is not active has no schedule.
UPDATE leasework.connections
   SET status = %(status)s,
       next_run_at = CASE WHEN %(status)s = 'active' AND sync_interval_seconds IS NOT NULL
                          THEN leasework.now() + make_interval(secs => sync_interval_seconds) END
 WHERE id = %(id)s
RETURNING status

-- name: list_connections
SELECT c.id, c.workspace, c.provider, c.status, c.config, c.sync_interval_seconds,
       c.next_run_at, c.created_at,
       (SELECT count(*) FROM leasework.records r
         WHERE r.connection_id = c.id AND r.deleted_at IS NULL) AS live_records,
       (SELECT count(*) FROM leasework.records r
         WHERE r.connection_id = c.id AND r.deleted_at IS NOT NULL) AS tombstoned_records
  FROM leasework.connections c
 ORDER BY c.id
 LIMIT %(limit)s

-- name: cancel_queued_syncs
-- Disconnect and delete cancel a sync that has not started yet: nothing to drain, so the purge
-- need not wait out its backoff. A running sync is left to finish (the purge drains behind it).
-- Same shape as runs.sql's cancel_run for a queued run; a queued run holds no lease.
UPDATE leasework.runs
   SET status = 'cancelled',
       finished_at = leasework.now(),
       error = %(why)s::text,
       cancel_requested_at = coalesce(cancel_requested_at, leasework.now())
 WHERE key = %(key)s AND kind = 'sync' AND status = 'queued'
RETURNING id

-- name: find_purge
SELECT id
  FROM leasework.runs
 WHERE key = %(key)s AND kind = 'purge' AND status IN ('waiting', 'queued', 'running')
 ORDER BY id DESC
 LIMIT 1

-- name: upsert_records
-- One bounded batch of one table: %(rows)s is a JSON array of {"id": ..., "data": ...}. A row
-- seen again is live again (deleted_at NULL) and stamped with this attempt's token.
INSERT INTO leasework.records AS r
       (connection_id, table_name, external_id, data, first_seen_at, synced_at, synced_by)
SELECT %(connection_id)s, %(table)s, e ->> 'id', e -> 'data', leasework.now(), leasework.now(),
       %(token)s
  FROM jsonb_array_elements(%(rows)s::jsonb) AS e
ON CONFLICT (connection_id, table_name, external_id) DO UPDATE
   SET data = EXCLUDED.data,
       synced_at = EXCLUDED.synced_at,
       synced_by = EXCLUDED.synced_by,
       deleted_at = NULL

-- name: tombstone_unseen
-- A table read to the end: tombstone (a bounded batch of) its live rows this attempt did not
-- see. The caller repeats until fewer than %(limit)s rows come back.
WITH gone AS MATERIALIZED (
    SELECT id
      FROM leasework.records
     WHERE connection_id = %(connection_id)s
       AND table_name = %(table)s
       AND deleted_at IS NULL
       AND synced_by IS DISTINCT FROM %(token)s
     LIMIT %(limit)s
       FOR UPDATE
)
UPDATE leasework.records r
   SET deleted_at = leasework.now()
  FROM gone
 WHERE r.id = gone.id

-- name: purge_records
-- One bounded batch of a deleting connection's records.
WITH doomed AS MATERIALIZED (
    SELECT id
      FROM leasework.records
     WHERE connection_id = %(connection_id)s
     LIMIT %(limit)s
       FOR UPDATE
)
DELETE FROM leasework.records r
 USING doomed
 WHERE r.id = doomed.id

-- name: delete_connection_row
-- The purge's last step. Only a connection still `deleting`; the FK refuses it while any record
-- is left, so a purge can never strand records.
DELETE FROM leasework.connections
 WHERE id = %(id)s AND status = 'deleting'
RETURNING id

-- name: live_tables
-- The tables of a connection that still have live records (for connectors that yield every
-- table: one missing from the extraction was removed upstream). Walks records_identity.
SELECT DISTINCT table_name
  FROM leasework.records
 WHERE connection_id = %(connection_id)s AND deleted_at IS NULL

-- name: advance_due_connections
-- Lock a bounded batch of due active connections (SKIP LOCKED: several workers polling at once
-- each take different rows, and a row already taken is not due any more once they commit) and
-- move each one's next_run_at to now + its interval. The caller enqueues their syncs in the same
-- transaction; a connection whose sync is still active gets that run back (one per key).
-- FOR NO KEY UPDATE rather than FOR UPDATE: it still excludes a second scheduler, but does not
-- skip a connection merely because a sync's record inserts hold the FK's KEY SHARE lock on it.
WITH due AS MATERIALIZED (
    SELECT id
      FROM leasework.connections
     WHERE status = 'active'
       AND next_run_at <= leasework.now()
     ORDER BY next_run_at, id
     LIMIT %(limit)s
       FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE leasework.connections c
   SET next_run_at = CASE WHEN c.sync_interval_seconds IS NULL THEN NULL
                          ELSE leasework.now() + make_interval(secs => c.sync_interval_seconds) END
  FROM due
 WHERE c.id = due.id
RETURNING c.id, c.workspace, c.provider

-- name: next_due_connection
-- Seconds until the first active connection's sync is due (NULL: none has a schedule): how long
-- an idle worker may sleep as far as connections go (workers/idle.py). Walks connections_due.
SELECT extract(epoch FROM min(next_run_at) - leasework.now())::float8
  FROM leasework.connections
 WHERE status = 'active' AND next_run_at IS NOT NULL

-- name: prune_tombstones
-- Records deleted upstream (tombstoned) longer ago than the retention, oldest first.
WITH doomed AS MATERIALIZED (
    SELECT id
      FROM leasework.records
     WHERE deleted_at < leasework.now() - make_interval(secs => %(retention)s)
     ORDER BY deleted_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM leasework.records r USING doomed WHERE r.id = doomed.id
RETURNING r.id
