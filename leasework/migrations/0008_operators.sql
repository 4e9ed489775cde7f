-- Migration 0008: paused kinds (leasework pause / resume, read by the claim) and the durable
-- counters behind /metrics (a table, its functions and the delete trigger that fills it; why:
-- schema.sql, beside them). Idempotent.
CREATE TABLE IF NOT EXISTS leasework.paused_kinds (
    kind      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);

-- Counters that only go up, for Prometheus: what finished runs and lost leases added before their
-- rows left the table (pruned or deleted) or were retried. /metrics adds the runs still in the
-- table to these, so pruning never lowers a count. Written only when runs are deleted (the
-- trigger below) or retried (retry_runs), never on the hot path. Serves: metrics_counters.
-- name: `finished` (label: the outcome), `duration` (label: a bucket's upper bound or +Inf,
-- not cumulative), `duration_sum` (label ''), `lost` (label: expired or crashed), `reclaimed`.
CREATE TABLE IF NOT EXISTS leasework.counters (
    kind  text NOT NULL,
    name  text NOT NULL,
    label text NOT NULL,
    value double precision NOT NULL,
    PRIMARY KEY (kind, name, label)
);

-- The upper bounds (seconds) of the run-duration histogram: one place, read by /metrics too.
CREATE OR REPLACE FUNCTION leasework.duration_buckets() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY[0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 10800]::float8[];
$$;

-- The histogram bucket (its upper bound as text, or +Inf) of a run that took `seconds`.
CREATE OR REPLACE FUNCTION leasework.duration_bucket(seconds float8) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce((SELECT min(b)::text FROM unnest(leasework.duration_buckets()) b
                      WHERE b >= seconds), '+Inf');
$$;

-- Adds what the runs in `gone` (a jsonb array of runs rows) counted to leasework.counters: their
-- finish (terminal runs: outcome and duration) and, with `losses`, the lost leases in their
-- history and how many of those were reclaimed. Called by the delete trigger and by retry_runs.
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
               g.started_at > (e.entry ->> 'started_at')::timestamptz AS reclaimed
          FROM g CROSS JOIN LATERAL jsonb_array_elements(g.history) AS e(entry)
         WHERE losses AND e.entry ->> 'outcome' IN ('expired', 'crashed')
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

-- Deleted runs (pruning, `leasework delete`, or the user's own DELETE) hand their counts over to
-- leasework.counters in the same transaction. Statement-level: one call per DELETE.
CREATE OR REPLACE FUNCTION leasework.runs_deleted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasework.add_to_counters(
        (SELECT coalesce(jsonb_agg(jsonb_build_object(
                    'kind', kind, 'status', status, 'attempts', attempts,
                    'started_at', started_at, 'finished_at', finished_at, 'history', history)),
                '[]'::jsonb)
           FROM gone),
        true);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS runs_deleted ON leasework.runs;
CREATE TRIGGER runs_deleted AFTER DELETE ON leasework.runs
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION leasework.runs_deleted();
