-- What operators do to runs and kinds (leasework/operations.py): browse, retry, delete, pause.
-- No statement here writes lease columns; every status change is guarded by the statuses it
-- may change (a live run is never touched), and runs the caller named are locked first.

-- name: get_run
SELECT id, kind, key, tenant, "group", exclusive, priority, status, payload, result, error,
       attempts, max_attempts, lease_seconds, timeout_seconds, queued_at, created_at, started_at,
       finished_at, lease_owner, lease_worker, lease_expires_at, cancel_requested_at,
       processed_units, total_units, snoozes, unique_at, debounce_count, debounce_deadline, tags,
       leasework.run_history(r) AS history,
       EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = r.kind) AS kind_paused
  FROM leasework.runs r
 WHERE id = %(id)s

-- name: list_runs
-- Newest first, keyset-paged on id (%(before)s: the last id of the previous page). Every filter
-- is optional (NULL). Walks the primary key backwards, so a page costs its rows, not the table.
-- The searches (migration 0028): %(error)s an ILIKE pattern (operations.Filters escapes the text
-- and adds the %%), %(payload)s jsonb containment, %(tags)s every tag (runs_tags, runs_error_trgm;
-- bench/search.py measures each over a million runs).
SELECT id, kind, key, tenant, "group", status, attempts, max_attempts, priority,
       processed_units, total_units, created_at, queued_at, started_at, finished_at,
       lease_worker, cancel_requested_at IS NOT NULL AS cancel_requested,
       left(coalesce(error, ''), 300) AS error, tags
  FROM leasework.runs
 WHERE (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
   AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: lock_runs
-- The runs an operator named, locked until the action commits, with what decides it. NO KEY
-- UPDATE: it does not wait for a handler's fenced transaction (FOR KEY SHARE) on a running run,
-- which is refused anyway; claims skip the rows meanwhile (SKIP LOCKED).
SELECT id, kind, key, status, tenant
  FROM leasework.runs
 WHERE id = ANY(%(ids)s::bigint[])
 ORDER BY id
   FOR NO KEY UPDATE

-- name: select_runs
-- The runs matching an operator's filters among %(statuses)s (terminal statuses only: the caller
-- checks), at most %(limit)s, locked; runs another session holds are left for the next batch.
SELECT id, kind, key, status, tenant
  FROM leasework.runs
 WHERE status = ANY(%(statuses)s::text[])
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
   AND (%(after)s::bigint IS NULL OR id > %(after)s::bigint)
 ORDER BY id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- name: busy_keys
-- Of the (tenant, key) pairs given, those with an active (queued or running) run: a retried run
-- with such a key in its tenant would be a second active run for it (runs_one_active_per_key).
SELECT DISTINCT u.tenant, u.key
  FROM unnest(%(tenants)s::text[], %(keys)s::text[]) AS u(tenant, key)
 WHERE EXISTS (SELECT 1 FROM leasework.runs r
                WHERE r.key = u.key AND r.tenant IS NOT DISTINCT FROM u.tenant
                  AND r.status IN ('queued', 'running'))

-- name: tally_retried
-- A retried run leaves its terminal status: what it counted as finished moves to
-- leasework.counters first, so runs_finished_total (and the duration and queue-wait histograms)
-- never goes down (its lost leases and attempts stay with the row, which keeps its history).
SELECT leasework.add_to_counters(
           coalesce(jsonb_agg(jsonb_build_object(
               'kind', kind, 'status', status, 'attempts', attempts, 'queued_at', queued_at,
               'started_at', started_at, 'finished_at', finished_at, 'history', history)),
               '[]'::jsonb),
           false)
  FROM leasework.runs
 WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('failed', 'cancelled', 'partial')

-- name: retry_runs
-- Back to `queued`, due now, with a fresh attempt budget: %(attempts)s more attempts, else the
-- kind's own figure (%(budgets)s, {kind: n}), else %(default_attempts)s. Attempts already made
-- and the history stay (attempt numbers keep counting); the result and processed_units stay, so
-- a checkpointed run resumes. Its snoozes are cleared: a fresh snooze budget too (a run that
-- ended `failed` for snoozing too often would otherwise fail again at its first snooze).
-- Guarded: only failed, cancelled and partial runs change.
UPDATE leasework.runs
   SET status = 'queued',
       queued_at = leasework.now(),
       finished_at = NULL,
       error = NULL,
       cancel_requested_at = NULL,
       snoozes = NULL,
       max_attempts = attempts + coalesce(%(attempts)s::int,
                                          (%(budgets)s::jsonb ->> kind)::int,
                                          %(default_attempts)s::int)
 WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('failed', 'cancelled', 'partial')
   -- Its tenant has a queued run again (leasework.tenant_queued_run, schema.sql).
   AND (tenant IS NULL OR leasework.tenant_queued_run(tenant, priority))
RETURNING id, kind

-- name: run_steps
-- `leasework show` and the dashboard's run page: a run's stored durable steps (ctx.step), their
-- sizes, the attempt that stored each, and the start of each value's JSON (`preview`, at most
-- 200 characters: the dashboard shows a short view).
SELECT name, octet_length(value::text)::bigint AS bytes, attempt, created_at,
       left(value::text, 200) AS preview
  FROM leasework.run_steps
 WHERE run_id = %(id)s
 ORDER BY created_at, name

-- name: clear_steps
-- `retry --clear-steps`: the retried runs' durable steps (ctx.step) deleted in the retry's
-- transaction, so that every step runs again.
DELETE FROM leasework.run_steps WHERE run_id = ANY(%(ids)s::bigint[])

-- name: delete_runs
-- Terminal runs only (guarded). The runs_deleted trigger hands their counts to
-- leasework.counters in the same statement.
DELETE FROM leasework.runs
 WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('succeeded', 'partial', 'failed', 'cancelled')
RETURNING id

-- name: count_runs
-- How many runs a bulk action would act on (a dry run, the dashboard's "all N matching");
-- %(not_due)s: only those not due yet (run-now).
SELECT count(*)::bigint
  FROM leasework.runs
 WHERE status = ANY(%(statuses)s::text[])
   AND (NOT %(not_due)s::boolean OR queued_at > leasework.now())
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])

-- name: known_kinds
-- Of the kinds given, those leasework has heard of: a run or a schedule of that kind, or one a
-- worker declared (leasework.kinds) or that has limits.
SELECT k
  FROM unnest(%(kinds)s::text[]) AS k
 WHERE EXISTS (SELECT 1 FROM leasework.runs r WHERE r.kind = k)
    OR EXISTS (SELECT 1 FROM leasework.schedules s WHERE s.kind = k)
    OR EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k)
    OR EXISTS (SELECT 1 FROM leasework.kinds d WHERE d.kind = k)
    OR EXISTS (SELECT 1 FROM leasework.kind_limits l WHERE l.kind = k)

-- name: pause_kinds
INSERT INTO leasework.paused_kinds (kind, paused_at)
SELECT k, leasework.now() FROM unnest(%(kinds)s::text[]) AS k
ON CONFLICT (kind) DO NOTHING
RETURNING kind

-- name: resume_kinds
-- NOTIFY: idle workers wake and claim the resumed kinds' queued runs at once.
WITH resumed AS (
    DELETE FROM leasework.paused_kinds WHERE kind = ANY(%(kinds)s::text[]) RETURNING kind
)
SELECT kind, pg_notify('leasework', kind) IS NULL AS notified FROM resumed

-- name: list_paused
SELECT p.kind, p.paused_at,
       (SELECT count(*) FROM leasework.runs r WHERE r.kind = p.kind AND r.status = 'queued')::bigint AS queued
  FROM leasework.paused_kinds p
 ORDER BY p.kind

-- name: notify_kind
SELECT pg_notify('leasework', %(kind)s)

-- name: db_now
SELECT leasework.now()

-- name: tenants
-- Every tenant with its weight, its place in the turns and what it has queued and running.
SELECT t.name, t.weight, t.turn, t.priority,
       (SELECT count(*) FROM leasework.runs r WHERE r.tenant = t.name AND r.status = 'queued')
           AS queued,
       (SELECT count(*) FROM leasework.runs r WHERE r.tenant = t.name AND r.status = 'running')
           AS running
  FROM leasework.tenants t
 ORDER BY t.name

-- name: untenanted_turn
-- The runs without a tenant, as one participant in the turns (leasework.untenanted_turn).
SELECT coalesce((SELECT weight FROM leasework.untenanted_turn), 1) AS weight,
       coalesce((SELECT turn FROM leasework.untenanted_turn), 0) AS turn,
       (SELECT count(*) FROM leasework.runs r WHERE r.tenant IS NULL AND r.status = 'queued')
           AS queued,
       (SELECT count(*) FROM leasework.runs r WHERE r.tenant IS NULL AND r.status = 'running')
           AS running

-- name: set_untenanted_weight
-- The row is made again if a TRUNCATE took it.
INSERT INTO leasework.untenanted_turn (weight) VALUES (%(weight)s)
ON CONFLICT (one) DO UPDATE SET weight = EXCLUDED.weight

-- name: set_tenant_weight
-- A tenant not seen yet is made, with this weight, so that its first runs already have it.
INSERT INTO leasework.tenants (name, weight) VALUES (%(name)s, %(weight)s)
ON CONFLICT (name) DO UPDATE SET weight = EXCLUDED.weight
RETURNING name, weight

-- name: lock_limits
-- One kind's limits row, locked until the change commits (claims of the kind wait meanwhile).
SELECT kind, declared, overrides, rate_count, rate_per
  FROM leasework.kind_limits
 WHERE kind = %(kind)s
   FOR UPDATE

-- name: set_limit_overrides
-- An operator's limits for a kind (overrides: a key with JSON null removes that limit); the row
-- is made if the kind had none. Claims read it from their next statement on; NOTIFY wakes idle
-- workers (a limit raised or removed may make runs claimable at once).
INSERT INTO leasework.kind_limits AS l (kind, overrides)
VALUES (%(kind)s, %(overrides)s::jsonb)
ON CONFLICT (kind) DO UPDATE SET overrides = %(overrides)s::jsonb
RETURNING l.kind, pg_notify('leasework', l.kind) IS NULL AS notified

-- name: drop_empty_limits
-- A kind neither declared nor set limits for needs no row (the claim then reads nothing for it).
DELETE FROM leasework.kind_limits
 WHERE kind = %(kind)s AND declared = '{}' AND overrides = '{}'

-- name: set_tenant_rate
-- An operator's rate for one tenant's runs of a kind rated per tenant (NULL: the kind's again).
-- Written under the kind's row lock (lock_limits), as leasework.admit writes the window.
INSERT INTO leasework.tenant_rates AS t (kind, tenant, rate_count, rate_seconds)
VALUES (%(kind)s, %(tenant)s, %(count)s, %(seconds)s)
ON CONFLICT (kind, tenant) DO UPDATE
   SET rate_count = EXCLUDED.rate_count, rate_seconds = EXCLUDED.rate_seconds
RETURNING t.kind, pg_notify('leasework', t.kind) IS NULL AS notified

-- name: declared_limits
-- The limits rows of a worker's kinds, as declared (declare_limits: written only when changed).
SELECT kind, declared FROM leasework.kind_limits WHERE kind = ANY(%(kinds)s::text[])

-- name: declare_limits
-- A worker starting declares its app's limits for one kind (one row per statement: a statement
-- locking several rows could wait on a claim that waits on it). NOTIFY: the limits changed.
INSERT INTO leasework.kind_limits AS l (kind, declared) VALUES (%(kind)s, %(declared)s::jsonb)
ON CONFLICT (kind) DO UPDATE SET declared = EXCLUDED.declared
 WHERE l.declared IS DISTINCT FROM EXCLUDED.declared
RETURNING l.kind, pg_notify('leasework', l.kind) IS NULL AS notified

-- name: held_back
-- What keeps a queued run from being claimed now, each rule the claim applies (README, "Flow
-- control"; docs/state-machine.md): its due time, its kind paused, its kind at its cap
-- (max_running: live leases), its rate's window full (the kind's, its tenant's or its group's) and when it has
-- room again, its tenant's group full (live leases against its kind's group_limit), an exclusive
-- run of its tenant running, or, exclusive itself, other runs of its tenant running. Read in one
-- snapshot; a claim may take the run a moment later (or another run first).
SELECT r.status, r.queued_at, r.tenant, r."group", r.exclusive,
       r.queued_at > leasework.now() AS not_due,
       EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = r.kind) AS paused,
       l.max_running, l.rate_count, l.rate_seconds, l.rate_per,
       leasework.running_of_kind(r.kind, NULL, NULL) AS running,
       leasework.rate_free_at(r.kind, r.tenant, r."group") AS rate_free_at,
       leasework.now() AS now,
       coalesce(l.group_limit, 1) AS group_limit,
       (SELECT count(*) FROM leasework.runs o
         WHERE o.tenant = r.tenant AND o."group" = r."group" AND o.id <> r.id
           AND o.status = 'running' AND o.lease_expires_at >= leasework.now()) AS group_running,
       (SELECT count(*) FROM leasework.runs o
         WHERE o.tenant = r.tenant AND o.id <> r.id AND o.exclusive
           AND o.status = 'running' AND o.lease_expires_at >= leasework.now()) AS exclusive_running,
       (SELECT count(*) FROM leasework.runs o
         WHERE o.tenant = r.tenant AND o.id <> r.id
           AND o.status = 'running' AND o.lease_expires_at >= leasework.now()) AS tenant_running,
       coalesce((SELECT t.rate_count FROM leasework.tenant_rates t
                  WHERE t.kind = r.kind AND t.tenant = r.tenant), l.rate_count) AS tenant_rate_count,
       coalesce((SELECT t.rate_seconds FROM leasework.tenant_rates t
                  WHERE t.kind = r.kind AND t.tenant = r.tenant), l.rate_seconds)
           AS tenant_rate_seconds
  FROM leasework.runs r
  LEFT JOIN leasework.kind_limits l ON l.kind = r.kind
 WHERE r.id = %(id)s

-- name: run_parents
-- The runs a run waits (or waited) for, with the policy of each edge (docs/workflows.md).
-- Serves: `leasework show`, the dashboard's run page.
SELECT d.parent AS id, p.kind, coalesce(p.status, 'pruned') AS status,
       CASE WHEN d.anyway THEN 'run' ELSE 'cancel' END AS on_failure, d.member
  FROM leasework.run_deps d
  LEFT JOIN leasework.runs p ON p.id = d.parent
 WHERE d.child = %(id)s
 ORDER BY d.parent
 LIMIT %(limit)s

-- name: run_children
-- The runs that wait (or waited) for a run (run_deps_by_parent).
SELECT d.child AS id, c.kind, coalesce(c.status, 'pruned') AS status,
       CASE WHEN d.anyway THEN 'run' ELSE 'cancel' END AS on_failure, d.member
  FROM leasework.run_deps d
  LEFT JOIN leasework.runs c ON c.id = d.child
 WHERE d.parent = %(id)s
 ORDER BY d.child
 LIMIT %(limit)s

-- name: run_graph
-- The state of a run's graph: the runs linked to it by dependencies, either way, transitively
-- (at most %(limit)s), counted by status. No row for a run without dependencies.
WITH RECURSIVE linked(id) AS (
    SELECT %(id)s::bigint
    UNION
    SELECT CASE WHEN d.child = l.id THEN d.parent ELSE d.child END
      FROM linked l
      JOIN leasework.run_deps d ON d.child = l.id OR d.parent = l.id
), bounded AS (
    SELECT id FROM linked LIMIT %(limit)s
)
SELECT coalesce(r.status, 'pruned') AS status, count(*) AS runs
  FROM bounded b
  LEFT JOIN leasework.runs r ON r.id = b.id
 GROUP BY 1
HAVING (SELECT count(*) FROM bounded) > 1
 ORDER BY 1

-- name: run_statuses
-- The runs named by id (a bulk cancel or run-now checks them first): status, and whether a
-- queued one is not due yet.
SELECT id, status, status = 'queued' AND queued_at > leasework.now() AS not_due
  FROM leasework.runs
 WHERE id = ANY(%(ids)s::bigint[])

-- Bulk actions (operations.cancel, run_now, delete; docs/operations.md, "Search, tags and bulk actions"): one
-- statement per page, each in a transaction of its own. `page` reads the next %(limit)s matching
-- runs by id after %(after)s (its snapshot: the caller pages on from its count and last id,
-- and stops at a short page); the action then locks each and re-reads it, so a run that changed
-- meanwhile is acted on as it is now, or passed by when it no longer matches its status.

-- name: cancel_page
-- leasework.cancel on each (schema.sql; what App.cancel does to one run): blocked, waiting and
-- queued runs cancelled, running ones asked to stop (cancel_requested_at). The lock waits for a
-- claim in flight (never SKIP LOCKED: a run skipped would escape the cancel), then the run is
-- read again: claimed meanwhile, it is running, and gets a cancel request.
WITH page AS MATERIALIZED (
    SELECT id
      FROM leasework.runs
     WHERE status = ANY(%(statuses)s::text[])
   AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
   AND (%(after)s::bigint IS NULL OR id > %(after)s::bigint)
     ORDER BY id
     LIMIT %(limit)s
), locked AS MATERIALIZED (
    SELECT r.id
      FROM leasework.runs r
     WHERE r.id IN (SELECT id FROM page) AND r.status = ANY(%(statuses)s::text[])
     ORDER BY r.id
       FOR NO KEY UPDATE OF r
), done AS MATERIALIZED (
    SELECT id, leasework.cancel(id) AS status FROM locked
)
SELECT (SELECT count(*) FROM page) AS scanned,
       (SELECT max(id) FROM page) AS last,
       coalesce((SELECT array_agg(id ORDER BY id) FROM done WHERE status = 'cancelled'),
                '{}') AS cancelled,
       coalesce((SELECT array_agg(id ORDER BY id) FROM done WHERE status = 'running'),
                '{}') AS requested

-- name: run_now_page
-- Queued runs not due yet (a delay, a backoff, a snooze, a debounce) made due now; nothing else
-- of theirs changes. NOTIFY wakes idle workers for each kind made due.
WITH page AS MATERIALIZED (
    SELECT id
      FROM leasework.runs
     WHERE status = 'queued' AND queued_at > leasework.now()
   AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
   AND (%(after)s::bigint IS NULL OR id > %(after)s::bigint)
     ORDER BY id
     LIMIT %(limit)s
), done AS MATERIALIZED (
    UPDATE leasework.runs r
       SET queued_at = leasework.now()
     WHERE r.id IN (SELECT id FROM page)
       AND r.status = 'queued' AND r.queued_at > leasework.now()
    RETURNING r.id, r.kind
), woken AS MATERIALIZED (
    SELECT count(pg_notify('leasework', kind)) FROM (SELECT DISTINCT kind FROM done) k
)
SELECT (SELECT count(*) FROM page) AS scanned,
       (SELECT max(id) FROM page) AS last,
       coalesce((SELECT array_agg(id ORDER BY id) FROM done), '{}') AS made_due,
       (SELECT * FROM woken) AS woken

-- name: delete_page
-- Finished runs among %(statuses)s deleted (terminal statuses only: guarded here too); the
-- runs_deleted trigger hands their counts to leasework.counters in the same statement.
WITH page AS MATERIALIZED (
    SELECT id
      FROM leasework.runs
     WHERE status = ANY(%(statuses)s::text[])
   AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
   AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
   AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
   AND (%(after)s::bigint IS NULL OR id > %(after)s::bigint)
     ORDER BY id
     LIMIT %(limit)s
), gone AS MATERIALIZED (
    DELETE FROM leasework.runs r
     WHERE r.id IN (SELECT id FROM page) AND r.status = ANY(%(statuses)s::text[])
       AND r.status IN ('succeeded', 'partial', 'failed', 'cancelled')
    RETURNING r.id
)
SELECT (SELECT count(*) FROM page) AS scanned,
       (SELECT max(id) FROM page) AS last,
       coalesce((SELECT array_agg(id ORDER BY id) FROM gone), '{}') AS deleted

-- name: count_matching
-- The dashboard's "all N matching this filter": the runs matching the runs list's filters, in
-- any status the filter allows, counted up to %(limit)s (a page shown must not scan a million).
SELECT count(*)::bigint
  FROM (SELECT 1
          FROM leasework.runs
         WHERE (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
           AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
           AND (%(key)s::text IS NULL OR key = %(key)s::text)
           AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
           AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
           AND (%(error)s::text IS NULL OR error ILIKE %(error)s::text)
           AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
           AND (%(tags)s::text[] IS NULL OR tags @> %(tags)s::text[])
         LIMIT %(limit)s) AS matching
