-- Migration 0006: leasework.history_entry(), the one builder of a runs.history entry, which the
-- statements of leasework/workers/lease.sql call instead of each writing the jsonb_build_object
-- out (why it is STABLE and inlined: schema.sql, beside it). Idempotent.
CREATE OR REPLACE FUNCTION leasework.history_entry(
    attempt integer, owner uuid, worker text, started_at timestamptz, ended_at timestamptz,
    outcome text, error text) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT jsonb_build_object('attempt', attempt, 'owner', owner, 'worker', worker,
                              'started_at', started_at, 'ended_at', ended_at,
                              'outcome', outcome, 'error', error);
$$;
