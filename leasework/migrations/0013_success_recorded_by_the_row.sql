-- Migration 0013: a success no longer appends its entry to runs.history; the row records that
-- attempt (attempts, started_at, finished_at, and lease_worker, which the seal now keeps), and
-- leasework.run_history() gives the history with it, as every reader shows it (schema.sql says
-- why). Runs sealed before keep the entry they have; run_history() adds none to them. Idempotent.
CREATE OR REPLACE FUNCTION leasework.run_history(
    history jsonb, status text, attempts integer, worker text, started_at timestamptz,
    finished_at timestamptz) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
               WHEN status = 'succeeded'
                    AND (history -> -1 ->> 'outcome') IS DISTINCT FROM 'succeeded'
               THEN history || jsonb_build_array(leasework.history_entry(
                   attempts, NULL, worker, started_at, finished_at, 'succeeded', NULL))
               ELSE history
           END;
$$;
