-- Read-only queries behind `leasework status`.

-- name: status_now
SELECT extract(epoch FROM leasework.now())::float8 AS taken_at

-- name: status_workers
SELECT id, host, pid, started_at, heartbeat_at, stopped_at, current_run, pool, pool_kinds,
       stopped_at IS NULL AND heartbeat_at > leasework.now() - make_interval(secs => %(stale)s) AS alive,
       CASE WHEN isfinite(heartbeat_at)
            THEN extract(epoch FROM leasework.now() - heartbeat_at)::float8 END AS heartbeat_age
  FROM leasework.workers
 ORDER BY stopped_at IS NOT NULL, started_at DESC
 LIMIT 50

-- name: status_counts
SELECT kind, status, count(*)::bigint AS n
  FROM leasework.runs
 GROUP BY kind, status
 ORDER BY kind, status

-- name: status_running
SELECT id, kind, key, tenant, attempts, max_attempts, processed_units, total_units, lease_worker,
       started_at,
       extract(epoch FROM lease_expires_at - leasework.now())::float8 AS lease_left,
       extract(epoch FROM leasework.now() - started_at)::float8 AS running_for,
       cancel_requested_at IS NOT NULL AS cancel_requested
  FROM leasework.runs
 WHERE status = 'running'
 ORDER BY started_at
 LIMIT 50

-- name: status_failures
-- The latest failed attempts: runs that ended `failed` or `partial`, and runs requeued after a
-- failed attempt (will_retry), newest failure first. Scans the live runs and the last day's
-- finished ones only (runs_finished_at), however long the retention.
SELECT id, kind, key, status, attempts, max_attempts, status = 'queued' AS will_retry,
       coalesce(finished_at, leasework.try_instant(history -> -1 ->> 'ended_at')) AS failed_at,
       left(coalesce(error, ''), 200) AS error
  FROM leasework.runs
 WHERE error IS NOT NULL
   AND (status = 'queued'
        OR (status IN ('failed', 'partial') AND finished_at > leasework.now() - interval '1 day'))
 ORDER BY failed_at DESC NULLS LAST, id DESC
 LIMIT 10

-- name: status_connections
-- Each connection with its last sync or purge run (per-table results are in its result) and
-- its next scheduled run.
SELECT c.id, c.workspace, c.provider, c.status, c.sync_interval_seconds, c.next_run_at,
       lr.id AS last_run_id, lr.kind AS last_run_kind, lr.status AS last_run_status,
       lr.attempts AS last_run_attempts, lr.finished_at AS last_run_finished_at,
       lr.result -> 'tables' AS tables
  FROM leasework.connections c
  LEFT JOIN LATERAL (
        SELECT r.id, r.kind, r.status, r.attempts, r.finished_at, r.result
          FROM leasework.runs r
         WHERE r.key = 'leasework:connection:' || c.id
         ORDER BY r.id DESC
         LIMIT 1
  ) lr ON true
 ORDER BY c.id
 LIMIT 50

-- name: status_files
-- Files by status and uploads by status, for the ingest and expand stages.
SELECT 'files' AS what, status, count(*)::bigint AS n FROM leasework.files GROUP BY status
UNION ALL
SELECT 'uploads', status, count(*)::bigint FROM leasework.uploads GROUP BY status

-- name: status_paused
SELECT p.kind, p.paused_at,
       (SELECT count(*) FROM leasework.runs r WHERE r.kind = p.kind AND r.status = 'queued')::bigint AS queued
  FROM leasework.paused_kinds p
 ORDER BY p.kind

-- name: status_queued_kinds
-- Per kind: queued runs that are due, and how long the oldest has been due (a run delayed into
-- the future is not waiting yet). Walks the queued-only partial indexes.
SELECT kind, count(*)::bigint AS due,
       extract(epoch FROM leasework.now() - min(queued_at))::float8 AS oldest_due
  FROM leasework.runs
 WHERE status = 'queued' AND queued_at <= leasework.now()
 GROUP BY kind
 ORDER BY kind

-- name: status_limits
-- Every kind with a limit (leasework.kind_limits, docs/flow-control.md) and how full it is now:
-- `running`, its live leases (the places max_running counts); `rate_used`, the claims its rate's
-- window counts now (the kind's; rated per tenant, those of its runs without a tenant; all its
-- shards') and `rate_free_at`, when that window has room again (now when it has: a shard has
-- room under its share; `rate_free_in`, the seconds until then); `due`, its queued runs due;
-- `held_back`, those of them no claim may take now: every one while the kind is at its cap or its
-- rate, else (rated per tenant or group) those of tenants (or groups) at their rate; and the tenants an operator gave
-- a rate of their own. `overrides` holds what was set at run time (it wins over `declared`).
SELECT l.kind, l.max_running, l.group_limit, l.rate_count, l.rate_seconds, l.rate_per,
       l.declared, l.overrides, f.running, f.rate_used, f.rate_free_at,
       extract(epoch FROM greatest(f.rate_free_at - leasework.now(), interval '0'))::float8
           AS rate_free_in,
       f.due,
       CASE WHEN f.full OR f.rate_full THEN f.due
            WHEN l.rate_per IS NOT NULL AND l.rate_count IS NOT NULL THEN (
                SELECT coalesce(sum(q.n), 0)
                  FROM (SELECT r.tenant, r."group", count(*) AS n FROM leasework.runs r
                         WHERE r.kind = l.kind AND r.status = 'queued'
                           AND r.queued_at <= leasework.now() AND r.tenant IS NOT NULL
                         GROUP BY r.tenant, r."group") q
                 WHERE NOT leasework.tenant_rate_open(l.kind, q.tenant, q."group"))
            ELSE 0 END::bigint AS held_back,
       CASE WHEN f.full THEN 'capped' WHEN f.rate_full THEN 'rate_limited' END AS closed,
       EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = l.kind) AS paused,
       coalesce((SELECT jsonb_agg(jsonb_build_object('tenant', t.tenant,
                                                     'rate_count', t.rate_count,
                                                     'rate_seconds', t.rate_seconds)
                                  ORDER BY t.tenant)
                   FROM leasework.tenant_rates t
                  WHERE t.kind = l.kind AND t.rate_count IS NOT NULL), '[]') AS tenant_rates
  FROM leasework.kind_limits l
  -- The kind's window is its shards (leasework.rate_shards): the claims of all of them (and of
  -- those carried from before the rate changed); it has room when a shard has
  -- (leasework.rate_shards_open).
  LEFT JOIN LATERAL (
       SELECT least(leasework.rate_used(leasework.rate_shards_window(l.kind, l.rate_seconds),
                                        l.rate_seconds, leasework.now()), 2147483647) AS used,
              leasework.rate_free_at(l.kind, NULL) AS free_at,
              leasework.rate_shards_open(l.kind, l.rate_count, l.rate_seconds, leasework.now())
                  AS room
        WHERE l.rate_count IS NOT NULL) w ON true,
       LATERAL (SELECT leasework.running_of_kind(l.kind, NULL, NULL) AS running,
                       CASE WHEN l.rate_count IS NOT NULL THEN coalesce(w.used, 0) END AS rate_used,
                       CASE WHEN l.rate_count IS NOT NULL
                            THEN coalesce(w.free_at, leasework.now()) END AS rate_free_at,
                       (SELECT count(*) FROM leasework.runs r
                         WHERE r.kind = l.kind AND r.status = 'queued'
                           AND r.queued_at <= leasework.now()) AS due) f0,
       LATERAL (SELECT f0.*, coalesce(f0.running >= l.max_running, false) AS full,
                       coalesce(l.rate_per IS NULL AND NOT w.room, false) AS rate_full) f
 WHERE l.max_running IS NOT NULL OR l.group_limit IS NOT NULL OR l.rate_count IS NOT NULL
 ORDER BY l.kind
