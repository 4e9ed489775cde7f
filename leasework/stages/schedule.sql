-- The schedule stage: enqueue due periodic tasks (stages/schedule.py; a family's own schedule,
-- e.g. connection syncs, lives with the family).
-- The no-backlog rule lives here: next_run_at is always set from now, never from its old
-- value, so six hours down on a 15-minute schedule gives one run, not twenty-four.

-- name: schedules_now
SELECT leasework.now()

-- name: upsert_schedule
-- A worker registers its app's periodic tasks on start. An unchanged schedule keeps its
-- next_run_at (a restart neither fires early nor backfills); a changed one starts over from now.
INSERT INTO leasework.schedules (name, kind, every_seconds, cron, timezone, next_run_at)
VALUES (%(name)s, %(kind)s, %(every)s, %(cron)s, %(tz)s, %(first)s)
ON CONFLICT (name) DO UPDATE
   SET kind = EXCLUDED.kind,
       every_seconds = EXCLUDED.every_seconds,
       cron = EXCLUDED.cron,
       timezone = EXCLUDED.timezone,
       next_run_at = CASE
           WHEN (schedules.kind, schedules.every_seconds, schedules.cron, schedules.timezone)
                IS DISTINCT FROM
                (EXCLUDED.kind, EXCLUDED.every_seconds, EXCLUDED.cron, EXCLUDED.timezone)
           THEN EXCLUDED.next_run_at
           ELSE schedules.next_run_at END,
       updated_at = CASE
           WHEN (schedules.kind, schedules.every_seconds, schedules.cron, schedules.timezone)
                IS DISTINCT FROM
                (EXCLUDED.kind, EXCLUDED.every_seconds, EXCLUDED.cron, EXCLUDED.timezone)
           THEN now()
           ELSE schedules.updated_at END

-- name: lock_due_schedules
-- A bounded batch of this app's due schedules, locked (SKIP LOCKED) until the caller has
-- enqueued each and advanced its next_run_at in the same transaction.
SELECT name, kind, next_run_at, leasework.now() AS now
  FROM leasework.schedules
 WHERE next_run_at <= leasework.now()
   AND name = ANY(%(names)s)
 ORDER BY next_run_at, name
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- name: next_schedule
-- Seconds until the first of this app's schedules is due (NULL: it has none): how long an idle
-- worker may sleep as far as they go (workers/idle.py).
SELECT extract(epoch FROM min(next_run_at) - leasework.now())::float8
  FROM leasework.schedules
 WHERE name = ANY(%(names)s)

-- name: advance_schedule
UPDATE leasework.schedules
   SET next_run_at = %(next)s,
       last_enqueued_at = leasework.now(),
       last_run_id = %(run_id)s
 WHERE name = %(name)s

-- name: list_schedules
-- overdue_seconds: how long past its next_run_at a schedule is. Any running worker whose app has
-- the task enqueues it within a poll; one overdue for long is a task no running worker has (its
-- workers are down, or it was removed from the code: the row then stays, and is never enqueued).
-- A next_run_at of -infinity is overdue for ever, one of infinity never; neither is subtracted
-- (an error in Postgres).
SELECT s.name, s.kind, s.every_seconds, s.cron, s.timezone, s.next_run_at, s.last_enqueued_at,
       s.last_run_id, r.status AS last_run_status,
       CASE WHEN isfinite(s.next_run_at)
            THEN greatest(extract(epoch FROM leasework.now() - s.next_run_at), 0)::float8
            WHEN s.next_run_at < leasework.now() THEN 'Infinity'::float8
            ELSE 0 END AS overdue_seconds
  FROM leasework.schedules s
  LEFT JOIN leasework.runs r ON r.id = s.last_run_id
 ORDER BY s.next_run_at, s.name
