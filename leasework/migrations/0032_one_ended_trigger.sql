-- Migration 0032: one trigger on a run's end in place of two (issue 30, what a job costs the
-- server). runs_parent_ended (migration 0026) and runs_ended_notify (0027) were each an AFTER ROW
-- UPDATE OF status trigger whose WHEN held the ended states' text arrays; Postgres reads, parses
-- and compiles a trigger's WHEN once per statement that updates runs, for every run, and the two
-- were 7 % of a one-at-a-time job's server CPU. leasework.run_ended now does both jobs, for the
-- runs whose WHEN (`has_dependents OR notify_ended`, two column reads) says so; the events and
-- their rules are unchanged. Self-contained and idempotent: CREATE OR REPLACE, DROP ... IF EXISTS.

-- A run that something waits for ended, or one a waiter watches (leasework.run_outcome marks it
-- notify_ended; migration 0027): the one trigger on a run's end (migration 0032). A run with
-- dependents records its end for the deps stage (run_deps_ended) and wakes it, once, as it
-- leaves the live states; a watched run NOTIFYs `leasework_ended` with its id whenever it is
-- written ended. Both at commit, as every NOTIFY. SECURITY DEFINER: whoever ends the run (a
-- worker, leasework.cancel for the enqueue role, an operator) need not write run_deps_ended
-- itself. Called only for such runs (the trigger's WHEN), at each write of their status (a claim
-- too: it returns at once).
CREATE OR REPLACE FUNCTION leasework.run_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled') THEN
        RETURN NULL;
    END IF;
    IF NEW.has_dependents AND OLD.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled') THEN
        INSERT INTO leasework.run_deps_ended (parent) VALUES (NEW.id);
        PERFORM pg_notify('leasework', 'leasework:deps');
    END IF;
    IF NEW.notify_ended THEN
        PERFORM pg_notify('leasework_ended', NEW.id::text);
    END IF;
    RETURN NULL;
END
$$;

-- AFTER, with a WHEN of two column reads: Postgres evaluates an AFTER ROW trigger's WHEN when it
-- would queue the event, so for a run nothing waits for and nobody watches (every run enqueued
-- without being waited on) no event is queued and no function runs. What it still costs such a
-- run, on every update of runs that sets status (claim, seal; a renewal sets none): the updated
-- row's old version fetched again (Postgres does it for any AFTER ROW UPDATE trigger before it
-- tests the column list and the WHEN) and the WHEN read from the catalog's text, parsed and
-- compiled, once per statement. Hence one trigger, not one per event, and a WHEN with no
-- constants: two triggers whose WHENs held the ended states' text arrays were 7 % of a
-- one-at-a-time job's server CPU, this one is 1.4 % (bench/README.md, issue 30, third pass). Not
-- BEFORE: a BEFORE trigger locks each row first whatever its WHEN says (bench/README.md,
-- issue 29).
DROP TRIGGER IF EXISTS runs_parent_ended ON leasework.runs;
DROP TRIGGER IF EXISTS runs_ended_notify ON leasework.runs;
DROP FUNCTION IF EXISTS leasework.parent_ended();
DROP TRIGGER IF EXISTS runs_ended ON leasework.runs;
CREATE TRIGGER runs_ended
    AFTER UPDATE OF status ON leasework.runs
    FOR EACH ROW WHEN (NEW.has_dependents OR NEW.notify_ended)
    EXECUTE FUNCTION leasework.run_ended();

REVOKE EXECUTE ON FUNCTION leasework.run_ended() FROM PUBLIC;
