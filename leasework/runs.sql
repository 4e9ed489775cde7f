-- Queries the App runs in the caller's own connection and transaction: enqueue and cancel.
-- None of them writes lease columns.

-- name: enqueue_run
-- Insert a queued run unless its key already has an active one (the partial unique index makes
-- racing enqueues give one run). The tenant row the claim locks is made in the same statement.
-- NOTIFY wakes idle workers at commit.
WITH tenant AS (
    INSERT INTO leasework.tenants (name)
    SELECT %(tenant)s::text WHERE %(tenant)s::text IS NOT NULL
    ON CONFLICT (name) DO NOTHING
), run AS (
    INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status, payload,
                                max_attempts, lease_seconds, timeout_seconds, queued_at)
    VALUES (%(kind)s, %(key)s, %(tenant)s, %(group)s, %(exclusive)s, %(priority)s, 'queued',
            %(payload)s, %(max_attempts)s, %(lease)s, %(timeout)s,
            leasework.now() + make_interval(secs => %(delay)s))
    ON CONFLICT (key) WHERE status IN ('queued', 'running') AND key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT run.id, pg_notify('leasework', %(kind)s) IS NULL AS notified FROM run

-- name: enqueue_waiting_run
-- An exclusive run whose key is busy waits; expire_and_promote promotes it once the key is idle. At
-- most one waiting run per key (unique index): a second one returns the first.
WITH tenant AS (
    INSERT INTO leasework.tenants (name)
    SELECT %(tenant)s::text WHERE %(tenant)s::text IS NOT NULL
    ON CONFLICT (name) DO NOTHING
)
INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status, payload,
                            max_attempts, lease_seconds, timeout_seconds, queued_at)
VALUES (%(kind)s, %(key)s, %(tenant)s, %(group)s, %(exclusive)s, %(priority)s, 'waiting',
        %(payload)s, %(max_attempts)s, %(lease)s, %(timeout)s,
        leasework.now() + make_interval(secs => %(delay)s))
ON CONFLICT (key) WHERE status = 'waiting' AND key IS NOT NULL DO NOTHING
RETURNING id

-- name: find_run_by_key
SELECT id
  FROM leasework.runs
 WHERE key = %(key)s AND status = ANY(%(statuses)s)
 ORDER BY id DESC
 LIMIT 1

-- name: cancel_run
-- A queued or waiting run is cancelled at once; a running one gets cancel_requested_at, which
-- its worker's control query sees (and which stops any reclaim).
UPDATE leasework.runs
   SET status = CASE WHEN status IN ('waiting', 'queued') THEN 'cancelled' ELSE status END,
       finished_at = CASE WHEN status IN ('waiting', 'queued') THEN leasework.now() ELSE finished_at END,
       error = CASE WHEN status IN ('waiting', 'queued') THEN 'cancelled before it started' ELSE error END,
       cancel_requested_at = coalesce(cancel_requested_at, leasework.now())
 WHERE id = %(id)s AND status IN ('waiting', 'queued', 'running')
RETURNING status

-- name: run_status
SELECT status FROM leasework.runs WHERE id = %(id)s

-- name: get_run
SELECT id, kind, key, tenant, "group", exclusive, priority, status, payload, result, error,
       attempts, max_attempts, queued_at, created_at, started_at, finished_at, lease_owner,
       lease_worker, lease_expires_at, cancel_requested_at, processed_units, total_units, history
  FROM leasework.runs
 WHERE id = %(id)s

-- name: ensure_tenant
INSERT INTO leasework.tenants (name) VALUES (%(tenant)s) ON CONFLICT (name) DO NOTHING

-- name: notify
SELECT pg_notify('leasework', %(kind)s)

-- name: due_at
SELECT leasework.now() + make_interval(secs => %(delay)s)

-- name: reserve_ids
-- Draw n run ids from the identity sequence for a COPY (COPY writes identity values it is given).
SELECT nextval(pg_get_serial_sequence('leasework.runs', 'id')) FROM generate_series(1, %(n)s)

-- name: enqueue_many
-- Bulk enqueue with keys: rows whose key already has an active run are skipped.
INSERT INTO leasework.runs (kind, key, tenant, "group", priority, payload, max_attempts,
                            lease_seconds, timeout_seconds, queued_at)
SELECT %(kind)s, k, %(tenant)s, %(group)s, %(priority)s, p::jsonb, %(max_attempts)s, %(lease)s,
       %(timeout)s, leasework.now() + make_interval(secs => %(delay)s)
  FROM unnest(%(payloads)s::text[], %(keys)s::text[]) WITH ORDINALITY AS u(p, k, n)
 ORDER BY n
ON CONFLICT (key) WHERE status IN ('queued', 'running') AND key IS NOT NULL DO NOTHING
RETURNING id
