-- Read-only queries behind `leasework dashboard` (the overview itself comes from status.sql via
-- status.collect). The dashboard's connections are read-only sessions: none of these writes.

-- name: dashboard_clock
SELECT leasework.now() AS now

-- name: dashboard_recent_runs
-- The newest runs, whatever their status, so that every run is one click from the overview.
SELECT id, kind, key, tenant, status, attempts, max_attempts, processed_units, total_units,
       queued_at, started_at, finished_at, left(coalesce(error, ''), 200) AS error
  FROM leasework.runs
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: metrics_workers
-- Every worker row (status_workers shows the newest 50 only). Alive: not stopped, and a heartbeat
-- within two intervals (a dead worker shows gone within two heartbeats).
SELECT count(*) FILTER (WHERE stopped_at IS NULL
                          AND heartbeat_at > leasework.now() - make_interval(secs => %(stale)s))::bigint AS alive,
       count(*)::bigint AS total
  FROM leasework.workers

-- name: metrics_oldest_queued
-- Age of the oldest due queued run per kind (a run delayed into the future is not waiting yet).
SELECT kind, extract(epoch FROM leasework.now() - min(queued_at))::float8 AS age
  FROM leasework.runs
 WHERE status = 'queued' AND queued_at <= leasework.now()
 GROUP BY kind

-- name: metrics_lease_losses
-- Attempts that lost their lease (`expired`: the lease ran out; `crashed`: the supervisor saw the
-- worker die), among the runs still in the table. Reclaimed: the run was claimed again after the
-- lost attempt (its started_at moved past that attempt's). A lease loss leaves either a second
-- attempt or a failed/running run, so the WHERE keeps the scan off most rows' history.
SELECT r.kind, e.entry ->> 'outcome' AS outcome, count(*)::bigint AS losses,
       count(*) FILTER (WHERE r.started_at > (e.entry ->> 'started_at')::timestamptz)::bigint AS reclaimed
  FROM leasework.runs r
 CROSS JOIN LATERAL jsonb_array_elements(r.history) AS e(entry)
 WHERE (r.attempts > 1 OR r.status IN ('failed', 'running'))
   AND e.entry ->> 'outcome' IN ('expired', 'crashed')
 GROUP BY 1, 2

-- name: metrics_claim_latency
-- Claim latency: from the moment a run was due (queued_at, which a retry moves to its new due
-- time) to its claim (started_at), for runs claimed in the last %(window)s seconds. Running runs
-- and recently finished ones cover every recent claim and both have an index.
-- Returns the count, the sum and cumulative counts per bucket bound, for a Prometheus histogram.
WITH lat AS MATERIALIZED (
    SELECT greatest(0, extract(epoch FROM started_at - queued_at))::float8 AS s
      FROM leasework.runs
     WHERE (status = 'running' OR finished_at > leasework.now() - make_interval(secs => %(window)s))
       AND started_at > leasework.now() - make_interval(secs => %(window)s)
)
SELECT (SELECT count(*) FROM lat)::bigint AS n,
       (SELECT coalesce(sum(s), 0) FROM lat)::float8 AS total,
       ARRAY(SELECT (SELECT count(*) FROM lat WHERE lat.s <= b.le)::bigint
               FROM unnest(%(buckets)s::float8[]) WITH ORDINALITY AS b(le, i)
              ORDER BY b.i) AS cumulative
