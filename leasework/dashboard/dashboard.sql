-- Queries behind `leasework dashboard` (the overview itself comes from status.sql via
-- status.collect). Pages read through read-only sessions; only an action's session (actions
-- enabled) may write, and its writes are leasework.cancel and leasework.operations.

-- name: dashboard_clock
SELECT leasework.now() AS now

-- name: dashboard_recent_runs
-- The newest runs, whatever their status, so that every run is one click from the overview.
-- created_at: a run queued for later changed when it was enqueued, not at its due time
-- (pages.last_change, as /runs shows it).
SELECT id, kind, key, tenant, status, attempts, max_attempts, processed_units, total_units,
       created_at, queued_at, started_at, finished_at, left(coalesce(error, ''), 200) AS error
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

-- name: metrics_counters
-- Counters that only go up: what the runs in the table count now plus what runs that left it
-- (pruned, deleted) or were retried handed over to leasework.counters before they did (the
-- runs_deleted trigger, retry_runs). Per kind: `finished` by outcome, the run-duration and
-- queue-wait histograms of finished runs (`duration` and `wait` per bucket, not cumulative, and
-- their `_sum`; the wait is the last attempt's, from due to start), `lost` leases by outcome
-- (expired: the lease ran out; crashed: the supervisor saw the worker die), how many of those
-- were `reclaimed` (the run was claimed again after the lost attempt), and `attempts`, every ended
-- attempt by outcome (leasework.attempt_outcome: each history entry, and a succeeded run's
-- success, which its row records), and `debounced`, the enqueues a debounce merged into a
-- pending run (its debounce_count past the first). One scan of the table per scrape, as
-- status_counts makes; only the rows with a history have it expanded. A history that is not an array counts nothing, and an
-- entry's started_at that is no timestamp no reclaim (leasework.try_instant): the worker role can
-- write any jsonb there, and a scrape must not fail on it.
WITH finished AS MATERIALIZED (
    SELECT kind, status, finished_at IS NOT NULL AS ended, debounce_count - 1 AS debounced,
           CASE WHEN started_at IS NOT NULL
                THEN greatest(extract(epoch FROM finished_at - started_at), 0)::float8 END AS took,
           CASE WHEN started_at IS NOT NULL
                THEN greatest(extract(epoch FROM started_at - queued_at), 0)::float8 END AS waited,
           -- A success is recorded by the row, not its history (leasework.run_history).
           status = 'succeeded'
               AND (CASE WHEN jsonb_typeof(history) = 'array' THEN history -> -1 ->> 'outcome' END)
                   IS DISTINCT FROM 'succeeded' AS success
      FROM leasework.runs
     WHERE finished_at IS NOT NULL OR debounce_count > 1
), entries AS MATERIALIZED (
    SELECT r.kind, r.started_at, e.entry
      FROM leasework.runs r
     CROSS JOIN LATERAL jsonb_array_elements(
         CASE WHEN jsonb_typeof(r.history) = 'array' THEN r.history ELSE '[]' END) AS e(entry)
     WHERE r.history <> '[]'::jsonb AND jsonb_typeof(e.entry) = 'object'
), lost AS MATERIALIZED (
    SELECT kind, entry ->> 'outcome' AS outcome,
           coalesce(started_at > leasework.try_instant(entry ->> 'started_at'), false)
               AS reclaimed
      FROM entries
     WHERE entry ->> 'outcome' IN ('expired', 'crashed')
), counted AS (
    SELECT kind, 'finished' AS name, status AS label, count(*)::float8 AS value
      FROM finished WHERE ended GROUP BY 1, 3
    UNION ALL
    SELECT kind, 'duration', leasework.duration_bucket(took), count(*)
      FROM finished WHERE ended AND took IS NOT NULL GROUP BY 1, 3
    UNION ALL
    SELECT kind, 'duration_sum', '', sum(took)
      FROM finished WHERE ended AND took IS NOT NULL GROUP BY 1
    UNION ALL
    SELECT kind, 'wait', leasework.duration_bucket(waited), count(*)
      FROM finished WHERE ended AND waited IS NOT NULL GROUP BY 1, 3
    UNION ALL
    SELECT kind, 'wait_sum', '', sum(waited)
      FROM finished WHERE ended AND waited IS NOT NULL GROUP BY 1
    UNION ALL
    SELECT kind, 'debounced', '', sum(debounced) FROM finished WHERE debounced > 0 GROUP BY 1
    UNION ALL
    SELECT kind, 'lost', outcome, count(*) FROM lost GROUP BY 1, 3
    UNION ALL
    SELECT kind, 'reclaimed', '', count(*) FROM lost WHERE reclaimed GROUP BY 1
    UNION ALL
    SELECT kind, 'attempts', leasework.attempt_outcome(entry ->> 'outcome'), count(*)
      FROM entries GROUP BY 1, 3
    UNION ALL
    SELECT kind, 'attempts', 'succeeded', count(*) FROM finished WHERE success GROUP BY 1
    UNION ALL
    SELECT kind, name, label, value FROM leasework.counters
)
SELECT kind, name, label, sum(value)::float8 AS value
  FROM counted
 GROUP BY 1, 2, 3
 ORDER BY 1, 2, 3

-- name: metrics_pools
-- Live workers by pool (config `pools`; NULL: the worker has none), and how many are busy.
SELECT pool, count(*)::bigint AS alive, count(current_run)::bigint AS busy
  FROM leasework.workers
 WHERE stopped_at IS NULL AND heartbeat_at > leasework.now() - make_interval(secs => %(stale)s)
 GROUP BY pool
 ORDER BY pool NULLS FIRST

-- name: metrics_group_full
-- Per kind, its due queued runs held back now by their group (docs/flow-control.md, groups):
-- not exclusive, with a tenant and a group whose other runs holding a live lease are as many as
-- the kind's group_limit (1 when it sets none), as the claim's limiter counts them; a tenant's
-- run of a kind rated per tenant whose window is full is left to that reason (leasework_rate_
-- limited's rate_limited), and one whose tenant has an exclusive run holding a lease to that. Read at the scrape, nothing written at the claim: the groups holding
-- live leases first (running runs are few), then the due runs of those groups only
-- (runs_queued_by_tenant).
WITH busy AS MATERIALIZED (
    SELECT o.tenant, o."group", count(*) AS n
      FROM leasework.runs o
     WHERE o.status = 'running' AND o.lease_expires_at >= leasework.now()
       AND o.tenant IS NOT NULL AND o."group" IS NOT NULL
     GROUP BY o.tenant, o."group"
)
SELECT r.kind, count(*)::bigint AS n
  FROM busy b
  JOIN leasework.runs r ON r.tenant = b.tenant AND r."group" = b."group"
  LEFT JOIN leasework.kind_limits l ON l.kind = r.kind
 WHERE r.status = 'queued' AND r.queued_at <= leasework.now() AND NOT r.exclusive
   AND b.n >= coalesce(l.group_limit, 1)
   AND NOT EXISTS (SELECT 1 FROM leasework.runs x
                    WHERE x.tenant = r.tenant AND x.status = 'running' AND x.exclusive
                      AND x.lease_expires_at >= leasework.now())
   AND (l.rate_per IS NULL OR l.rate_count IS NULL
        OR leasework.tenant_rate_open(r.kind, r.tenant, r."group"))
 GROUP BY r.kind

-- name: metrics_duration_buckets
SELECT leasework.duration_buckets() AS buckets

-- name: dashboard_lock_run
-- The cancel action: the run's status, locked for the length of the action's transaction, so
-- that a finished run is refused rather than reported as cancelled.
SELECT status, cancel_requested_at FROM leasework.runs WHERE id = %(id)s FOR UPDATE

-- name: dashboard_chart
-- The overview's charts: per minute of the last hour (minute 0 starts 59 minutes before the
-- current one), per kind (those of %(kinds)s; every other kind as `other`): `done`, runs that
-- succeeded in that minute; `failed`, attempts that ended failed in it (raised, Retry, Partial,
-- timed out, lease lost: each a history entry); `depth`, the runs queued and due at the minute's
-- end (the last minute: now), from each run's queued_at (its latest due time) to when it started,
-- ended unstarted, or now. Computed from the runs still in the table (pruned ones are gone; a
-- retried run counts from its latest due time): the queued and running runs (their partial
-- indexes) and those finished within the hour (runs_finished_at). A run's wait is grouped into
-- its first and last minute before the minutes are counted, so the cost is the runs read, not
-- runs times minutes.
WITH b AS (
    SELECT leasework.now() AS now,
           date_trunc('minute', leasework.now()) - interval '59 minutes' AS start
), recent AS MATERIALIZED (
    SELECT CASE WHEN r.kind = ANY(%(kinds)s::text[]) THEN r.kind ELSE 'other' END AS kind,
           r.status, greatest(r.queued_at, b.start - interval '1 minute') AS queued_at,
           r.started_at, r.finished_at, r.history
      FROM leasework.runs r, b
     WHERE r.status IN ('queued', 'running') OR r.finished_at >= b.start
), done AS (
    SELECT kind, floor(extract(epoch FROM finished_at - b.start) / 60)::int AS minute,
           count(*) AS n
      FROM recent, b
     WHERE status = 'succeeded' AND finished_at >= b.start AND finished_at <= b.now
     GROUP BY 1, 2
), failures AS (
    SELECT r.kind, leasework.try_instant(e.entry ->> 'ended_at') AS ended
      FROM recent r
     CROSS JOIN LATERAL jsonb_array_elements(
         CASE WHEN jsonb_typeof(r.history) = 'array' THEN r.history ELSE '[]' END) AS e(entry)
     WHERE r.history <> '[]'::jsonb AND jsonb_typeof(e.entry) = 'object'
       AND e.entry ->> 'outcome' IN ('failed', 'retry', 'partial', 'timeout', 'expired', 'crashed')
), failed AS (
    SELECT kind, floor(extract(epoch FROM ended - b.start) / 60)::int AS minute, count(*) AS n
      FROM failures, b
     WHERE ended >= b.start AND ended <= b.now
     GROUP BY 1, 2
), waits AS (
    SELECT kind, queued_at,
           CASE WHEN status = 'queued' THEN 'infinity'::timestamptz
                WHEN started_at >= queued_at THEN started_at
                ELSE coalesce(finished_at, 'infinity'::timestamptz) END AS until
      FROM recent
), spans AS (
    -- The minutes m whose sample, start + (m + 1) minutes (the last: now), is in [queued_at, until).
    SELECT kind,
           greatest(0, ceil(extract(epoch FROM queued_at - b.start) / 60 - 1))::int AS first,
           CASE WHEN until > b.now THEN 59
                ELSE least(58, ceil(extract(epoch FROM until - b.start) / 60 - 1)::int - 1) END
               AS last,
           count(*) AS n
      FROM waits, b
     WHERE queued_at <= b.now AND until > b.start
     GROUP BY 1, 2, 3
), depth AS (
    SELECT s.kind, m.minute, sum(s.n) AS n
      FROM spans s
      JOIN generate_series(0, 59) AS m(minute) ON m.minute BETWEEN s.first AND s.last
     GROUP BY 1, 2
)
SELECT 'done' AS what, kind, minute, n::bigint AS n FROM done WHERE minute BETWEEN 0 AND 59
UNION ALL
SELECT 'failed', kind, minute, n::bigint FROM failed WHERE minute BETWEEN 0 AND 59
UNION ALL
SELECT 'depth', kind, minute, n::bigint FROM depth
 ORDER BY 1, 2, 3
