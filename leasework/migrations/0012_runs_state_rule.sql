-- Migration 0012: the three table CHECKs on a run's status (runs_status_valid,
-- runs_running_has_lease, runs_terminal_has_finished_at) become one, runs_state_valid, whose rule
-- is the PL/pgSQL function leasework.run_state_valid: the same rule, compiled once per session
-- instead of once per statement and updated table (schema.sql says why). Adding the CHECK checks
-- every existing row once, under the migration's lock; rows the three allowed, it allows.

CREATE OR REPLACE FUNCTION leasework.run_state_valid(
    status text, lease_owner uuid, lease_expires_at timestamptz, finished_at timestamptz)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (
               '{waiting,queued,running,succeeded,partial,failed,cancelled}'::pg_catalog.text[])
       AND (status OPERATOR(pg_catalog.=) 'running')
           OPERATOR(pg_catalog.=) (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)
       AND (status OPERATOR(pg_catalog.=) ANY (
               '{succeeded,partial,failed,cancelled}'::pg_catalog.text[]))
           OPERATOR(pg_catalog.=) (finished_at IS NOT NULL);
END
$$;

ALTER TABLE leasework.runs
    DROP CONSTRAINT IF EXISTS runs_status_valid,
    DROP CONSTRAINT IF EXISTS runs_running_has_lease,
    DROP CONSTRAINT IF EXISTS runs_terminal_has_finished_at,
    DROP CONSTRAINT IF EXISTS runs_state_valid,
    ADD CONSTRAINT runs_state_valid CHECK (
        leasework.run_state_valid(status, lease_owner, lease_expires_at, finished_at));
