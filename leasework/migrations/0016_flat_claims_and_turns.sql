-- Migration 0016: a claim whose cost does not grow with the runs it cannot take, and tenants that
-- take turns.
--
-- The queued runs are indexed by kind first (runs without a tenant) and by tenant and kind
-- first (runs with one), so the claim reads one index range per kind it may take: the queued
-- runs of a paused kind, of another pool's kinds or of a kind nobody serves are never walked.
-- A tenant is one row of leasework.tenants with its place in the turns (`turn`, advanced by
-- 1 / `weight` for each run of its claimed) and the priority of its best queued run
-- (`priority`, NULL when it has none): the claim walks the tenants with queued runs in
-- (priority, turn) order and takes each one's best run, so one tenant's backlog delays another
-- tenant's next run by at most one turn per worker, and a tenant held back by the limiter costs
-- a probe, not a walk through its runs. Delayed runs are never walked either
-- (leasework.due_priority, next_due_at). docs/state-machine.md states the order rule. Idempotent.

ALTER TABLE leasework.tenants
    ADD COLUMN IF NOT EXISTS weight double precision NOT NULL DEFAULT 1,
    ADD COLUMN IF NOT EXISTS turn double precision NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS priority integer;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                    WHERE conname = 'tenants_weight_valid'
                      AND conrelid = 'leasework.tenants'::regclass) THEN
        ALTER TABLE leasework.tenants ADD CONSTRAINT tenants_weight_valid
            CHECK (weight >= 0.001 AND weight <= 1000);
    END IF;
END
$$;

DROP INDEX IF EXISTS leasework.runs_queued_tenanted;
DROP INDEX IF EXISTS leasework.runs_queued_untenanted;

CREATE INDEX IF NOT EXISTS runs_queued_by_kind
    ON leasework.runs (kind, priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NULL;

CREATE INDEX IF NOT EXISTS runs_queued_by_tenant
    ON leasework.runs (tenant, kind, priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL;

CREATE INDEX IF NOT EXISTS runs_queued_tenant_priority
    ON leasework.runs (tenant, priority)
    WHERE status = 'queued' AND tenant IS NOT NULL;

CREATE INDEX IF NOT EXISTS tenants_in_turn
    ON leasework.tenants (priority, turn, name)
    WHERE priority IS NOT NULL;

UPDATE leasework.tenants t
   SET priority = (SELECT min(r.priority) FROM leasework.runs r
                    WHERE r.tenant = t.name AND r.status = 'queued')
 WHERE t.priority IS DISTINCT FROM (SELECT min(r.priority) FROM leasework.runs r
                                     WHERE r.tenant = t.name AND r.status = 'queued');

CREATE OR REPLACE FUNCTION leasework.tenant_queued_run(tenant text, priority integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1819042147, hashtext(tenant_queued_run.tenant));
    UPDATE leasework.tenants t
       SET priority = least(t.priority, tenant_queued_run.priority),
           turn = CASE WHEN t.priority IS NOT NULL THEN t.turn
                       ELSE greatest(t.turn, coalesce(
                           (SELECT h.turn FROM leasework.tenants h
                             WHERE h.priority IS NOT NULL
                             ORDER BY h.priority, h.turn, h.name LIMIT 1), t.turn)) END
     WHERE t.name = tenant_queued_run.tenant
       AND (t.priority IS NULL OR t.priority > tenant_queued_run.priority);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION leasework.tenant_queued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasework.tenant_queued_run(NEW.tenant, NEW.priority);
    RETURN NEW;
END
$$;

-- On insert only: the four statements that make an existing tenanted run queued again
-- (requeue_run, release_run, expire_and_promote's promotion, operations' retry_runs) call
-- tenant_queued_run themselves. A row trigger on UPDATE cost every claim and seal: a BEFORE one
-- locks each row it updates first, whatever its WHEN says (a WAL record per job), an AFTER one
-- fetches each old row again (bench/README.md, issue 29).
DROP TRIGGER IF EXISTS runs_tenant_requeued ON leasework.runs;
DROP TRIGGER IF EXISTS runs_tenant_queued ON leasework.runs;
CREATE TRIGGER runs_tenant_queued
    BEFORE INSERT ON leasework.runs
    FOR EACH ROW WHEN (NEW.tenant IS NOT NULL AND NEW.status = 'queued')
    EXECUTE FUNCTION leasework.tenant_queued();

CREATE OR REPLACE FUNCTION leasework.tenant_served(tenant text, run_id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- One statement: the priority's sub-select runs only when the lock is ours.
    UPDATE leasework.tenants t
       SET turn = t.turn + 1 / t.weight,
           priority = CASE
               WHEN pg_try_advisory_xact_lock(1819042147, hashtext(tenant_served.tenant))
               THEN (SELECT min(r.priority) FROM leasework.runs r
                      WHERE r.tenant = tenant_served.tenant AND r.status = 'queued'
                        AND r.id <> tenant_served.run_id)
               ELSE t.priority END
     WHERE t.name = tenant_served.tenant;
    RETURN true;
END
$$;

-- The history a claim writes (claim_runs): a reclaimed run (`r` still running, its lease expired)
-- gets the entry of the attempt that died holding it, unless the supervisor's fast release
-- recorded it already; a queued run's is kept. A function so that claim_runs, with
-- finish_and_claim around it, stays within psycopg's parse cache (tests/unit/test_queries.py);
-- LANGUAGE sql and STABLE, so the planner inlines it.
CREATE OR REPLACE FUNCTION leasework.claimed_history(r leasework.runs) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
               WHEN r.status = 'running'
                    AND coalesce((r.history -> -1 ->> 'attempt')::int, 0) < r.attempts
               THEN r.history || jsonb_build_array(leasework.history_entry(
                   r.attempts, r.lease_owner, r.lease_worker, r.started_at, r.lease_expires_at,
                   'expired', 'lease expired'))
               ELSE r.history
           END;
$$;

-- The best priority at which a queued run of `kind` (and `tenant`: NULL for runs without one) is
-- due, NULL when none is. One index descent per priority present ahead of it: the claim reads
-- the kind's range at that priority alone, bounded by queued_at <= now(), so delayed runs (a
-- year of reminders, a retry's backoff) are never walked, at that priority or a better one.
-- STABLE: its queries read the calling statement's snapshot.
CREATE OR REPLACE FUNCTION leasework.due_priority(kind text, tenant text) RETURNS integer
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    p integer;
    q timestamptz;
BEGIN
    IF due_priority.tenant IS NULL THEN
        SELECT r.priority, r.queued_at INTO p, q
          FROM leasework.runs r
         WHERE r.kind = due_priority.kind AND r.tenant IS NULL AND r.status = 'queued'
         ORDER BY r.priority, r.queued_at, r.id LIMIT 1;
        WHILE q > leasework.now() LOOP
            SELECT r.priority, r.queued_at INTO p, q
              FROM leasework.runs r
             WHERE r.kind = due_priority.kind AND r.tenant IS NULL AND r.status = 'queued'
               AND r.priority > p
             ORDER BY r.priority, r.queued_at, r.id LIMIT 1;
        END LOOP;
    ELSE
        SELECT r.priority, r.queued_at INTO p, q
          FROM leasework.runs r
         WHERE r.tenant = due_priority.tenant AND r.kind = due_priority.kind
           AND r.status = 'queued'
         ORDER BY r.priority, r.queued_at, r.id LIMIT 1;
        WHILE q > leasework.now() LOOP
            SELECT r.priority, r.queued_at INTO p, q
              FROM leasework.runs r
             WHERE r.tenant = due_priority.tenant AND r.kind = due_priority.kind
               AND r.status = 'queued' AND r.priority > p
             ORDER BY r.priority, r.queued_at, r.id LIMIT 1;
        END LOOP;
    END IF;
    RETURN p;
END
$$;

-- When the first queued run of `kind` (and `tenant`) not yet due becomes due, NULL when there is
-- none: per priority present, the first entry past now(). Serves next_due, as due_priority the
-- claim.
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
               AND r.priority = p AND r.queued_at > leasework.now();
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
               AND r.status = 'queued' AND r.priority = p AND r.queued_at > leasework.now();
            best := least(best, q);
            SELECT min(r.priority) INTO p FROM leasework.runs r
             WHERE r.tenant = next_due_at.tenant AND r.kind = next_due_at.kind
               AND r.status = 'queued' AND r.priority > p;
        END LOOP;
    END IF;
    RETURN best;
END
$$;
