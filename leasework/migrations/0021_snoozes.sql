-- Migration 0021: handler outcomes Fail and Snooze (issue 31, item 4).
-- `runs.snoozes` counts a run's snoozes (snooze_run, leasework/leases/lease.sql: requeued without
-- charging the attempt, at most max_snoozes times); NULL for a run that never snoozed, so adding
-- it rewrites nothing and a run that never snoozes stores nothing for it.
-- leasework.claimed_history, which the claim calls on a reclaimed run, knew whether the dead
-- attempt was recorded already (by the supervisor's fast release) by the last entry's attempt
-- number. A release, and now a snooze, gives the attempt back, so the next attempt has the number
-- of the entry before it: its death went unrecorded (nothing in the history, no lost lease in
-- the metrics). Now the last entry is that attempt's when it carries that attempt's owner, the
-- token unique to the claim (expire_and_promote asks the same).
-- CREATE OR REPLACE keeps owners and grants. Idempotent.

ALTER TABLE leasework.runs ADD COLUMN IF NOT EXISTS snoozes leasework.attempt_count;

CREATE OR REPLACE FUNCTION leasework.claimed_history(r leasework.runs) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
               WHEN r.status = 'running'
                    AND (r.history -> -1 ->> 'owner') IS DISTINCT FROM r.lease_owner::text
               THEN r.history || jsonb_build_array(leasework.history_entry(
                   r.attempts, r.lease_owner, r.lease_worker, r.started_at, r.lease_expires_at,
                   'expired', 'lease expired'))
               ELSE r.history
           END;
$$;
