-- Migration 0038: rate limits per group (issue 31): `rate_per = 'group'` gives each tenant's
-- group of a rated kind its own budget of the rate (a tenant's runs without a group share the
-- tenant's), kept in leasework.group_rates and written by leasework.admit under the kind's row
-- lock like a tenant's window. The tenants' walk checks a run's group budget as it reads the
-- tenant's first runs in order, and past them looks group by group (leasework.tenant_group_pick,
-- runs_queued_tenant_groups, and runs_queued_tenant_exclusive for exclusive runs), so a group whose
-- budget is spent costs one probe, not a read of its queued runs. Self-contained and idempotent.

ALTER TABLE leasework.kind_limits DROP CONSTRAINT IF EXISTS kind_limits_valid;
ALTER TABLE leasework.kind_limits ADD CONSTRAINT kind_limits_valid CHECK (
    coalesce(max_running BETWEEN 1 AND 100000, true)
    AND coalesce(group_limit BETWEEN 1 AND 100000, true)
    AND (rate_count IS NULL) = (rate_seconds IS NULL)
    AND coalesce(rate_count BETWEEN 1 AND 1000000, true)
    AND coalesce(rate_seconds >= 0.1 AND rate_seconds <= 604800, true)
    AND coalesce(rate_per IN ('tenant', 'group'), true));

-- A tenant's queued exclusive runs, by group (migration 0038). Serves: tenant_group_pick for a
-- kind rated per group, when none of the tenant's runs holds a live lease (an exclusive run may
-- run then): its best exclusive run whose budget has room, found group by group as the runs
-- that are not exclusive are. Only exclusive runs: no entry for any other run.
CREATE INDEX IF NOT EXISTS runs_queued_tenant_exclusive
    ON leasework.runs (tenant, kind, "group", priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL AND exclusive;

-- Per kind, tenant and group, for a kind rated per group (rate_per = 'group', migration 0038):
-- the window of a tenant's runs of one group (written by leasework.admit under the kind's row
-- lock, as a tenant's window is). A tenant's runs without a group share the tenant's window
-- (leasework.tenant_rates), and a rate an operator gives a tenant holds each of its groups.
-- Windows gone quiet are pruned by maintenance (prune_rate_windows).
CREATE TABLE IF NOT EXISTS leasework.group_rates (
    kind     text NOT NULL,
    tenant   text NOT NULL,
    "group"  text NOT NULL,
    win      bigint[],
    PRIMARY KEY (kind, tenant, "group"),
    CONSTRAINT group_rates_window_valid CHECK (leasework.rate_window_valid(win))
);

-- The rate a tenant's runs of a kind rated per tenant are held to: the tenant's own (an
-- operator's, leasework.tenant_rates), else the kind's. (count, seconds) in one row; NULLs when
-- the kind has no rate per tenant. Rated per group (migration 0038), each group of the tenant is
-- held to it.
CREATE OR REPLACE FUNCTION leasework.tenant_rate(
    l leasework.kind_limits, t leasework.tenant_rates, OUT count integer, OUT seconds double precision)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF l.rate_per IN ('tenant', 'group') THEN
        count := coalesce(t.rate_count, l.rate_count);
        seconds := coalesce(t.rate_seconds, l.rate_seconds);
    END IF;
END
$$;

-- The budget a tenant's run of a kind rated per tenant or per group counts against (migration
-- 0038): its window (`win`: the tenant's, or rated per group the run's group's; a tenant's runs
-- without a group share the tenant's) and its rate (leasework.tenant_rate). In the caller's
-- snapshot.
CREATE OR REPLACE FUNCTION leasework.rate_budget(
    l leasework.kind_limits, tenant text, grp text,
    OUT win bigint[], OUT count integer, OUT seconds double precision)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t leasework.tenant_rates;
    r record;
BEGIN
    SELECT * INTO t FROM leasework.tenant_rates x
     WHERE x.kind = l.kind AND x.tenant = rate_budget.tenant;
    r := leasework.tenant_rate(l, t);
    count := r.count;
    seconds := r.seconds;
    win := t.win;
    IF l.rate_per = 'group' AND rate_budget.grp IS NOT NULL THEN
        SELECT x.win INTO win FROM leasework.group_rates x
         WHERE x.kind = l.kind AND x.tenant = rate_budget.tenant AND x."group" = rate_budget.grp;
    END IF;
END
$$;

-- When that budget (leasework.rate_budget) has room for one more claim again: now when it has.
CREATE OR REPLACE FUNCTION leasework.budget_free_at(l leasework.kind_limits, tenant text, grp text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    b record;
BEGIN
    b := leasework.rate_budget(l, budget_free_at.tenant, budget_free_at.grp);
    RETURN leasework.rate_window_free_at(b.win, b.count, b.seconds, leasework.now());
END
$$;

-- Whether a tenant's run of `kind` in group `grp` has room in its budget for one more claim, in
-- the claim's snapshot (the walk's hint, run by run for a kind rated per group; leasework.admit
-- decides). True when the kind has no rate per tenant or group, and for a run without a tenant.
CREATE OR REPLACE FUNCTION leasework.tenant_rate_open(kind text, tenant text, grp text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l leasework.kind_limits;
    b record;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = tenant_rate_open.kind;
    IF l.rate_count IS NULL OR l.rate_per IS NULL OR tenant_rate_open.tenant IS NULL THEN
        RETURN true;
    END IF;
    b := leasework.rate_budget(l, tenant_rate_open.tenant, tenant_rate_open.grp);
    RETURN leasework.rate_used(b.win, b.seconds, leasework.now()) < b.count;
END
$$;

-- For a kind rated per group: the earliest time one of a tenant's budgets with queued runs of
-- the kind has room again (now when one has), as far as the tenants' walk reaches: the
-- budgets of the tenant's first four queued runs in order, of its runs without a group, and of
-- each group with queued runs (loose scans of runs_queued_tenant_groups and, for its exclusive
-- runs, runs_queued_tenant_exclusive: one look-up per group). NULL: none queued. Serves next_due.
CREATE OR REPLACE FUNCTION leasework.group_budgets_free_at(l leasework.kind_limits, tenant text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    at timestamptz;
    g text;
    w record;
BEGIN
    FOR w IN
        SELECT r."group" FROM leasework.runs r
         WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind AND r.status = 'queued'
         ORDER BY r.priority, r.queued_at, r.id
         LIMIT 4
    LOOP
        at := least(at, leasework.budget_free_at(l, group_budgets_free_at.tenant, w."group"));
    END LOOP;
    IF at IS NULL OR at <= leasework.now() THEN
        RETURN at;
    END IF;
    IF EXISTS (SELECT 1 FROM leasework.runs r
                WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
                  AND r.status = 'queued' AND NOT r.exclusive AND r."group" IS NULL
                ORDER BY r."group", r.priority, r.queued_at, r.id LIMIT 1) THEN
        at := least(at, leasework.budget_free_at(l, group_budgets_free_at.tenant, NULL));
    END IF;
    SELECT min(r."group") INTO g
      FROM leasework.runs r
     WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
       AND r.status = 'queued' AND NOT r.exclusive AND r."group" IS NOT NULL;
    WHILE g IS NOT NULL AND at > leasework.now() LOOP
        at := least(at, leasework.budget_free_at(l, group_budgets_free_at.tenant, g));
        SELECT min(r."group") INTO g
          FROM leasework.runs r
         WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
           AND r.status = 'queued' AND NOT r.exclusive AND r."group" > g;
    END LOOP;
    -- The exclusive runs' budgets the same way (runs_queued_tenant_exclusive).
    IF at > leasework.now() AND EXISTS (
        SELECT 1 FROM leasework.runs r
         WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
           AND r.status = 'queued' AND r.exclusive AND r."group" IS NULL
         ORDER BY r."group", r.priority, r.queued_at, r.id LIMIT 1) THEN
        at := least(at, leasework.budget_free_at(l, group_budgets_free_at.tenant, NULL));
    END IF;
    SELECT min(r."group") INTO g
      FROM leasework.runs r
     WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
       AND r.status = 'queued' AND r.exclusive AND r."group" IS NOT NULL;
    WHILE g IS NOT NULL AND at > leasework.now() LOOP
        at := least(at, leasework.budget_free_at(l, group_budgets_free_at.tenant, g));
        SELECT min(r."group") INTO g
          FROM leasework.runs r
         WHERE r.tenant = group_budgets_free_at.tenant AND r.kind = l.kind
           AND r.status = 'queued' AND r.exclusive AND r."group" > g;
    END LOOP;
    RETURN at;
END
$$;

-- When a run of `kind` (and `tenant`: NULL for runs without one) fits in its rate again: NULL
-- when it has no rate, now when it fits now. Serves next_due: an idle worker sleeps until then.
-- (Migration 0035: the kind's window is its shards, and a run fits when one of them has room,
-- and while claims are carried from before the rate changed, the whole window too.)
CREATE OR REPLACE FUNCTION leasework.rate_free_at(kind text, tenant text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l leasework.kind_limits;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = rate_free_at.kind;
    IF l.rate_count IS NULL THEN
        RETURN NULL;
    ELSIF l.rate_per IS NULL OR rate_free_at.tenant IS NULL THEN
        RETURN greatest(
            (SELECT min(leasework.rate_window_free_at(s.win, s.share, l.rate_seconds,
                                                      leasework.now()))
               FROM leasework.rate_shards s WHERE s.kind = rate_free_at.kind),
            leasework.rate_window_free_at(
                leasework.rate_shards_window(rate_free_at.kind, l.rate_seconds), l.rate_count,
                l.rate_seconds, leasework.now()));
    END IF;
    IF l.rate_per = 'group' THEN
        -- Rated per group: the tenant's earliest budget with room (migration 0038).
        RETURN leasework.group_budgets_free_at(l, rate_free_at.tenant);
    END IF;
    RETURN leasework.budget_free_at(l, rate_free_at.tenant, NULL);
END
$$;

-- When a run of `kind`, `tenant` and group `grp` fits in its rate again (migration 0038): for a
-- kind rated per group, its group's budget (its tenant's for a run without a group); otherwise
-- as leasework.rate_free_at(kind, tenant). Serves `leasework show`.
CREATE OR REPLACE FUNCTION leasework.rate_free_at(kind text, tenant text, grp text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l leasework.kind_limits;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = rate_free_at.kind;
    IF l.rate_count IS NULL OR l.rate_per IS DISTINCT FROM 'group' OR rate_free_at.tenant IS NULL THEN
        RETURN leasework.rate_free_at(rate_free_at.kind, rate_free_at.tenant);
    END IF;
    RETURN leasework.budget_free_at(l, rate_free_at.tenant, rate_free_at.grp);
END
$$;

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
-- `rated` (migration 0038: the kind is rated per group): the walk calls it whenever none of the
-- first four may be claimed, and a budget without room in its window (the tenant's for the runs
-- without a group, each group's own: leasework.tenant_rate_open) is skipped as a full group is,
-- in one probe; and while none of the tenant's runs holds a live lease, its exclusive runs are
-- looked up the same way (runs_queued_tenant_exclusive), so that one behind runs of spent
-- budgets is not held back by them.
DROP FUNCTION IF EXISTS leasework.tenant_group_pick(text, text, integer);
CREATE OR REPLACE FUNCTION leasework.tenant_group_pick(
    tenant text, kind text, group_limit integer, rated boolean)
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
       AND (NOT tenant_group_pick.rated OR leasework.tenant_rate_open(
                tenant_group_pick.kind, tenant_group_pick.tenant, NULL))
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
            OFFSET tenant_group_pick.group_limit - 1)
           AND (NOT tenant_group_pick.rated
                OR leasework.tenant_rate_open(tenant_group_pick.kind, tenant_group_pick.tenant, g))
        THEN
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
    -- Rated per group, while none of the tenant's runs holds a live lease (an exclusive run may
    -- run then): its exclusive runs too, the same way (runs_queued_tenant_exclusive), each group
    -- whose budget has room.
    IF tenant_group_pick.rated AND NOT EXISTS (
        SELECT 1 FROM leasework.runs o
         WHERE o.tenant = tenant_group_pick.tenant AND o.status = 'running'
           AND o.lease_expires_at >= leasework.now()) THEN
        SELECT r.id, r.priority, r.queued_at INTO cand
          FROM leasework.runs r
         WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
           AND r.status = 'queued' AND r.exclusive AND r."group" IS NULL
           AND r.queued_at <= leasework.now()
           AND leasework.tenant_rate_open(tenant_group_pick.kind, tenant_group_pick.tenant, NULL)
         ORDER BY r."group", r.priority, r.queued_at, r.id
         LIMIT 1;
        IF cand.id IS NOT NULL AND (best.id IS NULL
            OR (cand.priority, cand.queued_at, cand.id) < (best.priority, best.queued_at, best.id))
        THEN
            best := cand;
        END IF;
        SELECT min(r."group") INTO g
          FROM leasework.runs r
         WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
           AND r.status = 'queued' AND r.exclusive AND r."group" IS NOT NULL;
        WHILE g IS NOT NULL LOOP
            IF leasework.tenant_rate_open(tenant_group_pick.kind, tenant_group_pick.tenant, g) THEN
                SELECT r.id, r.priority, r.queued_at INTO cand
                  FROM leasework.runs r
                 WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
                   AND r.status = 'queued' AND r.exclusive
                   AND r."group" >= g AND r."group" <= g
                   AND r.queued_at <= leasework.now()
                 ORDER BY r."group", r.priority, r.queued_at, r.id
                 LIMIT 1;
                IF cand.id IS NOT NULL AND (best.id IS NULL
                    OR (cand.priority, cand.queued_at, cand.id)
                       < (best.priority, best.queued_at, best.id))
                THEN
                    best := cand;
                END IF;
            END IF;
            SELECT min(r."group") INTO g
              FROM leasework.runs r
             WHERE r.tenant = tenant_group_pick.tenant AND r.kind = tenant_group_pick.kind
               AND r.status = 'queued' AND r.exclusive AND r."group" > g;
        END LOOP;
    END IF;
    RETURN best.id;
END
$$;

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
-- The rate limits' rules are read again here (group_limit, rate per tenant or per group): `live`
-- already holds only the kinds open to this claim. A kind rated per group (migration 0038) has
-- each run read in order checked against its group's budget (leasework.tenant_rate_open), and
-- the look-up group by group made whenever none of the first four may be claimed (it skips a
-- group whose budget is spent as it skips a full one).
CREATE OR REPLACE FUNCTION leasework.tenant_picks(live text[], wanted integer)
RETURNS TABLE (id bigint, tenant text, priority integer, queued_at leasework.instant, kind text,
               turn double precision)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH rules AS MATERIALIZED (
        SELECT l.kind, coalesce(l.group_limit, 1) AS group_limit,
               l.rate_per = 'tenant' AND l.rate_count IS NOT NULL AS per_tenant,
               l.rate_per = 'group' AND l.rate_count IS NOT NULL AS per_group
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
               AND (g.per_group IS NOT TRUE
                    OR leasework.tenant_rate_open(k.kind, t.name, r."group"))
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
               AND (g.per_group IS TRUE
                    OR EXISTS (SELECT 1 FROM leasework.runs b
                                WHERE b.tenant = t.name AND b.status = 'running'
                                  AND b.lease_expires_at >= leasework.now()))
               AND r.id = leasework.tenant_group_pick(t.name, k.kind, coalesce(g.group_limit, 1),
                                                      g.per_group IS TRUE)
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

-- The admission of a claim's candidates (claim_runs' `chosen`, when a kind it may take has a cap
-- or a rate): `ids` in the claim's order, with their `kinds` and `tenants`; returns those it
-- takes, at most `wanted`. The rows of the limited kinds among them are locked first, in kind
-- order (FOR UPDATE: a second claim of the kind waits for this one to commit; one order, so two
-- claims never wait on each other), then the shards of each rated kind's window
-- (leasework.rate_shards, in shard order; split if the kind has none: leasework.rate_split; the
-- quick statement's rated form writes one shard under that shard's lock alone): one at a time,
-- those no rated claim in flight holds, until they have room for `wanted`, or when they have
-- none (or claims are carried from before the rate changed) every one, waiting for those claims
-- to commit. Every count
-- is read after that, with a fresh snapshot (VOLATILE): it sees each claim of the kind that
-- committed before, which the claim statement's own snapshot may not. Then, in order, a
-- candidate of a limited kind is taken while its kind has a free place under max_running (live
-- leases, but the run `finishing` of `worker`: its seal commits with this claim) and room in its
-- rate: the kind's (the room left in each shard under its share, added up, and no more than the
-- whole window's room while claims carried from before the rate changed count), or with rate_per =
-- 'tenant' its tenant's (with rate_per = 'group' its group's: migration 0038) (runs without a tenant share one budget, the kind's shards). What it
-- takes is recorded in the windows before it returns, each shard taking what it has room for,
-- in shard order: the claim statement updates every run it returns. (Migration 0024 added the
-- cap lock, 0031 the window's table, 0035 its shards.)
CREATE OR REPLACE FUNCTION leasework.admit(
    ids bigint[], kinds text[], tenants text[], wanted integer, finishing bigint, worker text)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    at timestamptz := leasework.now();
    lk text[] := '{}';
    room bigint[] := '{}';  -- places left under the cap and the kind's rate (NULL: no limit)
    per boolean[] := '{}';  -- rated per tenant
    loose bigint[] := '{}';  -- rated per tenant: room left for runs without a tenant
    took bigint[] := '{}';  -- claims to record in the kind's window (NULL: it has no rate)
    secs double precision[] := '{}';  -- the kind's rate's period
    taken bigint[] := '{}';
    l leasework.kind_limits;
    t leasework.tenant_rates;
    grp text;
    gw bigint[];
    s record;
    free bigint;
    kept bigint;
    held integer[] := '{}';  -- the shards locked here: (the kind's place in lk - 1) * 8 + shard
    more integer[];
    k integer;
    r record;
    j integer;
    n bigint;
BEGIN
    -- Each capped kind's cap lock, exclusive, before its row (in the order of the locks' keys,
    -- so that two admits never wait on each other): the hand-ons in flight (leasework.hand_on,
    -- which hold it shared) commit first, and the counts below see them.
    FOR n IN
        SELECT DISTINCT hashtext(x.kind) FROM leasework.kind_limits x
         WHERE x.kind = ANY(kinds) AND x.max_running IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('leasework.cap'), n::integer);
    END LOOP;
    FOR l IN
        SELECT * FROM leasework.kind_limits x
         WHERE x.kind = ANY(kinds) AND (x.max_running IS NOT NULL OR x.rate_count IS NOT NULL)
         ORDER BY x.kind
           FOR UPDATE
    LOOP
        n := NULL;
        free := NULL;
        IF l.max_running IS NOT NULL THEN
            n := l.max_running - leasework.running_of_kind(l.kind, finishing, worker);
        END IF;
        IF l.rate_count IS NOT NULL THEN
            -- The kind's shards (split the first time), each locked before it is read (the rated
            -- quick statement writes one under its lock alone), and the claims carried from
            -- before the rate changed (set and cleared under the kind's row lock, held here).
            IF NOT EXISTS (SELECT 1 FROM leasework.rate_shards x WHERE x.kind = l.kind) THEN
                PERFORM leasework.rate_split(l.kind);
            END IF;
            SELECT max(CASE WHEN x.carried IS NOT NULL
                            THEN leasework.rate_used(x.carried, l.rate_seconds, at) END)
              INTO kept
              FROM leasework.rate_shards x WHERE x.kind = l.kind;
            IF kept = 0 THEN
                -- They count nothing any more: the quick statement may take the shards again.
                UPDATE leasework.rate_shards x SET carried = NULL
                 WHERE x.kind = l.kind AND x.carried IS NOT NULL;
            END IF;
            free := 0;
            k := cardinality(lk) * 8;
            WHILE coalesce(kept, 0) = 0 AND free < wanted LOOP
                -- One more shard that no rated claim in flight holds (SKIP LOCKED: those record
                -- their own claims), read as locked, until there is room for what the claim
                -- may take: a quick claim finds the others free (it never waits for this one).
                SELECT y.shard,
                       greatest(0, y.share - leasework.rate_used(y.win, l.rate_seconds, at)) AS spare
                  INTO s
                  FROM leasework.rate_shards y
                 WHERE y.kind = l.kind AND k + y.shard <> ALL(held)
                 ORDER BY y.last_pid IS DISTINCT FROM pg_backend_pid(), y.shard
                 LIMIT 1
                   FOR UPDATE SKIP LOCKED;
                EXIT WHEN NOT FOUND;
                held := held || (k + s.shard);
                free := free + s.spare;
            END LOOP;
            IF free < 1 THEN
                -- No room there (or claims carried): every shard, waiting for the claims in
                -- flight, and with claims carried the whole window held to the rate too.
                SELECT coalesce(sum(greatest(0, x.share
                                                - leasework.rate_used(x.win, l.rate_seconds, at))), 0),
                       array_agg(k + x.shard)
                  INTO free, more
                  FROM (SELECT y.shard, y.share, y.win FROM leasework.rate_shards y
                         WHERE y.kind = l.kind
                         ORDER BY y.shard
                           FOR UPDATE) x;
                held := held || coalesce(more, '{}');
                IF kept > 0 THEN
                    free := least(free, l.rate_count - leasework.rate_used(
                        leasework.rate_shards_window(l.kind, l.rate_seconds), l.rate_seconds, at));
                END IF;
            END IF;
            IF l.rate_per IS NULL THEN
                n := least(n, free);
            END IF;
            took := took || 0::bigint;
        ELSE
            took := took || NULL::bigint;
        END IF;
        lk := lk || l.kind;
        room := room || n;
        secs := secs || l.rate_seconds;
        per := per || (l.rate_per IS NOT NULL AND l.rate_count IS NOT NULL);
        loose := loose || CASE WHEN l.rate_per IS NOT NULL THEN free END;
    END LOOP;
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        EXIT WHEN cardinality(taken) >= wanted;
        j := array_position(lk, kinds[i]);
        IF j IS NULL THEN
            taken := taken || ids[i];
            CONTINUE;
        END IF;
        CONTINUE WHEN room[j] < 1;
        IF per[j] AND tenants[i] IS NOT NULL THEN
            -- Its tenant's window, read fresh (under the kind's lock, which every writer of it
            -- holds); one run per tenant in a claim (claim_runs' DISTINCT ON). Rated per group
            -- (migration 0038), its group's window, held to the same rate (a run without a group:
            -- its tenant's).
            SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = lk[j];
            SELECT * INTO t FROM leasework.tenant_rates x
             WHERE x.kind = lk[j] AND x.tenant = tenants[i];
            r := leasework.tenant_rate(l, t);
            grp := NULL;
            IF l.rate_per = 'group' THEN
                SELECT x."group" INTO grp FROM leasework.runs x WHERE x.id = ids[i];
            END IF;
            IF grp IS NULL THEN
                CONTINUE WHEN leasework.rate_used(t.win, r.seconds, at) >= r.count;
                INSERT INTO leasework.tenant_rates AS x (kind, tenant, win)
                VALUES (lk[j], tenants[i], leasework.rate_recorded(NULL, r.seconds, at, 1))
                ON CONFLICT (kind, tenant)
                DO UPDATE SET win = leasework.rate_recorded(x.win, r.seconds, at, 1);
            ELSE
                SELECT x.win INTO gw FROM leasework.group_rates x
                 WHERE x.kind = lk[j] AND x.tenant = tenants[i] AND x."group" = grp;
                CONTINUE WHEN leasework.rate_used(gw, r.seconds, at) >= r.count;
                INSERT INTO leasework.group_rates AS x (kind, tenant, "group", win)
                VALUES (lk[j], tenants[i], grp, leasework.rate_recorded(NULL, r.seconds, at, 1))
                ON CONFLICT (kind, tenant, "group")
                DO UPDATE SET win = leasework.rate_recorded(x.win, r.seconds, at, 1);
            END IF;
        ELSIF took[j] IS NOT NULL THEN
            IF per[j] THEN
                CONTINUE WHEN loose[j] < 1;
                loose[j] := loose[j] - 1;
            END IF;
            took[j] := took[j] + 1;
        END IF;
        room[j] := room[j] - 1;
        taken := taken || ids[i];
    END LOOP;
    FOR j IN 1 .. cardinality(lk) LOOP
        n := took[j];
        CONTINUE WHEN n IS NULL OR n < 1;
        -- The shards locked above.
        FOR s IN
            SELECT x.shard, greatest(0, x.share - leasework.rate_used(x.win, secs[j], at)) AS spare
              FROM leasework.rate_shards x
             WHERE x.kind = lk[j] AND (j - 1) * 8 + x.shard = ANY(held)
             ORDER BY x.shard
        LOOP
            EXIT WHEN n < 1;
            CONTINUE WHEN s.spare < 1;
            UPDATE leasework.rate_shards x
               SET win = leasework.rate_recorded(x.win, secs[j], at, least(n, s.spare))
             WHERE x.kind = lk[j] AND x.shard = s.shard;
            n := n - least(n, s.spare);
        END LOOP;
    END LOOP;
    RETURN taken;
END
$$;
