-- Migration 0013: a success no longer appends its entry to runs.history; the row records that
-- attempt (attempts, started_at, finished_at, and lease_worker, which the seal now keeps), and
-- leasework.run_history() gives the history with it, as every reader shows it (schema.sql says
-- why). Runs sealed before keep the entry they have; run_history() adds none to them. Idempotent.
CREATE OR REPLACE FUNCTION leasework.run_history(r leasework.runs) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
               WHEN r.status = 'succeeded'
                    AND (r.history -> -1 ->> 'outcome') IS DISTINCT FROM 'succeeded'
               THEN r.history || jsonb_build_array(leasework.history_entry(
                   r.attempts, NULL, r.lease_worker, r.started_at, r.finished_at, 'succeeded',
                   NULL))
               ELSE r.history
           END;
$$;
