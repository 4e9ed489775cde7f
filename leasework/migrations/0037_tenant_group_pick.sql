-- Migration 0037: the tenants' walk of claim_runs no longer reads every queued run of a tenant
-- that its limiter holds back (issue 29, (g)): a tenant with a long queue in a group whose
-- running runs are as many as the kind's group_limit made every claim read that queue, 0.05 x
-- the rate of 50 other tenants' runs with 20,000 queued (bench/README.md, issue 29, (g)). The walk
-- reads a tenant's first four runs of a kind in order; when none of them may be claimed and a run
-- of the tenant holds a live lease, leasework.tenant_group_pick finds its best claimable run group
-- by group (runs_queued_tenant_groups). Self-contained and idempotent.

-- A tenant's queued runs that its limiter may hold back, by group. Serves: tenant_group_pick (the
-- tenants' walk past a tenant's first runs, migration 0037). Runs that are not exclusive only:
-- an exclusive one waits while any run of its tenant runs, so the walk never reads it then.
CREATE INDEX IF NOT EXISTS runs_queued_tenant_groups
    ON leasework.runs (tenant, kind, "group", priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL AND NOT exclusive;

-- A tenant's best claimable queued run of one kind, found group by group (migration 0037): the
-- tenants' walk (tenant_picks) reads a tenant's first runs of a kind in order and calls this when
-- none of the first four may be claimed and a run of the tenant holds a live lease. Its limiter
-- then holds back the exclusive runs and those of each group whose running runs are as many as
-- the kind's group_limit; the walk in order read every one of them per claim (a tenant with
-- 20,000 queued runs in one group, one of them running, drained 50 other tenants' runs at 0.05 x
-- the rate with no such backlog: bench/README.md, issue 29, (g)). Here it costs three look-ups per
-- group of the tenant with queued runs of the kind, whatever their number: the best due run
-- without a group, then each group in turn (runs_queued_tenant_groups), skipped when full, else
-- its best due run. The answer is the best by (priority, queued_at, id) of those, which is the
-- run the walk in order would have reached first (NULL: none). Not locked: the walk locks it
-- (SKIP LOCKED) and checks it again. STABLE: the calling statement's snapshot, as the walk's.
-- Each look-up orders by "group" first, and a group is matched as a range (>= g AND <= g), not
-- by equality: so runs_queued_by_tenant, ordered by priority within a tenant's kind, cannot give
-- the order without a sort of the tenant's every run of the kind, and the plan reads this
-- function's index. With `= g` (or IS NULL and no "group" key) the planner took that index in
-- order and filtered by the group, which walked the full group's runs again (a test's 5,000).
CREATE OR REPLACE FUNCTION leasework.tenant_group_pick(tenant text, kind text, group_limit integer)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    best record;
    cand record;
    g text;
BEGIN
    SELECT r.id, r.priority, r.queued_at INTO best
      FROM leasework.runs r
     WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
       AND r.status = 'queued' AND NOT r.exclusive AND r."group" IS NULL
       AND r.queued_at <= leasework.now()
     ORDER BY r."group", r.priority, r.queued_at, r.id
     LIMIT 1;
    SELECT min(r."group") INTO g
      FROM leasework.runs r
     WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
       AND r.status = 'queued' AND NOT r.exclusive AND r."group" IS NOT NULL;
    WHILE g IS NOT NULL LOOP
        IF NOT EXISTS (
            SELECT 1 FROM leasework.runs o
             WHERE o.tenant = tenant_group_pick.tenant AND o.status = 'running'
               AND o.lease_expires_at >= leasework.now() AND o."group" = g
            OFFSET tenant_group_pick.group_limit - 1) THEN
            SELECT r.id, r.priority, r.queued_at INTO cand
              FROM leasework.runs r
             WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
               AND r.status = 'queued' AND NOT r.exclusive
               AND r."group" >= g AND r."group" <= g
               AND r.queued_at <= leasework.now()
             ORDER BY r."group", r.priority, r.queued_at, r.id
             LIMIT 1;
            IF cand.id IS NOT NULL AND (best.id IS NULL
                OR (cand.priority, cand.queued_at, cand.id) < (best.priority, best.queued_at, best.id))
            THEN
                best := cand;
            END IF;
        END IF;
        SELECT min(r."group") INTO g
          FROM leasework.runs r
         WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
           AND r.status = 'queued' AND NOT r.exclusive AND r."group" > g;
    END LOOP;
    RETURN best.id;
END
$$;

-- The tenants' walk (schema.sql: leasework.tenant_picks).
CREATE OR REPLACE FUNCTION leasework.tenant_picks(live text[], wanted integer)
RETURNS TABLE (id bigint, tenant text, priority integer, queued_at leasework.instant, kind text,
               turn double precision)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH rules AS MATERIALIZED (
        SELECT l.kind, coalesce(l.group_limit, 1) AS group_limit,
               l.rate_per IS NOT NULL AND l.rate_count IS NOT NULL AS per_tenant
          FROM leasework.kind_limits l
         WHERE l.kind = ANY(tenant_picks.live)
    )
    SELECT p.* FROM (
    SELECT c.id, t.name AS tenant, c.priority, c.queued_at, c.kind, t.turn
      FROM leasework.tenants t, LATERAL (
        SELECT h.*
          FROM unnest(tenant_picks.live) AS k(kind)
          LEFT JOIN rules g ON g.kind = k.kind, LATERAL (
            SELECT * FROM (
            SELECT r.id, r.priority, r.queued_at, r.kind
              FROM (SELECT r.id, r.priority, r.queued_at
                      FROM leasework.runs r
                     WHERE r.tenant = t.name AND r.kind = k.kind
                       AND r.status = 'queued' AND r.queued_at <= leasework.now()
                     ORDER BY r.priority, r.queued_at, r.id
                     LIMIT 4) f
              JOIN leasework.runs r ON r.id = f.id
             WHERE (g.per_tenant IS NOT TRUE OR leasework.tenant_rate_open(k.kind, t.name))
               AND coalesce((SELECT h.queued_at <= leasework.now() FROM leasework.runs h
                              WHERE h.tenant = t.name AND h.kind = k.kind AND h.status = 'queued'
                              ORDER BY h.priority, h.queued_at, h.id LIMIT 1)
                            OR leasework.due_priority(k.kind, t.name) IS NOT NULL, false)
               AND r.status = 'queued' AND r.queued_at <= leasework.now()
               AND NOT EXISTS (
                    SELECT 1
                      FROM leasework.runs o
                     WHERE o.tenant = r.tenant
                       AND o.status = 'running'
                       AND o.id <> r.id
                       AND o.lease_expires_at >= leasework.now()
                       AND (o.exclusive OR r.exclusive OR o."group" = r."group")
                    OFFSET CASE WHEN r.exclusive THEN 0 ELSE coalesce(g.group_limit, 1) - 1 END)
             ORDER BY f.priority, f.queued_at, f.id
             LIMIT 1
               FOR UPDATE OF r SKIP LOCKED) first_runs
            UNION ALL
            SELECT * FROM (
            SELECT r.id, r.priority, r.queued_at, r.kind
              FROM leasework.runs r
             WHERE (g.per_tenant IS NOT TRUE OR leasework.tenant_rate_open(k.kind, t.name))
               AND coalesce((SELECT h.queued_at <= leasework.now() FROM leasework.runs h
                              WHERE h.tenant = t.name AND h.kind = k.kind AND h.status = 'queued'
                              ORDER BY h.priority, h.queued_at, h.id LIMIT 1)
                            OR leasework.due_priority(k.kind, t.name) IS NOT NULL, false)
               AND EXISTS (SELECT 1 FROM leasework.runs b
                            WHERE b.tenant = t.name AND b.status = 'running'
                              AND b.lease_expires_at >= leasework.now())
               AND r.id = leasework.tenant_group_pick(t.name, k.kind, coalesce(g.group_limit, 1))
               AND r.status = 'queued' AND r.queued_at <= leasework.now()
               AND NOT EXISTS (
                    SELECT 1
                      FROM leasework.runs o
                     WHERE o.tenant = r.tenant
                       AND o.status = 'running'
                       AND o.id <> r.id
                       AND o.lease_expires_at >= leasework.now()
                       AND (o.exclusive OR r.exclusive OR o."group" = r."group")
                    OFFSET CASE WHEN r.exclusive THEN 0 ELSE coalesce(g.group_limit, 1) - 1 END)
               FOR UPDATE OF r SKIP LOCKED) by_group
            LIMIT 1) h
         ORDER BY h.priority, h.queued_at, h.id
         LIMIT 1) c
     WHERE t.priority IS NOT NULL
       AND NOT EXISTS (
            SELECT 1 FROM leasework.runs x
             WHERE x.tenant = t.name AND x.status = 'running' AND x.exclusive
               AND x.lease_expires_at >= leasework.now() OFFSET 0)
     ORDER BY t.priority, t.turn, t.name
     LIMIT tenant_picks.wanted + 2
       FOR UPDATE OF t SKIP LOCKED) p
     WHERE NOT leasework.limiter_conflict(p.id)
     LIMIT tenant_picks.wanted;
END
$$;
