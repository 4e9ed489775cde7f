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


-- name: declare_kinds
-- This worker has handlers for these kinds (every worker, at its first poll and hourly after),
-- which take these payloads (`accepts`, leasework.enqueue's check; NULL: not declared, the
-- recorded one kept).
INSERT INTO leasework.kinds (kind, seen_at, accepts)
SELECT d.kind, leasework.now(), d.accepts
  FROM unnest(%(kinds)s::text[], %(accepts)s::jsonb[]) AS d(kind, accepts)
ON CONFLICT (kind) DO UPDATE
   SET seen_at = EXCLUDED.seen_at,
       accepts = coalesce(EXCLUDED.accepts, leasework.kinds.accepts)

-- name: fail_unknown_kinds
-- Queued runs due for longer than `after` seconds whose kind no worker declared in the last
-- seven days (leasework.kinds) end `failed`, saying which kinds the workers do know: a typo, or a
-- kind enqueued by a Client or from SQL that no deployed worker has. A kind that some worker
-- serves is claimed long before it waits that long. Each branch walks one of the claim's
-- partial indexes of queued runs (status guard re-checked under the row lock).
WITH known AS (
    SELECT kind FROM leasework.kinds WHERE seen_at > leasework.now() - interval '7 days'
), doomed AS MATERIALIZED (
    SELECT r.id
      FROM leasework.runs r
     WHERE r.id IN (SELECT id FROM leasework.runs
                     WHERE status = 'queued' AND tenant IS NULL
                       AND queued_at < leasework.now() - make_interval(secs => %(after)s)
                    UNION ALL
                    SELECT id FROM leasework.runs
                     WHERE status = 'queued' AND tenant IS NOT NULL
                       AND queued_at < leasework.now() - make_interval(secs => %(after)s))
       AND r.status = 'queued'
       AND NOT EXISTS (SELECT 1 FROM known k WHERE k.kind = r.kind)
     ORDER BY r.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE leasework.runs r
   SET status = 'failed',
       finished_at = leasework.now(),
       error = format('unknown kind %%L: no worker has a handler for it (workers know %%s); '
                      || 'register it with @app.task(%%L) and retry the run', r.kind,
                      (SELECT coalesce(string_agg(kind, ', ' ORDER BY kind), 'no kind') FROM known),
                      r.kind)
  FROM doomed
 WHERE r.id = doomed.id AND r.status = 'queued'
RETURNING r.id

-- name: prune_rate_windows
-- The windows of tenants' rates (leasework.tenant_rates, kinds rated per tenant) and of groups'
-- (leasework.group_rates, kinds rated per group) that count no claim any more: a row is made for
-- every tenant (or group) a claim admits, so a kind with many would keep one for each for ever.
-- A tenant's row with a rate an operator set is kept (that is not a window's), and so is a
-- window still counting claims (leasework.rate_used, over the period its budget is held to: the
-- tenant's own rate's, else the kind's). A row a claim is writing is skipped (SKIP LOCKED); one
-- deleted as a claim admits its tenant is made again.
WITH doomed AS MATERIALIZED (
    SELECT t.kind, t.tenant
      FROM leasework.tenant_rates t
      LEFT JOIN leasework.kind_limits l ON l.kind = t.kind
     WHERE t.rate_count IS NULL
       AND (l.rate_count IS NULL OR l.rate_per IS NULL
            OR leasework.rate_used(t.win, l.rate_seconds, leasework.now()) = 0)
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), group_doomed AS MATERIALIZED (
    SELECT g.kind, g.tenant, g."group"
      FROM leasework.group_rates g
      LEFT JOIN leasework.kind_limits l ON l.kind = g.kind
     WHERE l.rate_count IS NULL OR l.rate_per IS DISTINCT FROM 'group'
        OR leasework.rate_used(g.win, coalesce(
               (SELECT t.rate_seconds FROM leasework.tenant_rates t
                 WHERE t.kind = g.kind AND t.tenant = g.tenant), l.rate_seconds),
               leasework.now()) = 0
     LIMIT %(limit)s
       FOR UPDATE OF g SKIP LOCKED
), tenant_gone AS (
    DELETE FROM leasework.tenant_rates t USING doomed d
     WHERE t.kind = d.kind AND t.tenant = d.tenant
    RETURNING t.kind
), group_gone AS (
    DELETE FROM leasework.group_rates g USING group_doomed d
     WHERE g.kind = d.kind AND g.tenant = d.tenant AND g."group" = d."group"
    RETURNING g.kind
)
SELECT kind FROM tenant_gone
UNION ALL
SELECT kind FROM group_gone
