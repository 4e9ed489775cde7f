-- Migration 0027: waiting for a run's result and durable steps (README "Workflows"). A run
-- someone waits for (`handle.wait`, `app.wait`) is marked by leasework.run_outcome with
-- notify_ended, and only such a run NOTIFYs `leasework_ended` with its id when it ends (the
-- trigger runs_ended_notify: its WHEN clause is evaluated as the event would be queued, so an
-- ordinary run's seal queues nothing and pays no NOTIFY). A handler's durable steps
-- (`ctx.step(name, fn)`) are rows of leasework.run_steps, written once per run and step under
-- the lease's fence, and deleted with their run (leasework.runs_deleted). Self-contained and
-- idempotent: ADD COLUMN IF NOT EXISTS, CREATE ... IF NOT EXISTS, CREATE OR REPLACE.

-- NULL for a run nobody waited for (nothing stored); true once a waiter asked for its end.
ALTER TABLE leasework.runs ADD COLUMN IF NOT EXISTS notify_ended boolean;

CREATE OR REPLACE FUNCTION leasework.run_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('leasework_ended', NEW.id::text);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS runs_ended_notify ON leasework.runs;
CREATE TRIGGER runs_ended_notify AFTER UPDATE OF status ON leasework.runs
    FOR EACH ROW
    WHEN (NEW.notify_ended AND NEW.status IN ('succeeded', 'partial', 'failed', 'cancelled'))
    EXECUTE FUNCTION leasework.run_ended();

-- A run's status, result and error, for a waiter (the enqueue role too: SECURITY DEFINER, it reads
-- no table). With `watch`, a live run is first marked notify_ended, so that its end NOTIFYs
-- `leasework_ended`; the read after that mark sees any end committed before it (a seal that was
-- under way is waited for by the UPDATE, which then finds the run ended and writes nothing). A
-- row another session holds longer than lock_timeout (an enqueue merging a debounce into it, in
-- its caller's transaction) is left unmarked rather than waited for: `watched` says whether the
-- run is marked, and a waiter that finds it is not reads it again a little later. No row: no such
-- run (or not yet committed).
CREATE OR REPLACE FUNCTION leasework.run_outcome(run_id bigint, watch boolean)
RETURNS TABLE (status text, result jsonb, error text, watched boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms' AS $$
BEGIN
    IF watch THEN
        BEGIN
            UPDATE leasework.runs r
               SET notify_ended = true
             WHERE r.id = run_outcome.run_id AND r.notify_ended IS NOT TRUE
               AND r.status IN ('waiting', 'queued', 'running');
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- not marked: the waiter polls, and asks again
        END;
    END IF;
    RETURN QUERY
        SELECT r.status, r.result, r.error, coalesce(r.notify_ended, false)
          FROM leasework.runs r WHERE r.id = run_outcome.run_id;
END
$$;

REVOKE EXECUTE ON FUNCTION leasework.run_outcome(bigint, boolean) FROM PUBLIC;

-- A handler's durable steps: the value `ctx.step(name, fn)` returned, stored once per run and
-- name (the primary key) by the attempt that called fn (`attempt`), inside the lease's fence
-- (store_step, leasework/leases/lease.sql); a later attempt reads it instead of calling fn. No
-- foreign key: an FK would make every TRUNCATE of runs name this table too, and its check would
-- lock the run row; store_step locks and checks the run itself, and leasework.runs_deleted deletes
-- a deleted run's steps.
CREATE TABLE IF NOT EXISTS leasework.run_steps (
    run_id     bigint NOT NULL,
    name       text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    value      jsonb NOT NULL,
    attempt    integer NOT NULL,
    created_at leasework.instant NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, name)  -- load_steps, store_step, and the delete of runs_deleted
);

-- Deleted runs (pruning, `leasework delete`, or the user's own DELETE) hand their counts over to
-- leasework.counters in the same transaction, and take their durable steps with them.
-- Statement-level: one call per DELETE.
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
    DELETE FROM leasework.run_deps d USING gone WHERE d.child = gone.id;
    DELETE FROM leasework.run_steps s USING gone g WHERE s.run_id = g.id;
    RETURN NULL;
END
$$;
