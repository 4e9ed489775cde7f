-- Migration 0036: the tenants' walk of claim_runs in a function of its own (issue 29, the claim
-- with 1,000 tenants; bench/README.md, issue 29, "The tenants' walk on its own"). A row lock that
-- meets a row changed since the statement's snapshot re-checks it after setting up every subquery
-- of the statement again; in claim_runs, with all its CTEs, that cost two workers sharing tenants
-- more than the claim itself. claim_runs (leases/lease.sql) calls leasework.tenant_picks for its
-- `tenanted_queued`. Self-contained and idempotent: CREATE OR REPLACE.

-- The tenants' walk of claim_runs (leases/lease.sql, `tenanted_queued`: its comment gives the
-- rule): up to `wanted` picks, one per tenant in turn order, each its tenant's best claimable run
-- of the live kinds `live`, the run and its tenant row locked (SKIP LOCKED) and each re-checked
-- by leasework.limiter_conflict with a fresh snapshot. A function of its own (migration 0036),
-- not a part of claim_runs, for what a lock costs when it finds a row changed since the
-- statement's snapshot: Postgres re-checks that row (EvalPlanQual) after setting up again every
-- subquery of the whole statement, not only those under the lock. Two workers walking the same
-- tenants meet such rows at nearly every claim (a tenant the other just served, its run just
-- claimed), and in claim_runs each such meeting set up its every CTE: 2.1-2.5 ms of backend CPU
-- and some 200-340 page faults per job, two processes at 410 jobs/s against one at 965
-- (bench/README.md, issue 29, "The tenants' walk on its own"). Here it sets up this query alone.
-- The rate limits' rules are read again here (group_limit, rate per tenant): `live` already
-- holds only the kinds open to this claim.
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
            SELECT r.id, r.priority, r.queued_at, r.kind
              FROM leasework.runs r
             WHERE (g.per_tenant IS NOT TRUE OR leasework.tenant_rate_open(k.kind, t.name))
               AND r.tenant = t.name AND r.kind = k.kind
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
             ORDER BY r.priority, r.queued_at, r.id
             LIMIT 1
               FOR UPDATE OF r SKIP LOCKED) h
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
