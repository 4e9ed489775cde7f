-- Migration 0025: what /metrics counts (every ended attempt by outcome, the queue wait of
-- finished runs) kept across pruning and retries by leasework.counters, and the enqueuing
-- span's traceparent kept in the run for the worker's span (README "Metrics", "Tracing").
-- Self-contained and idempotent: ADD COLUMN IF NOT EXISTS, CREATE OR REPLACE.

ALTER TABLE leasework.runs ADD COLUMN IF NOT EXISTS traceparent text;

-- An ended attempt's outcome as /metrics counts it (leasework_attempts_total), from its history
-- entry's `outcome` (leasework.history_entry): fixed once the entry is written, so the counter
-- only goes up. `failed` is an attempt that raised (or a Fail, or a Partial), whether or not its
-- run was retried; `retried` is one whose handler raised Retry; expired and crashed leases are
-- `lost`. (Migration 0025.)
CREATE OR REPLACE FUNCTION leasework.attempt_outcome(outcome text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE outcome
               WHEN 'succeeded' THEN 'succeeded'
               WHEN 'retry' THEN 'retried'
               WHEN 'timeout' THEN 'timed_out'
               WHEN 'cancelled' THEN 'cancelled'
               WHEN 'released' THEN 'released'
               WHEN 'snoozed' THEN 'snoozed'
               WHEN 'expired' THEN 'lost'
               WHEN 'crashed' THEN 'lost'
               ELSE 'failed' END;
$$;

-- Adds what the runs in `gone` (a jsonb array of runs rows) counted to leasework.counters: their
-- finish (terminal runs: outcome, duration and queue wait) and, with `losses` (their history
-- leaves too), the lost leases in their history, how many of those were reclaimed, every
-- ended attempt by outcome (leasework.attempt_outcome) and the enqueues a debounce merged into
-- them. Called by the delete trigger and by retry_runs (tally_retried, which keeps the row's
-- history and debounce_count: `losses` false).
CREATE OR REPLACE FUNCTION leasework.add_to_counters(gone jsonb, losses boolean) RETURNS void
LANGUAGE sql VOLATILE AS $$
    WITH g AS (
        SELECT * FROM jsonb_to_recordset(gone) AS x(kind text, status text, attempts int,
                   queued_at timestamptz, started_at timestamptz, finished_at timestamptz,
                   history jsonb, debounce_count int)
    ), terminal AS (
        SELECT kind, status, extract(epoch FROM finished_at - started_at)::float8 AS took,
               extract(epoch FROM started_at - queued_at)::float8 AS waited
          FROM g WHERE status IN ('succeeded', 'partial', 'failed', 'cancelled')
    ), entries AS (
        SELECT g.kind, g.started_at, e.entry
          FROM g CROSS JOIN LATERAL jsonb_array_elements(
                   CASE WHEN jsonb_typeof(g.history) = 'array' THEN g.history ELSE '[]' END
               ) AS e(entry)
         WHERE losses AND jsonb_typeof(e.entry) = 'object'
    ), lost AS (
        SELECT kind, entry ->> 'outcome' AS outcome,
               coalesce(started_at > leasework.try_instant(entry ->> 'started_at'), false)
                   AS reclaimed
          FROM entries
         WHERE entry ->> 'outcome' IN ('expired', 'crashed')
    ), added AS (
        SELECT kind, 'finished' AS name, status AS label, 1::float8 AS value FROM terminal
        UNION ALL
        SELECT kind, 'duration', leasework.duration_bucket(greatest(took, 0)), 1
          FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'duration_sum', '', greatest(took, 0) FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'wait', leasework.duration_bucket(greatest(waited, 0)), 1
          FROM terminal WHERE waited IS NOT NULL
        UNION ALL
        SELECT kind, 'wait_sum', '', greatest(waited, 0) FROM terminal WHERE waited IS NOT NULL
        UNION ALL
        SELECT kind, 'lost', outcome, 1 FROM lost
        UNION ALL
        SELECT kind, 'reclaimed', '', 1 FROM lost WHERE reclaimed
        UNION ALL
        SELECT kind, 'attempts', leasework.attempt_outcome(entry ->> 'outcome'), 1 FROM entries
        UNION ALL
        -- A success is recorded by the row, not its history (leasework.run_history).
        SELECT kind, 'attempts', 'succeeded', 1 FROM g
         WHERE losses AND status = 'succeeded'
           AND (CASE WHEN jsonb_typeof(history) = 'array' THEN history -> -1 ->> 'outcome' END)
               IS DISTINCT FROM 'succeeded'
        UNION ALL
        SELECT kind, 'debounced', '', debounce_count - 1 FROM g
         WHERE losses AND debounce_count > 1
    )
    INSERT INTO leasework.counters AS c (kind, name, label, value)
    SELECT kind, name, label, sum(value) FROM added GROUP BY 1, 2, 3
    ON CONFLICT (kind, name, label) DO UPDATE SET value = c.value + EXCLUDED.value;
$$;

-- Deleted runs (pruning, `leasework delete`, or the user's own DELETE) hand their counts over to
-- leasework.counters in the same transaction. Statement-level: one call per DELETE.
CREATE OR REPLACE FUNCTION leasework.runs_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasework.add_to_counters(
        (SELECT coalesce(jsonb_agg(jsonb_build_object(
                    'kind', kind, 'status', status, 'attempts', attempts,
                    'queued_at', queued_at, 'started_at', started_at,
                    'finished_at', finished_at, 'history', history,
                    'debounce_count', debounce_count)),
                '[]'::jsonb)
           FROM gone),
        true);
    RETURN NULL;
END
$$;

-- Tracing (migration 0025; README "Tracing"): the enqueuing span's W3C traceparent, written into
-- a run the enqueue just made, only when the enqueuing process has an active span (so an enqueue
-- without tracing sends nothing more, and leasework.enqueue is unchanged). The worker reads it
-- back only when its own tracing is on. SECURITY DEFINER, so that the enqueue role, which has no
-- privilege on the tables, may call it: it sets a traceparent of the right shape once, on a
-- queued or waiting run that has none, and nothing else.
CREATE OR REPLACE FUNCTION leasework.trace_run(run_id bigint, traceparent text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF trace_run.traceparent IS NULL
       OR trace_run.traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'traceparent %s is not valid: use the W3C form 00-<32 hex>-<16 hex>-<2 hex>',
            left(trace_run.traceparent, 80));
    END IF;
    UPDATE leasework.runs r SET traceparent = trace_run.traceparent
     WHERE r.id = trace_run.run_id AND r.status IN ('queued', 'waiting')
       AND r.traceparent IS NULL;
    RETURN FOUND;
END
$$;
REVOKE EXECUTE ON FUNCTION leasework.trace_run(bigint, text) FROM PUBLIC;
