-- Queries the App runs in the caller's own connection and transaction: enqueue and cancel.
-- None of them writes lease columns.

-- name: enqueue_run
-- leasework.enqueue (schema.sql) checks its arguments, makes the tenant row, inserts the run
-- unless its key already has an active one in its tenant (or a waiting one, for an exclusive
-- run), and returns the run's id either way; NOTIFY wakes idle workers at commit. A function, so
-- that the enqueue role needs no privilege on the tables.
-- Its unique window and debounce arguments are NULL when not in use (and merge_into, merge_seen
-- but for the second half of a debounce_merge: NULL id then means merge again).
SELECT leasework.enqueue(%(kind)s::text, %(payload)s::jsonb, %(key)s::text, %(tenant)s::text,
                         %(group)s::text, %(exclusive)s::boolean, %(priority)s::integer,
                         %(delay)s::float8, %(max_attempts)s::integer, %(lease)s::float8,
                         %(timeout)s::float8, %(unique_for)s::float8, %(debounce)s::float8,
                         %(debounce_max)s::float8, %(merge_into)s::bigint,
                         %(merge_seen)s::integer, tags => %(tags)s::text[]) AS id,
       -- Set by leasework.enqueue for this call (transaction-local): 'false' when it inserted a
       -- run, else how it returned one of the key's ('true': the key's active or waiting run,
       -- 'window', 'debounced'). Evaluated after the call.
       coalesce(current_setting('leasework.enqueued_existing', true), 'false') AS existing

-- name: debounce_pending
-- The first half of a debounce_merge (leasework.debounce_pending, schema.sql): the key's pending
-- debounced run of the kind, locked, with its payload and debounce_count; no row when none.
SELECT id, payload, debounce_count
  FROM leasework.debounce_pending(%(kind)s::text, %(key)s::text, %(tenant)s::text)

-- name: cancel_run
-- leasework.cancel (schema.sql): a queued or waiting run is cancelled at once; a running one
-- gets cancel_requested_at, which its worker's control query sees (and which stops any reclaim).
-- Returns the status afterwards, NULL when there is no such run.
SELECT leasework.cancel(%(id)s::bigint)

-- name: run_status
SELECT status FROM leasework.runs WHERE id = %(id)s

-- name: get_run
SELECT id, kind, key, tenant, "group", exclusive, priority, status, payload, result, error,
       attempts, max_attempts, queued_at, created_at, started_at, finished_at, lease_owner,
       lease_worker, lease_expires_at, cancel_requested_at, processed_units, total_units,
       unique_at, debounce_count, debounce_deadline, leasework.run_history(runs) AS history
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
-- Bulk enqueue with keys: rows whose key already has an active run in the tenant are skipped.
-- `held`: each key's advisory lock, held (shared) until the transaction ends as leasework.enqueue
-- holds it, so that expire_and_promote skips a waiting run of these keys rather than wait on the
-- fate of these rows in runs_one_active_per_key. Read before any row is inserted.
WITH held AS MATERIALIZED (
    SELECT count(pg_advisory_xact_lock_shared(-1682930272, leasework.key_lock(%(tenant)s::text, k)))
      FROM unnest(%(keys)s::text[]) AS k
     WHERE k IS NOT NULL
)
INSERT INTO leasework.runs (kind, key, tenant, "group", priority, payload, max_attempts,
                            lease_seconds, timeout_seconds, queued_at, tags)
SELECT %(kind)s, k, %(tenant)s, %(group)s, %(priority)s, p::jsonb, %(max_attempts)s, %(lease)s,
       %(timeout)s, leasework.now() + make_interval(secs => %(delay)s), %(tags)s::text[]
  FROM unnest(%(payloads)s::text[], %(keys)s::text[]) WITH ORDINALITY AS u(p, k, n), held
 ORDER BY n
ON CONFLICT (key, tenant) WHERE status IN ('queued', 'running') AND key IS NOT NULL DO NOTHING
RETURNING id

-- name: enqueue_each
-- enqueue_many with a unique window or a debounce: leasework.enqueue per payload, in order, in
-- one statement (each row's call sees the rows before it); `existing` read after each call, as
-- enqueue_run reads it. Every payload has a key (Client checks).
SELECT e.id,
       coalesce(current_setting('leasework.enqueued_existing', true), 'false') AS existing
  FROM unnest(%(payloads)s::text[], %(keys)s::text[]) WITH ORDINALITY AS u(p, k, n)
 CROSS JOIN LATERAL (
       SELECT leasework.enqueue(%(kind)s::text, u.p::jsonb, u.k, %(tenant)s::text,
                                %(group)s::text, false, %(priority)s::integer, %(delay)s::float8,
                                %(max_attempts)s::integer, %(lease)s::float8, %(timeout)s::float8,
                                %(unique_for)s::float8, %(debounce)s::float8,
                                %(debounce_max)s::float8, tags => %(tags)s::text[]) AS id
       ) AS e
 ORDER BY u.n

-- name: trace_run
-- The enqueuing span's traceparent, into the run the enqueue just made (leasework.trace_run,
-- schema.sql). Sent only when the enqueuing process has an active span (docs/operations.md, "Tracing").
SELECT leasework.trace_run(%(id)s::bigint, %(traceparent)s::text)

-- name: trace_runs
-- The same for the runs an enqueue_many made.
SELECT count(*) FILTER (WHERE leasework.trace_run(id, %(traceparent)s::text))
  FROM unnest(%(ids)s::bigint[]) AS id

-- name: run_traceparents
-- A worker that traces reads the traceparents of the runs it is about to start (not returned by
-- the claim, which every worker would pay for; docs/operations.md, "Tracing").
SELECT id, traceparent FROM leasework.runs WHERE id = ANY(%(ids)s::bigint[])

-- name: enqueue_after
-- enqueue_run for a run that waits for others (docs/workflows.md): leasework.enqueue with
-- `after` and `on_parent_failure` (leasework.enqueue_blocked, schema.sql); no key, exclusive or
-- window (refused). A run without `after` is sent by enqueue_run, unchanged.
SELECT leasework.enqueue(%(kind)s::text, %(payload)s::jsonb, NULL::text, %(tenant)s::text,
                         %(group)s::text, false, %(priority)s::integer, %(delay)s::float8,
                         %(max_attempts)s::integer, %(lease)s::float8, %(timeout)s::float8,
                         after => %(after)s::bigint[],
                         on_parent_failure => %(on_parent_failure)s::text,
                         tags => %(tags)s::text[]) AS id,
       'false' AS existing

-- name: join_batch
-- A run joins an open batch (leasework.join_batch, schema.sql; docs/workflows.md).
SELECT leasework.join_batch(%(batch)s::bigint, %(run)s::bigint)

-- name: enqueue_after_policies
-- enqueue_after for a run some of whose parents have a policy of their own (After(run,
-- on_failure=...)): the run enqueued, then each such edge's policy set by
-- leasework.set_dependency_policy (schema.sql), in this one statement, so in the enqueue's own
-- transaction: until it commits no other session sees the run or its edges, and the deps stage
-- decides a blocked run from committed edges only, so it decides this one by its edges' policies
-- as set here (a run whose parents had all ended was decided by the enqueue, and is decided
-- again by leasework.set_dependency_policy). Each call sees what the enqueue wrote (a volatile
-- function's statements see those before them).
WITH run AS MATERIALIZED (
    SELECT leasework.enqueue(%(kind)s::text, %(payload)s::jsonb, NULL::text, %(tenant)s::text,
                             %(group)s::text, false, %(priority)s::integer, %(delay)s::float8,
                             %(max_attempts)s::integer, %(lease)s::float8, %(timeout)s::float8,
                             after => %(after)s::bigint[],
                             on_parent_failure => %(on_parent_failure)s::text) AS id
)
SELECT run.id, 'false' AS existing,
       (SELECT count(leasework.set_dependency_policy(run.id, e.parent, e.policy))
          FROM unnest(%(edge_parents)s::bigint[], %(edge_policies)s::text[]) AS e(parent, policy))
           AS policies
  FROM run
