-- Migration 0020: the engine survives a history of any shape, which the worker role can write
-- (a string, an object, an entry whose attempt is no integer or whose started_at is no
-- timestamp). leasework.claimed_history, which the claim calls on a reclaimed run, counted the
-- last entry's attempt with an unguarded cast: an attempt of "x", 1.5 or 1e30 made every claim
-- that reached the run fail. Now only a JSON number counts (as numeric: no range to overflow),
-- anything else as 0, as in expire_and_promote. leasework.add_to_counters, run by the delete
-- trigger, read every history as an array and every started_at as a timestamp: one such row made
-- each prune batch and `leasework delete` that included it fail. Now a history that is no array
-- counts no loss, and a started_at that is no timestamp no reclaim (as /metrics reads them).
-- leasework.next_due_at, read by an idle worker to know how long it may sleep, saw only runs due
-- in the future: a run due now that the claim could not take (a row an operator holds with
-- SELECT ... FOR UPDATE, a tenant held back by the limiter) counted for nothing, and the idle
-- worker slept until a NOTIFY or idle_poll_max (30 s) after the row was free again. Now the first
-- queued_at of each priority counts, due or not: such a run keeps idle workers polling every
-- poll_interval, as workers/idle.py intends for work due yet not taken.
-- CREATE OR REPLACE keeps owners and grants. Idempotent.

CREATE OR REPLACE FUNCTION leasework.claimed_history(r leasework.runs) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
               WHEN r.status = 'running'
                    AND coalesce(CASE WHEN jsonb_typeof(r.history -> -1 -> 'attempt') = 'number'
                                      THEN (r.history -> -1 -> 'attempt')::numeric END,
                                 0) < r.attempts
               THEN r.history || jsonb_build_array(leasework.history_entry(
                   r.attempts, r.lease_owner, r.lease_worker, r.started_at, r.lease_expires_at,
                   'expired', 'lease expired'))
               ELSE r.history
           END;
$$;

CREATE OR REPLACE FUNCTION leasework.add_to_counters(gone jsonb, losses boolean) RETURNS void
LANGUAGE sql VOLATILE AS $$
    WITH g AS (
        SELECT * FROM jsonb_to_recordset(gone) AS x(kind text, status text, attempts int,
                   started_at timestamptz, finished_at timestamptz, history jsonb)
    ), terminal AS (
        SELECT kind, status, extract(epoch FROM finished_at - started_at)::float8 AS took
          FROM g WHERE status IN ('succeeded', 'partial', 'failed', 'cancelled')
    ), lost AS (
        SELECT g.kind, e.entry ->> 'outcome' AS outcome,
               coalesce(g.started_at > leasework.try_instant(e.entry ->> 'started_at'), false)
                   AS reclaimed
          FROM g CROSS JOIN LATERAL jsonb_array_elements(
                   CASE WHEN jsonb_typeof(g.history) = 'array' THEN g.history ELSE '[]' END
               ) AS e(entry)
         WHERE losses AND jsonb_typeof(e.entry) = 'object'
           AND e.entry ->> 'outcome' IN ('expired', 'crashed')
    ), added AS (
        SELECT kind, 'finished' AS name, status AS label, 1::float8 AS value FROM terminal
        UNION ALL
        SELECT kind, 'duration', leasework.duration_bucket(greatest(took, 0)), 1
          FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'duration_sum', '', greatest(took, 0) FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'lost', outcome, 1 FROM lost
        UNION ALL
        SELECT kind, 'reclaimed', '', 1 FROM lost WHERE reclaimed
    )
    INSERT INTO leasework.counters AS c (kind, name, label, value)
    SELECT kind, name, label, sum(value) FROM added GROUP BY 1, 2, 3
    ON CONFLICT (kind, name, label) DO UPDATE SET value = c.value + EXCLUDED.value;
$$;

CREATE OR REPLACE FUNCTION leasework.next_due_at(kind text, tenant text) RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    p integer;
    q timestamptz;
    best timestamptz;
BEGIN
    IF next_due_at.tenant IS NULL THEN
        SELECT min(r.priority) INTO p FROM leasework.runs r
         WHERE r.kind = next_due_at.kind AND r.tenant IS NULL AND r.status = 'queued';
        WHILE p IS NOT NULL LOOP
            SELECT min(r.queued_at) INTO q FROM leasework.runs r
             WHERE r.kind = next_due_at.kind AND r.tenant IS NULL AND r.status = 'queued'
               AND r.priority = p;
            best := least(best, q);
            SELECT min(r.priority) INTO p FROM leasework.runs r
             WHERE r.kind = next_due_at.kind AND r.tenant IS NULL AND r.status = 'queued'
               AND r.priority > p;
        END LOOP;
    ELSE
        SELECT min(r.priority) INTO p FROM leasework.runs r
         WHERE r.tenant = next_due_at.tenant AND r.kind = next_due_at.kind
           AND r.status = 'queued';
        WHILE p IS NOT NULL LOOP
            SELECT min(r.queued_at) INTO q FROM leasework.runs r
             WHERE r.tenant = next_due_at.tenant AND r.kind = next_due_at.kind
               AND r.status = 'queued' AND r.priority = p;
            best := least(best, q);
            SELECT min(r.priority) INTO p FROM leasework.runs r
             WHERE r.tenant = next_due_at.tenant AND r.kind = next_due_at.kind
               AND r.status = 'queued' AND r.priority > p;
        END LOOP;
    END IF;
    RETURN best;
END
$$;
