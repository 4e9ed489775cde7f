-- leasework schema: the whole current schema, what `leasework migrate` installs on an empty
-- database (idempotent). A database that already has the schema is upgraded by the versioned
-- migrations in leasework/migrations/ instead, so every change here needs one there too:
-- add NNNN_what.sql (the next number; write it so it also succeeds where the change is already
-- in place: IF [NOT] EXISTS, CREATE OR REPLACE). tests/db/test_migrations.py checks that the
-- migrations from 0001 give exactly this schema. The version is recorded by `migrate`.
-- Everything lives in the `leasework` schema, never in the user's `public`.
-- Each index names the query (in leasework/**/*.sql) that it serves.

CREATE SCHEMA IF NOT EXISTS leasework;

-- Singleton row (CHECK on a boolean primary key) recording which schema version is applied.
CREATE TABLE IF NOT EXISTS leasework.schema_version (
    id         boolean PRIMARY KEY DEFAULT true CHECK (id),
    version    integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- The database's idea of "now": every lease decision reads this, never the worker's clock. The
-- server's now(), nothing added (migration 0014): the planner inlines it, so it costs what now()
-- does. The test suite replaces it in its own databases with a clock it can move
-- (tests/clock.py), instead of sleeping.
CREATE OR REPLACE FUNCTION leasework.now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT now();
$$;

-- The kinds the workers of this database have handlers for: each worker's maintenance stage
-- upserts its app's kinds (seen_at, hourly). A queued run whose kind no worker declared in the
-- last seven days is ended `failed` by fail_unknown_kinds once it has waited unknown_kind_after
-- (stages/maintenance.sql), rather than staying queued for ever. (Migration 0009.)
-- `accepts`: the payloads the kind's handler can be called with, as its workers declare it
-- (tasks.Accepts.declared; the last declaration stands, NULL: none declared): {"takes": "any"},
-- or "keywords" (a JSON object spread into keyword-only parameters) or "fields" (a JSON object's
-- keys bound to a dataclass's fields, any other value passed as it is), with its `required` keys,
-- the `allowed` ones (null: any) and a `describe` line; leasework.enqueue refuses a payload that
-- cannot match (leasework.payload_problem). (Migration 0029.)
CREATE TABLE IF NOT EXISTS leasework.kinds (
    kind    text PRIMARY KEY,
    seen_at timestamptz NOT NULL DEFAULT now(),
    accepts jsonb
);

-- One row per tenant, made on enqueue. The claim locks it (FOR UPDATE OF t SKIP LOCKED) so
-- two workers cannot both pass the rate limiter for the same tenant. It also holds the tenant's
-- place in the turns (migration 0016): `turn` advances by 1 / `weight` for each run of the tenant
-- claimed (leasework.tenant_served), and `priority` is that of its best queued run, NULL when it
-- has none (kept by leasework.tenant_queued_run, on insert by the trigger runs_tenant_queued,
-- and by tenant_served). The claim walks the tenants with queued runs in (priority, turn, name) order
-- (tenants_in_turn).
CREATE TABLE IF NOT EXISTS leasework.tenants (
    name       text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    weight     double precision NOT NULL DEFAULT 1
               CONSTRAINT tenants_weight_valid CHECK (weight >= 0.001 AND weight <= 1000),
    turn       double precision NOT NULL DEFAULT 0,
    priority   integer
);

-- The rules on one numeric column of leasework.runs are domains, checked where a value is written
-- (an enqueue, a claim, a checkpoint) and only there. As table CHECKs they were evaluated on every
-- update of a run, and Postgres rebuilds a CHECK's expression from the catalog for every statement
-- that updates the table, a cost that follows the expressions' size and that every claim and
-- finish paid (figures: bench/README.md, "Fourth round", 4). The rules that relate two columns
-- stay table CHECKs, and so does the status rule (see beside it). (Migration 0005; a client sees
-- the base type.)
DO $$
BEGIN
    IF to_regtype('leasework.attempt_count') IS NULL THEN
        CREATE DOMAIN leasework.attempt_count AS integer CONSTRAINT attempt_count_valid
            CHECK (VALUE >= 0);
    END IF;
    IF to_regtype('leasework.max_attempts') IS NULL THEN
        CREATE DOMAIN leasework.max_attempts AS integer CONSTRAINT max_attempts_valid
            CHECK (VALUE >= 1);
    END IF;
    IF to_regtype('leasework.units') IS NULL THEN
        CREATE DOMAIN leasework.units AS bigint CONSTRAINT units_valid CHECK (VALUE >= 0);
    END IF;
    IF to_regtype('leasework.seconds') IS NULL THEN
        CREATE DOMAIN leasework.seconds AS double precision CONSTRAINT seconds_positive
            CHECK (VALUE > 0);
    END IF;
    -- Every timestamp of a run: finite and from 1970 to 2200, so no role and no bug can store a
    -- lease or a due time that blocks a tenant for ever or that a reader (Python's datetime
    -- stops at year 9999; `infinity - now()` is an error) cannot show. (Migration 0006.)
    IF to_regtype('leasework.instant') IS NULL THEN
        CREATE DOMAIN leasework.instant AS timestamptz CONSTRAINT instant_in_range
            CHECK (VALUE >= '1970-01-01 00:00:00+00' AND VALUE < '2200-01-01 00:00:00+00');
    END IF;
END
$$;

-- The rule on a run's status and the columns that go with it, checked on every write of a run
-- (runs_state_valid, below): the status is one of the eight; running <=> the lease columns are
-- set (lease_owner and lease_expires_at: every statement that moves a run out of `running` clears
-- them, which is why the owner-scoped statements can match lease_owner alone); terminal <=>
-- finished_at is set. `status` is not a domain, unlike the numeric columns: code of the release
-- before migration 0005 binds one untyped parameter both to `status` and to a text argument
-- (finish_run's history entry), which Postgres cannot type once the column is a domain, and older
-- workers must keep running during a rolling upgrade.
-- A PL/pgSQL function, not the three table CHECKs it replaced (migration 0012): Postgres reads a
-- CHECK's expression from its catalog text and compiles it for every statement that updates the
-- table, once per updated table in the statement, and those three, with their eleven text
-- constants, were a fifth of the server's instructions per job in one-at-a-time mode (figures:
-- bench/README.md, issue 19, third pass); PL/pgSQL compiles the body once per session. Not
-- LANGUAGE sql, which the planner would inline and so parse again per statement. The operators and
-- the type are schema-qualified because PL/pgSQL resolves them by the calling session's
-- search_path: no role can put its own `=` in front of the rule.
CREATE OR REPLACE FUNCTION leasework.run_state_valid(
    status text, lease_owner uuid, lease_expires_at timestamptz, finished_at timestamptz)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (
               '{blocked,waiting,queued,running,succeeded,partial,failed,cancelled}'::pg_catalog.text[])
       AND (status OPERATOR(pg_catalog.=) 'running')
           OPERATOR(pg_catalog.=) (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)
       AND (status OPERATOR(pg_catalog.=) ANY (
               '{succeeded,partial,failed,cancelled}'::pg_catalog.text[]))
           OPERATOR(pg_catalog.=) (finished_at IS NOT NULL);
END
$$;

CREATE TABLE IF NOT EXISTS leasework.runs (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind                text NOT NULL,
    key                 text,
    -- Not a foreign key: an enqueue's FK check would KEY SHARE-lock the tenant row for the whole
    -- of the caller's transaction, and the claim (FOR UPDATE OF t SKIP LOCKED) would skip every
    -- run of that tenant meanwhile. Enqueue makes the tenant row in the same statement instead.
    tenant              text,
    "group"             text,
    exclusive           boolean NOT NULL DEFAULT false,
    priority            integer NOT NULL DEFAULT 0,
    status              text NOT NULL DEFAULT 'queued',
    payload             jsonb NOT NULL DEFAULT '{}'::jsonb,
    result              jsonb,
    error               text,
    attempts            leasework.attempt_count NOT NULL DEFAULT 0,
    max_attempts        leasework.max_attempts NOT NULL DEFAULT 3,
    lease_seconds       leasework.seconds,
    timeout_seconds     leasework.seconds,
    queued_at           leasework.instant NOT NULL DEFAULT now(),
    created_at          leasework.instant NOT NULL DEFAULT now(),
    started_at          leasework.instant,
    finished_at         leasework.instant,
    lease_owner         uuid,
    lease_expires_at    leasework.instant,
    lease_worker        text,
    cancel_requested_at leasework.instant,
    processed_units     leasework.units NOT NULL DEFAULT 0,
    total_units         leasework.units,
    -- One entry per ended attempt but a success: {attempt, owner, worker, started_at, ended_at,
    -- outcome, error}, built by leasework.history_entry() (below). A success is recorded by the
    -- row itself; leasework.run_history() (below) gives the history with it.
    history             jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- How many times a handler snoozed this run (Snooze: requeued, the attempt not charged;
    -- snooze_run in leasework/leases/lease.sql); NULL: never, so a run that never snoozes stores
    -- nothing for it. An operator's retry clears it (a fresh budget). (Migration 0021.)
    snoozes             leasework.attempt_count,
    -- Unique windows and debounce (migration 0022, leasework.enqueue): unique_at, when an
    -- enqueue with unique_for made this run its key's window run (cleared when a later one takes
    -- over the window); debounce_count, the enqueues a debounce merged into it, the first
    -- included (NULL: no debounce made it); debounce_deadline, the latest a debounce may make it
    -- due (its first enqueue + debounce_max; NULL: no bound).
    unique_at           leasework.instant,
    debounce_count      integer,
    debounce_deadline   leasework.instant,
    -- The W3C traceparent of the span that enqueued the run, when tracing was on there
    -- (leasework.trace_run, below; README "Tracing"); NULL otherwise. (Migration 0025.)
    traceparent         text,
    -- Dependencies (migration 0026, README "Workflows"): true once a run waits for this one
    -- (leasework.run_deps), so that its end is recorded for the deps stage by the trigger
    -- runs_ended, whose WHEN reads this column: a run nothing waits for fires nothing.
    has_dependents      boolean NOT NULL DEFAULT false,
    -- Whether a waiter asked for this run's end (leasework.run_outcome; migration 0027): then,
    -- and only then, its end NOTIFYs `leasework_ended` (runs_ended). NULL: nobody did.
    notify_ended        boolean,
    -- Labels an enqueue gave the run (`tags=[...]`, each a label: leasework.label_problem),
    -- distinct and sorted; NULL: none. For operators' searches only (runs_tags, below); no
    -- worker reads it. (Migration 0030.)
    tags                text[],
    -- The status and the columns that go with it, one rule (leasework.run_state_valid, above).
    CONSTRAINT runs_state_valid CHECK (
        leasework.run_state_valid(status, lease_owner, lease_expires_at, finished_at))
);

-- Storage of the queue table, chosen deliberately and measured with bench/bloat.py (figures:
-- bench/README.md, "Bloat"). Every job writes one row and two new versions of it (claim, finish).
-- None of these updates can be HOT: status, a predicate of the claim's partial indexes, changes
-- each time. So a fillfactor below 100 buys no HOT chain, only room that the next non-HOT version
-- fills anyway (90 measured larger than 100, Postgres' default), hence 100. Bloat is bounded by
-- pruning and by autovacuum's cadence: at any busy rate the dead tuples pass every threshold
-- within seconds, so a vacuum starts on each autovacuum_naptime (a server setting) whatever the
-- table's own thresholds; lower thresholds and a higher cost limit measured no smaller, so the
-- vacuum settings are Postgres' defaults (which also cap the dead tuples of a quiet queue at a
-- fifth of the table). The one setting kept: analyze at 2 % of the rows changed, so the planner's
-- view of the status mix follows the queue (the workers' generic plans are built from it).
ALTER TABLE leasework.runs
    SET (autovacuum_analyze_scale_factor = 0.02, fillfactor = 100),
    RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
           autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_cost_limit);

-- One entry of runs.history, the record of one ended attempt; every statement of
-- leasework/leases/lease.sql that ends an attempt other than by success appends one with it. STABLE, not IMMUTABLE,
-- because jsonb_build_object is (a timestamptz is rendered in the session's TimeZone); a
-- LANGUAGE sql function that is STABLE, not STRICT, has no SET clause and uses each argument
-- once is inlined by the planner, so it costs nothing over writing the expression out.
CREATE OR REPLACE FUNCTION leasework.history_entry(
    attempt integer, owner uuid, worker text, started_at timestamptz, ended_at timestamptz,
    outcome text, error text) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT jsonb_build_object('attempt', attempt, 'owner', owner, 'worker', worker,
                              'started_at', started_at, 'ended_at', ended_at,
                              'outcome', outcome, 'error', error);
$$;

-- A run's history as readers show it (show, the dashboard, leasework.testing), from its row `r`
-- (`leasework.run_history(r)`): runs.history, and
-- for a run that succeeded the entry of its successful attempt, made from the row. A success does
-- not append that entry itself: it was over a quarter of the bytes of WAL a one-at-a-time job
-- wrote (about 300 of 1,075) and 8 % of the server's instructions in its statement
-- (bench/README.md, issue 19, fourth pass), to repeat what the row holds: attempts, started_at, finished_at, and lease_worker, which
-- the seal keeps. The owner of that attempt is not kept (NULL here): lease_owner is set exactly
-- while a run is running, and a stale worker's owner-scoped write must never match a finished
-- run. A run sealed before migration 0013 has the entry already (its last), and gets no second
-- one. (Not the last entry's attempt number: a release does not charge the attempt, so the
-- success can have the number of the entry before it.)
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

-- The history a claim writes (claim_runs): a reclaimed run (`r` still running, its lease expired)
-- gets the entry of the attempt that died holding it, unless the supervisor's fast release
-- recorded it already: the last entry is that attempt's when it has its owner (the token unique
-- to the claim). Not by attempt number (migration 0021): a release or a snooze gives the attempt
-- back, so the next attempt has the number of the entry before it, and its death went unrecorded.
-- A queued run's is kept. A function so that claim_runs, with finish_and_claim around it, stays
-- within psycopg's parse cache (tests/unit/test_queries.py); LANGUAGE sql and STABLE, so the
-- planner inlines it.
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

-- At most one active (queued or running) run per key in its tenant: racing enqueues give one
-- run. A key is its tenant's: another tenant's run of the same key is another run, and runs
-- without a tenant are a namespace of their own (NULLS NOT DISTINCT). By key first: every
-- look-up names the key, the tenant only filters. (Migration 0018.)
-- Serves: enqueue_run and enqueue_many (ON CONFLICT), the promotion in expire_and_promote.
CREATE UNIQUE INDEX IF NOT EXISTS runs_one_active_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE status IN ('queued', 'running') AND key IS NOT NULL;

-- At most one waiting (exclusive, draining) run per key in its tenant. Serves: leasework.enqueue.
CREATE UNIQUE INDEX IF NOT EXISTS runs_one_waiting_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE status = 'waiting' AND key IS NOT NULL;

-- At most one window run per key in its tenant: the run an enqueue with unique_for measures its
-- window from; racing enqueues of the key give one (migration 0022). Runs enqueued without
-- unique_for have no entry. Serves: leasework.enqueue (unique_for).
CREATE UNIQUE INDEX IF NOT EXISTS runs_one_window_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE unique_at IS NOT NULL;

-- The claim reads these one kind at a time, each in (priority, queued_at, id) order (claim_runs,
-- migration 0016): a kind the claim may not take (paused, another pool's, nobody's) is never
-- walked. Queued runs only: a claim moves its run out of them and adds nothing, so a busy queue
-- leaves one dead entry per run behind (not two, as an index over running runs too would) and
-- they stay small however many finished runs accumulate. One for runs without a tenant, one for
-- runs with one (by tenant first: the claim takes tenant by tenant).
DROP INDEX IF EXISTS leasework.runs_claimable_tenanted;
DROP INDEX IF EXISTS leasework.runs_claimable_untenanted;
DROP INDEX IF EXISTS leasework.runs_queued_tenanted;
DROP INDEX IF EXISTS leasework.runs_queued_untenanted;

-- Serves: claim_runs (untenanted_queued), finish_and_claim_queued.
CREATE INDEX IF NOT EXISTS runs_queued_by_kind
    ON leasework.runs (kind, priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NULL;

-- Serves: claim_runs (tenanted_picks).
CREATE INDEX IF NOT EXISTS runs_queued_by_tenant
    ON leasework.runs (tenant, kind, priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL;

-- A tenant's best queued priority in one look-up. Serves: tenant_served.
CREATE INDEX IF NOT EXISTS runs_queued_tenant_priority
    ON leasework.runs (tenant, priority)
    WHERE status = 'queued' AND tenant IS NOT NULL;

-- A tenant's queued runs that its limiter may hold back, by group. Serves: tenant_group_pick (the
-- tenants' walk past a tenant's first runs, migration 0037). Runs that are not exclusive only:
-- an exclusive one waits while any run of its tenant runs, so the walk never reads it then.
CREATE INDEX IF NOT EXISTS runs_queued_tenant_groups
    ON leasework.runs (tenant, kind, "group", priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL AND NOT exclusive;

-- A tenant's queued exclusive runs, by group (migration 0038). Serves: tenant_group_pick for a
-- kind rated per group, when none of the tenant's runs holds a live lease (an exclusive run may
-- run then): its best exclusive run whose budget has room, found group by group as the runs
-- that are not exclusive are. Only exclusive runs: no entry for any other run.
CREATE INDEX IF NOT EXISTS runs_queued_tenant_exclusive
    ON leasework.runs (tenant, kind, "group", priority, queued_at, id)
    WHERE status = 'queued' AND tenant IS NOT NULL AND exclusive;

-- The tenants with queued runs, in turn. Serves: claim_runs (tenanted_picks), tenant_queued.
CREATE INDEX IF NOT EXISTS tenants_in_turn
    ON leasework.tenants (priority, turn, name)
    WHERE priority IS NOT NULL;

-- Serves: settle_runs (expired runs to end), claim_runs (tenanted_expired, untenanted_expired).
CREATE INDEX IF NOT EXISTS runs_running_by_expiry
    ON leasework.runs (lease_expires_at) WHERE status = 'running';

-- The rate limiter's look-up of live leases in one tenant. Serves: claim_runs, limiter_conflict.
-- Tenanted runs only, so claiming a run without a tenant does not pay an insert here.
-- (Replaced runs_running_by_tenant, which also held untenanted runs.)
DROP INDEX IF EXISTS leasework.runs_running_by_tenant;
CREATE INDEX IF NOT EXISTS runs_running_tenanted
    ON leasework.runs (tenant, lease_expires_at) WHERE status = 'running' AND tenant IS NOT NULL;

-- The rate limiter's re-check inside claim_runs (leasework/leases/lease.sql), called on each
-- tenanted run after the claim has locked it and its tenant row. It must be VOLATILE: a volatile
-- function takes a fresh snapshot for each statement it runs, so it sees every rival claim that
-- committed before we took the tenant lock, which the claim statement's own snapshot may not.
-- True: another live lease of the run's tenant conflicts: either is exclusive, or the runs of
-- the tenant's group holding one are as many as the run's kind allows at once (its group_limit,
-- leasework.kind_limits; 1 when it sets none: a group is one at a time), whatever their kinds.
-- (Migration 0023 added group_limit.)
CREATE OR REPLACE FUNCTION leasework.limiter_conflict(run_id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    blocking bigint;
    same bigint;
    run_kind text;
BEGIN
    SELECT count(*) FILTER (WHERE o.exclusive OR r.exclusive),
           count(*) FILTER (WHERE o."group" = r."group"), min(r.kind)
      INTO blocking, same, run_kind
      FROM leasework.runs r
      JOIN leasework.runs o ON o.tenant = r.tenant
     WHERE r.id = run_id
       AND o.status = 'running'
       AND o.id <> r.id
       AND o.lease_expires_at >= leasework.now();
    IF blocking > 0 THEN
        RETURN true;
    ELSIF same = 0 THEN
        RETURN false;
    END IF;
    RETURN same >= coalesce((SELECT l.group_limit FROM leasework.kind_limits l
                              WHERE l.kind = run_kind), 1);
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

-- A run with a tenant became queued (an enqueue, a retry, a release, a promotion, an operator's
-- retry): its tenant has queued runs, with this run's priority at best. Only a tenant that had
-- none, or only worse ones, has its row written (a tenant new to the turns starts at the turn of
-- the tenant next in line, so a tenant back from idle waits at most one turn and gets no burst
-- for the turns it missed). The shared advisory lock, held to the end of the enqueuing
-- transaction, keeps tenant_served from setting the tenant's priority to NULL until this run
-- is visible: a claim that sees no queued run left would otherwise drop a tenant whose new run
-- commits a moment later. Advisory, not a row lock: a row lock on a tenant row that claims
-- update makes a REPEATABLE READ enqueue fail with a serialization error.
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

-- On insert only: the five statements that make an existing tenanted run queued again
-- (requeue_run, release_run, snooze_run, expire_and_promote's promotion, operations' retry_runs) call
-- tenant_queued_run themselves. A row trigger on UPDATE cost every claim and seal: a BEFORE one
-- locks each row it updates first, whatever its WHEN says (a WAL record per job), an AFTER one
-- fetches each old row again (bench/README.md, issue 29).
DROP TRIGGER IF EXISTS runs_tenant_requeued ON leasework.runs;
DROP TRIGGER IF EXISTS runs_tenant_queued ON leasework.runs;
CREATE TRIGGER runs_tenant_queued
    BEFORE INSERT ON leasework.runs
    FOR EACH ROW WHEN (NEW.tenant IS NOT NULL AND NEW.status = 'queued')
    EXECUTE FUNCTION leasework.tenant_queued();

-- Called by claim_runs for each run with a tenant it claims, after it locked the tenant row: the
-- tenant's turn advances by 1 / weight, and its priority becomes that of its best queued run
-- left (NULL: none), read with a fresh snapshot (VOLATILE), only when no enqueue of that tenant
-- is in progress (the advisory lock tenant_queued shares); otherwise it is left as it is, at
-- worst better than the truth, which costs a probe and never loses a run.
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

-- Runs without a tenant take turns with the tenants as one more participant (migration 0033;
-- docs/concepts.md, "Turns"): their weight and their turn, one row. claim_runs reads and locks it
-- only while tenants' picks compete with runs without a tenant in one statement (SKIP LOCKED: a
-- claim never waits for it), and leasework.untenanted_served advances it by the runs it took.
CREATE TABLE IF NOT EXISTS leasework.untenanted_turn (
    one    boolean PRIMARY KEY DEFAULT true CONSTRAINT untenanted_turn_one CHECK (one),
    weight double precision NOT NULL DEFAULT 1
           CONSTRAINT untenanted_turn_weight_valid CHECK (weight >= 0.001 AND weight <= 1000),
    turn   double precision NOT NULL DEFAULT 0
);
INSERT INTO leasework.untenanted_turn DEFAULT VALUES ON CONFLICT DO NOTHING;

-- Called by claim_runs when it took `taken` runs without a tenant while tenants competed, holding
-- the row's lock (its `contest`): their turn moves on from `base` (their turn, never behind the
-- first tenant's pick) by taken / weight.
CREATE OR REPLACE FUNCTION leasework.untenanted_served(base double precision, taken bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE leasework.untenanted_turn u
       SET turn = untenanted_served.base + untenanted_served.taken / u.weight;
    RETURN true;
END
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

-- When the first queued run of `kind` (and `tenant`) is due, NULL when there is none: per
-- priority present, its first entry (one look-up each). In the past when a run is due yet was not
-- claimed (a row another session holds, a tenant the limiter holds back): the idle worker then
-- polls every poll_interval (migration 0020). Serves next_due, as due_priority the claim.
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
               AND r.priority = p;
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
               AND r.status = 'queued' AND r.priority = p;
            best := least(best, q);
            SELECT min(r.priority) INTO p FROM leasework.runs r
             WHERE r.tenant = next_due_at.tenant AND r.kind = next_due_at.kind
               AND r.status = 'queued' AND r.priority > p;
        END LOOP;
    END IF;
    RETURN best;
END
$$;

-- Why a label (key, tenant, group) is refused by leasework.enqueue, or NULL when it is fine: the
-- rule of leasework.text.label_problem, word for word (1-200 characters; no C0 or C1 control,
-- DEL, bidi control or line/paragraph separator: U+0001-U+001F, U+007F-U+009F, U+061C,
-- U+200E-U+200F, U+2028-U+202E, U+2066-U+2069), which tests/security/test_labels.py holds equal.
CREATE OR REPLACE FUNCTION leasework.label_problem(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN value IS NULL THEN NULL
        WHEN length(value) NOT BETWEEN 1 AND 200 THEN 'must be 1-200 characters long'
        WHEN value ~ '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]'
        THEN 'contains control characters (U+' || lpad(upper(to_hex(ascii(substring(value FROM
            '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]')))), 4, '0')
            || '; no C0/C1 control, DEL, bidi control or line separator is allowed)'
    END;
$$;

-- Why `payload` cannot be given to the handler of `kind` whose workers declared `accepts`
-- (leasework.kinds), or NULL when it can: not a JSON object for a handler that takes keywords, a
-- required key missing, a key it does not take. The words of Python's check (tasks.Accepts), so
-- that an enqueue is refused alike from Python and from SQL. No SET clause: it runs under its
-- caller's search_path (leasework.enqueue's pinned one), since a SET here cost a checked enqueue
-- a third of the check (bench/enqueue_check.py); PUBLIC may not execute it. (Migration 0029.)
CREATE OR REPLACE FUNCTION leasework.payload_problem(kind text, payload jsonb, accepts jsonb)
RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    takes text := accepts->>'takes';
    problem text;
BEGIN
    IF takes IS NULL OR takes NOT IN ('keywords', 'fields') THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(payload) IS DISTINCT FROM 'object' THEN
        IF takes = 'fields' THEN
            RETURN NULL;  -- passed to the handler as it is
        END IF;
        problem := format('the payload is a JSON %s, not an object', jsonb_typeof(payload));
    ELSE
        -- A key it does not take first: a misspelt key is what went wrong, not the one it misses.
        IF jsonb_typeof(accepts->'allowed') = 'array' THEN
            SELECT 'the payload has an unexpected key ' || quote_literal(k.key)
              INTO problem
              FROM jsonb_object_keys(payload) AS k(key)
             WHERE NOT accepts->'allowed' ? k.key
             LIMIT 1;
        END IF;
        IF problem IS NULL THEN
            SELECT 'the payload has no key ' || string_agg(quote_literal(r.key), ', ')
              INTO problem
              FROM jsonb_array_elements_text(accepts->'required') AS r(key)
             WHERE NOT payload ? r.key;
        END IF;
    END IF;
    IF problem IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN format('task %s cannot take this payload: %s; its handler takes %s',
                  quote_literal(kind), problem, coalesce(accepts->>'describe', takes));
END
$$;

REVOKE EXECUTE ON FUNCTION leasework.payload_problem(text, jsonb, jsonb) FROM PUBLIC;

-- The second half of the advisory lock a keyed enqueue holds (shared) until its transaction ends
-- and expire_and_promote tries (exclusive) before promoting the key's waiting run, with classid
-- -1682930272 (hashtext('leasework.key')): the tenant and the key hashed together, a run without
-- a tenant its key alone. A collision only delays a promotion. One definition for both sides
-- (migration 0018): if they hashed differently, the promotion would wait on an open enqueue again.
-- Qualified and without SET, so that the planner inlines it.
CREATE OR REPLACE FUNCTION leasework.key_lock(tenant text, key text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtext(CASE WHEN tenant IS NULL THEN key
                                    ELSE tenant OPERATOR(pg_catalog.||) E'\x1f'
                                         OPERATOR(pg_catalog.||) key END);
$$;

-- Dependencies (migration 0026, README "Workflows"). A run enqueued with `after` waits, status
-- `blocked`, until every run it waits for (its parents) has ended; then the deps stage
-- (leasework/stages/deps.sql) makes it `queued` (due now, or at its delay if later), or ends it
-- `cancelled` when a parent ended `failed` or `cancelled` and the edge's policy is to cancel
-- (`anyway` false, the default). A parent must exist when the child is enqueued, so there is no
-- cycle. `member`: the parent is a member of the batch whose callback is `child` (counted in the
-- callback's batch counts; an edge to the handler that opened the batch is not).
-- Serves: leasework.enqueue_blocked, the deps stage, ctx.parents(), `leasework show`.
CREATE TABLE IF NOT EXISTS leasework.run_deps (
    child   bigint NOT NULL,
    parent  bigint NOT NULL,
    anyway  boolean NOT NULL DEFAULT false,
    member  boolean NOT NULL DEFAULT false,
    PRIMARY KEY (child, parent)
);

-- A parent's children. Serves: lock_children (stages/deps.sql), `leasework show`.
CREATE INDEX IF NOT EXISTS run_deps_by_parent ON leasework.run_deps (parent);

-- The deps stage's inbox: a parent whose children may now be decided (it ended: the trigger
-- runs_ended) or whose end must be watched for (an enqueue after a run it did not make:
-- the stage sets its has_dependents, which that enqueue must not do itself, since the lock of a
-- running parent's row would hold its worker's renewal and seal until the enqueue commits). No
-- unique constraint: a seal must never wait on an enqueue's uncommitted row of the same parent.
CREATE TABLE IF NOT EXISTS leasework.run_deps_ended (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    parent  bigint NOT NULL
);

-- A parent's inbox rows, taken together. Serves: take_parent (stages/deps.sql).
CREATE INDEX IF NOT EXISTS run_deps_ended_by_parent ON leasework.run_deps_ended (parent);

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

-- leasework.enqueue with `after` (its arguments checked there already): a run that waits for the
-- runs `after`. Refused with a key, exclusive, unique_for or debounce (a run that waits holds no
-- key: one clear rule rather than a key held, or not, while its parents run). Every parent must
-- exist. The run is inserted `blocked` while a parent has not ended; when all have, `queued`
-- (due at its delay) or, a parent `failed` or `cancelled` under the cancel policy, `cancelled`
-- at once. A parent this transaction made is marked has_dependents here (nobody else sees its
-- row, so nobody can wait on it); every other unended parent gets a row in run_deps_ended, which
-- the deps stage reads after this commits: it marks the parent, and decides this run if the
-- parent ended meanwhile (its end may have committed before this run was visible).
-- `on_parent_failure`: 'cancel' (default), 'run', or 'batch' (run anyway, and the parents are
-- the members of the batch whose callback this run is: leasework.join_batch, below).
CREATE OR REPLACE FUNCTION leasework.enqueue_blocked(
    kind text, payload jsonb, key text, tenant text, "group" text, exclusive boolean,
    priority integer, delay double precision, max_attempts integer,
    lease_seconds double precision, timeout_seconds double precision, windowed boolean,
    after bigint[], on_parent_failure text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    run_id bigint;
    missing bigint;
    open_count bigint;
    bad record;
    new_status text;
    anyway boolean;
BEGIN
    IF enqueue_blocked.on_parent_failure IS NULL THEN
        enqueue_blocked.on_parent_failure := 'cancel';
    ELSIF enqueue_blocked.on_parent_failure NOT IN ('cancel', 'run', 'batch') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'on_parent_failure must be ''cancel'', ''run'' or ''batch'', got %s',
            quote_literal(left(enqueue_blocked.on_parent_failure, 80)));
    END IF;
    anyway := enqueue_blocked.on_parent_failure IN ('run', 'batch');
    IF enqueue_blocked.after IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'on_parent_failure needs after: the runs this run waits for';
    END IF;
    IF enqueue_blocked.key IS NOT NULL OR enqueue_blocked.exclusive
       OR enqueue_blocked.windowed THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE =
            'after cannot be combined with key, exclusive, unique_for or debounce: a run that '
            'waits for other runs holds no key';
    END IF;
    IF cardinality(enqueue_blocked.after) > 10000
       OR array_position(enqueue_blocked.after, NULL) IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'after must be a list of at most 10000 run ids without NULL, got %s ids',
            cardinality(enqueue_blocked.after));
    END IF;
    SELECT min(a) INTO missing
      FROM unnest(enqueue_blocked.after) AS a
     WHERE NOT EXISTS (SELECT 1 FROM leasework.runs r WHERE r.id = a);
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'after: there is no run %s (a run can only wait for runs that exist)', missing);
    END IF;
    SELECT count(*) FILTER (WHERE r.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled'))
      INTO open_count
      FROM leasework.runs r WHERE r.id = ANY (enqueue_blocked.after);
    SELECT r.id, r.status INTO bad
      FROM leasework.runs r
     WHERE r.id = ANY (enqueue_blocked.after) AND r.status IN ('failed', 'cancelled')
     ORDER BY r.id LIMIT 1;
    new_status := CASE WHEN open_count > 0 THEN 'blocked'
                       WHEN bad.id IS NOT NULL AND NOT anyway THEN 'cancelled'
                       ELSE 'queued' END;
    INSERT INTO leasework.runs (kind, tenant, "group", priority, status, payload, max_attempts,
                                lease_seconds, timeout_seconds, queued_at, finished_at, error)
    VALUES (enqueue_blocked.kind, enqueue_blocked.tenant, enqueue_blocked."group",
            enqueue_blocked.priority, new_status, enqueue_blocked.payload,
            enqueue_blocked.max_attempts, enqueue_blocked.lease_seconds,
            enqueue_blocked.timeout_seconds,
            leasework.now() + make_interval(secs => enqueue_blocked.delay),
            CASE WHEN new_status = 'cancelled' THEN leasework.now() END,
            CASE WHEN new_status = 'cancelled'
                 THEN format('run %s, which it waited for, ended %s', bad.id, bad.status) END)
    RETURNING id INTO run_id;
    INSERT INTO leasework.run_deps (child, parent, anyway, member)
    SELECT DISTINCT run_id, a, anyway, enqueue_blocked.on_parent_failure = 'batch'
      FROM unnest(enqueue_blocked.after) AS a;
    IF open_count > 0 THEN
        UPDATE leasework.runs r SET has_dependents = true
         WHERE r.id = ANY (enqueue_blocked.after) AND NOT r.has_dependents
           AND r.xmin = pg_current_xact_id()::xid;
        INSERT INTO leasework.run_deps_ended (parent)
        SELECT r.id FROM leasework.runs r
         WHERE r.id = ANY (enqueue_blocked.after)
           AND r.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled')
           AND r.xmin <> pg_current_xact_id()::xid;
        IF FOUND THEN
            PERFORM pg_notify('leasework', 'leasework:deps');
        END IF;
    ELSIF new_status = 'queued' THEN
        PERFORM pg_notify('leasework', enqueue_blocked.kind);
    END IF;
    PERFORM set_config('leasework.enqueued_existing', 'false', true);
    RETURN run_id;
END
$$;

-- A batch (README "Workflows", "Batches") is a callback run that waits, under the policy
-- 'batch' (run anyway; its parents counted as the batch's members), for its members; it is open
-- while that callback is `blocked`. Run `run` joins batch `batch` (the callback's id): an edge
-- `member`, made only while the callback is blocked, its row locked FOR NO KEY UPDATE (the deps
-- stage takes it SKIP LOCKED, so it decides it only after this commits, counting `run`). Only
-- a run that waits for nothing joins (so no cycle: a callback waits for its members, which wait
-- for nothing). `run` is marked has_dependents when this transaction made it, else recorded for
-- the deps stage (as leasework.enqueue_blocked does). SECURITY DEFINER: the enqueue role's way
-- to add to a batch.
CREATE OR REPLACE FUNCTION leasework.join_batch(batch bigint, run bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    callback_status text;
    run_status text;
BEGIN
    SELECT r.status INTO callback_status
      FROM leasework.runs r WHERE r.id = join_batch.batch FOR NO KEY UPDATE;
    IF callback_status IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'there is no batch %s: no run has that id', join_batch.batch);
    ELSIF callback_status <> 'blocked' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'batch %s is closed: its callback is %s (a run joins a batch only while its '
            'callback waits)', join_batch.batch, callback_status);
    END IF;
    SELECT r.status INTO run_status FROM leasework.runs r WHERE r.id = join_batch.run;
    IF run_status IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'there is no run %s to join batch %s', join_batch.run, join_batch.batch);
    END IF;
    IF join_batch.run = join_batch.batch
       OR EXISTS (SELECT 1 FROM leasework.run_deps d WHERE d.child = join_batch.run) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s waits for other runs: only a run without after joins a batch',
            join_batch.run);
    END IF;
    INSERT INTO leasework.run_deps (child, parent, anyway, member)
    VALUES (join_batch.batch, join_batch.run, true, true)
    ON CONFLICT (child, parent) DO NOTHING;
    IF run_status NOT IN ('succeeded', 'partial', 'failed', 'cancelled') THEN
        UPDATE leasework.runs r SET has_dependents = true
         WHERE r.id = join_batch.run AND NOT r.has_dependents
           AND r.xmin = pg_current_xact_id()::xid;
        IF NOT EXISTS (SELECT 1 FROM leasework.runs r
                        WHERE r.id = join_batch.run AND r.xmin = pg_current_xact_id()::xid) THEN
            INSERT INTO leasework.run_deps_ended (parent) VALUES (join_batch.run);
            PERFORM pg_notify('leasework', 'leasework:deps');
        END IF;
    END IF;
END
$$;

-- Whether `x`, the xmin of a row this statement sees, is the id of this transaction or of one of
-- its subtransactions (a savepoint's): a row another transaction wrote is seen only once that
-- transaction committed, so a row whose writer is still in progress was written here. The 32-bit
-- id is widened by this transaction's own (`pg_current_xact_id()`): a subtransaction's id is never
-- older, and an id older than it (or a special one, below 3) is another transaction's.
CREATE OR REPLACE FUNCTION leasework.written_by_this_transaction(x xid) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN x::text::bigint >= 3 AND s.ahead < 2147483648
                THEN pg_xact_status((s.top + s.ahead)::text::xid8) = 'in progress'
                ELSE false END
      FROM (SELECT t.top, (x::text::bigint - t.top % 4294967296 + 4294967296) % 4294967296
                       AS ahead
              FROM (SELECT pg_current_xact_id()::text::bigint AS top) t) s
$$;

-- A policy per dependency (README "Workflows"): what the end `failed` or `cancelled` of run
-- `parent` means for run `child`, which waits for it: 'cancel' (the child is cancelled) or 'run'
-- (it runs anyway). The child's other parents keep the policy of its enqueue
-- (`on_parent_failure`). Only in the transaction that enqueued the child, before it commits (the
-- edge must have been written by this transaction): no other session sees the child or its edges
-- until then, so the deps stage, which decides a child from committed edges only, decides it by
-- the policies as set; on a committed child a deps step could be deciding it at that moment by
-- the policy it had read. A child its enqueue decided at once (every parent had ended) is
-- decided again by its edges as they now are: `queued` (its kind notified), or `cancelled` with
-- the error a parent's end gives it; a run cancelled by a cancel request stays so. Refused: an
-- edge of a batch member (a batch's callback counts every member), a run other runs already wait
-- for (they were enqueued by its status: set the policies first). Returns the child's status.
-- SECURITY DEFINER: the enqueue role's way to set it, on runs of its own transaction only.
CREATE OR REPLACE FUNCTION leasework.set_dependency_policy(child bigint, parent bigint,
                                                           policy text)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    edge record;
    run record;
    bad record;
BEGIN
    IF set_dependency_policy.policy IS NULL
       OR set_dependency_policy.policy NOT IN ('cancel', 'run') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'policy must be ''cancel'' or ''run'', got %s',
            coalesce(quote_literal(left(set_dependency_policy.policy, 80)), 'NULL'));
    END IF;
    SELECT d.member, d.xmin AS made INTO edge
      FROM leasework.run_deps d
     WHERE d.child = set_dependency_policy.child AND d.parent = set_dependency_policy.parent;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s does not wait for run %s: a policy is set on a dependency its enqueue made '
            '(after)', set_dependency_policy.child, set_dependency_policy.parent);
    ELSIF edge.member THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s is a member of batch %s, whose callback runs whatever its members'' ends: '
            'a member has no policy', set_dependency_policy.parent, set_dependency_policy.child);
    ELSIF NOT leasework.written_by_this_transaction(edge.made) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s was enqueued by another transaction: a dependency''s policy is set in the '
            'transaction that enqueues its run, before it commits', set_dependency_policy.child);
    END IF;
    SELECT r.id, r.kind, r.status, r.tenant, r.priority, r.cancel_requested_at INTO run
      FROM leasework.runs r WHERE r.id = set_dependency_policy.child FOR UPDATE;
    IF EXISTS (SELECT 1 FROM leasework.run_deps d WHERE d.parent = set_dependency_policy.child) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'runs already wait for run %s: set its dependencies'' policies before enqueuing runs '
            'after it', set_dependency_policy.child);
    END IF;
    UPDATE leasework.run_deps d SET anyway = set_dependency_policy.policy = 'run'
     WHERE d.child = set_dependency_policy.child AND d.parent = set_dependency_policy.parent;
    IF run.status IN ('queued', 'cancelled') AND run.cancel_requested_at IS NULL THEN
        SELECT d.parent AS id, p.status INTO bad
          FROM leasework.run_deps d
          JOIN leasework.runs p ON p.id = d.parent
         WHERE d.child = set_dependency_policy.child AND NOT d.anyway
           AND p.status IN ('failed', 'cancelled')
         ORDER BY d.parent LIMIT 1;
        IF bad.id IS NULL AND run.status = 'cancelled' THEN
            UPDATE leasework.runs r SET status = 'queued', finished_at = NULL, error = NULL
             WHERE r.id = run.id;
            IF run.tenant IS NOT NULL THEN
                PERFORM leasework.tenant_queued_run(run.tenant, run.priority);
            END IF;
            PERFORM pg_notify('leasework', run.kind);
            RETURN 'queued';
        ELSIF bad.id IS NOT NULL AND run.status = 'queued' THEN
            UPDATE leasework.runs r
               SET status = 'cancelled', finished_at = leasework.now(),
                   error = format('run %s, which it waited for, ended %s', bad.id, bad.status)
             WHERE r.id = run.id;
            RETURN 'cancelled';
        END IF;
    END IF;
    RETURN run.status;
END
$$;

-- Why leasework.enqueue refuses its unique window and debounce arguments, or NULL when they are
-- fine: the rules of leasework.tasks.check_windows, in the same order and words (ranges first,
-- then what may not go together). Called only when one of them is given.
CREATE OR REPLACE FUNCTION leasework.window_problem(
    key text, exclusive boolean, delay double precision, unique_for double precision,
    debounce double precision, debounce_max double precision, merge_into bigint)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN NOT coalesce(unique_for > 0 AND unique_for <= 31536000, unique_for IS NULL)
        THEN format('unique_for must be a number of seconds above 0 to 31536000 (365 days), '
                    'got %s', unique_for)
        WHEN NOT coalesce(debounce > 0 AND debounce <= 31536000, debounce IS NULL)
        THEN format('debounce must be a number of seconds above 0 to 31536000 (365 days), '
                    'got %s', debounce)
        WHEN NOT coalesce(debounce_max > 0 AND debounce_max <= 31536000, debounce_max IS NULL)
        THEN format('debounce_max must be a number of seconds above 0 to 31536000 (365 days), '
                    'got %s', debounce_max)
        WHEN debounce IS NULL AND debounce_max IS NOT NULL
        THEN 'debounce_max needs debounce: it bounds how far enqueues postpone a debounced run'
        WHEN debounce IS NULL AND merge_into IS NOT NULL
        THEN 'merge_into needs debounce: it is the second half of a debounced merge'
        WHEN debounce_max < debounce
        THEN format('debounce_max must be at least debounce (%s), got %s', debounce, debounce_max)
        WHEN unique_for IS NOT NULL AND debounce IS NOT NULL
        THEN 'unique_for and debounce cannot be combined: a unique window keeps the key''s run '
             'as it is, a debounce changes it; give one of them'
        WHEN key IS NULL
        THEN format('%s needs a key: it applies to the runs of one key in its tenant',
                    CASE WHEN unique_for IS NOT NULL THEN 'unique_for' ELSE 'debounce' END)
        WHEN exclusive
        THEN format('exclusive cannot be combined with %s: an exclusive run waits for its key '
                    'whatever came before it',
                    CASE WHEN unique_for IS NOT NULL THEN 'unique_for' ELSE 'debounce' END)
        WHEN debounce IS NOT NULL AND delay <> 0
        THEN 'delay cannot be combined with debounce: a debounced run is due debounce seconds '
             'after its last enqueue'
    END;
$$;

-- Why an enqueue's tags are refused, or NULL (migration 0030): at most 20, none NULL, each a
-- label (leasework.label_problem: 1-200 characters, no control, bidi control or line separator).
-- The words of leasework.tasks.check_tags.
CREATE OR REPLACE FUNCTION leasework.tags_problem(tags text[]) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN tags IS NULL THEN NULL
        WHEN cardinality(tags) > 20 THEN format('tags: at most 20 per run, got %s', cardinality(tags))
        WHEN array_position(tags, NULL) IS NOT NULL THEN 'tags must not hold NULL'
        -- Named by position, not shown: a refused tag may hold what no line should.
        ELSE (SELECT format('tag %s of %s %s', n, cardinality(tags), leasework.label_problem(t))
                FROM unnest(tags) WITH ORDINALITY AS u(t, n)
               WHERE leasework.label_problem(t) IS NOT NULL
               ORDER BY n
               LIMIT 1)
    END;
$$;

-- Enqueue from SQL (triggers, other languages, and App.enqueue itself): the one way the enqueue
-- role writes a run. SECURITY DEFINER, so that role needs no privilege on leasework.runs or
-- leasework.tenants and cannot choose a status, a lease, an id or a timestamp; it checks what it
-- is given as leasework/tasks.py does (kind, labels, priority, attempts, a finite delay of at
-- most 365 days, lease and timeout in range, a payload of at most 64 MiB: the top of
-- payload_max_bytes, whose configured value the Python path enforces) and raises 22023 naming
-- the bad argument. With a key, at most one active run per key in its tenant: a second enqueue
-- returns the active run's id; an exclusive run whose key is busy waits (one waiting run per key
-- in its tenant). A key under 'leasework:' (the families') is refused with 42501 to a caller that
-- may not insert into leasework.runs itself (migration 0018). NOTIFY
-- wakes idle workers at commit. search_path is pinned so a caller's objects cannot stand in for
-- ours. priority and max_attempts are taken as double precision (every SQL number converts to it
-- implicitly) and checked to be whole and in range here: as integer parameters, an out-of-range
-- value such as 2^40 or 1099511627776 found no function to call and got "function
-- leasework.enqueue(...) does not exist" instead of the range. (Migration 0011.)
-- Unique windows and debounce (migration 0022; README "Flow control" states the rules), each
-- given with a key and checked only when given, so an enqueue without them runs what it ran
-- before:
-- `unique_for` seconds: the key's window run (the one run of the key in its tenant with
-- unique_at set, runs_one_window_per_key) is returned while it is active, or while it was
-- enqueued less than unique_for ago and did not end failed or cancelled; otherwise it gives up
-- its mark (a finished run: no worker writes it) and a new run takes it. The mark's unique index
-- and the row lock of that update make racing enqueues of one key give one run, whatever the
-- isolation level (REPEATABLE READ gets a serialization failure, as the key rule gives it).
-- `debounce` seconds (`debounce_max`): the key's pending run of this kind that a debounce made
-- (queued, else waiting; locked) takes this payload and is due `debounce` from now, never later
-- than its first enqueue + debounce_max; with none, a new one is made, queued when the key is
-- idle, waiting behind its running run otherwise (promoted when the key is idle, as an
-- exclusive run is). `merge_into` / `merge_seen` are the second half of a merge done by the
-- caller (Python's debounce_merge, after leasework.debounce_pending): the payload is the merge
-- of run `merge_into`'s, read when its debounce_count was `merge_seen` (0: none was pending);
-- when that is no longer so, nothing is written and NULL is returned, and the caller reads and
-- merges again.
-- Read back by enqueue_run (runs.sql), leasework.enqueued_existing says which happened: false
-- (a new run), true (the key's active or waiting run), window, debounced.
-- A payload the kind's handler cannot take, as its workers declared it (leasework.kinds.accepts),
-- is refused with 22023 naming the kind, what was wrong and what the handler takes (migration
-- 0029): one look-up by primary key per enqueue.
CREATE OR REPLACE FUNCTION leasework.enqueue(
    kind text,
    payload jsonb DEFAULT '{}',
    key text DEFAULT NULL,
    tenant text DEFAULT NULL,
    "group" text DEFAULT NULL,
    exclusive boolean DEFAULT false,
    priority double precision DEFAULT 0,
    delay double precision DEFAULT 0,
    max_attempts double precision DEFAULT 3,
    lease_seconds double precision DEFAULT NULL,
    timeout_seconds double precision DEFAULT 3600,
    unique_for double precision DEFAULT NULL,
    debounce double precision DEFAULT NULL,
    debounce_max double precision DEFAULT NULL,
    merge_into bigint DEFAULT NULL,
    merge_seen integer DEFAULT NULL,
    -- Dependencies (migration 0026): leasework.enqueue_blocked, below.
    after bigint[] DEFAULT NULL,
    on_parent_failure text DEFAULT NULL,
    -- Tags (migration 0030): leasework.tags_problem; the block at the top of the body.
    tags text[] DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    run_id bigint;
    problem text;
    wanted text[];
    held record;
    pending record;
    active record;
    mergeable boolean;
    due timestamptz;
    declared jsonb;
BEGIN
    -- Tags (migration 0030), the only change 0030 makes to this body: a run with tags is
    -- enqueued by this same function without them (every check and path below, unchanged), and
    -- the run it made gets them (a debounced run takes them with the payload; a key's existing
    -- run returned keeps its own). A run without tags pays this one test.
    IF enqueue.tags IS NOT NULL THEN
        problem := leasework.tags_problem(enqueue.tags);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = problem;
        END IF;
        PERFORM set_config('leasework.enqueued_existing', 'false', true);
        run_id := leasework.enqueue(
            enqueue.kind, enqueue.payload, enqueue.key, enqueue.tenant, enqueue."group",
            enqueue.exclusive, enqueue.priority, enqueue.delay, enqueue.max_attempts,
            enqueue.lease_seconds, enqueue.timeout_seconds, enqueue.unique_for, enqueue.debounce,
            enqueue.debounce_max, enqueue.merge_into, enqueue.merge_seen, enqueue.after,
            enqueue.on_parent_failure, NULL);
        IF run_id IS NOT NULL AND cardinality(enqueue.tags) > 0
           AND current_setting('leasework.enqueued_existing', true) IN ('false', 'debounced') THEN
            UPDATE leasework.runs r
               SET tags = ARRAY(SELECT DISTINCT t FROM unnest(enqueue.tags) AS t ORDER BY t)
             WHERE r.id = run_id;
        END IF;
        RETURN run_id;
    END IF;
    -- The checks below, in one expression first (migration 0034): each IF is an expression of
    -- its own, which PL/pgSQL compiles again in every transaction (its state lives as long as
    -- the transaction), and an enqueue is most often its transaction's only call; they were a
    -- fifth of the function's time in a pickup (bench/README.md, issue 30, fourth pass). True
    -- only when every check below passes (each one's condition false), so they run, and raise
    -- as they always did, whenever it is not: a label, a window or a value out of range goes
    -- the long way, and so does a NULL anywhere in it (IS NOT TRUE).
    IF (enqueue.kind IS NOT NULL AND length(enqueue.kind) BETWEEN 1 AND 200
            AND translate(enqueue.kind,
                          'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/@+-',
                          '') = ''
            AND enqueue.key IS NULL AND enqueue.tenant IS NULL AND enqueue."group" IS NULL
            AND enqueue.exclusive IS NOT NULL
            AND enqueue.priority = trunc(enqueue.priority)
            AND enqueue.priority BETWEEN -2147483648 AND 2147483647
            AND enqueue.delay >= 0 AND enqueue.delay <= 31536000
            AND enqueue.max_attempts BETWEEN 1 AND 1000
            AND enqueue.max_attempts = trunc(enqueue.max_attempts)
            AND coalesce(enqueue.lease_seconds >= 1 AND enqueue.lease_seconds <= 86400, true)
            AND coalesce(enqueue.timeout_seconds > 0 AND enqueue.timeout_seconds <= 2592000, true)
            AND enqueue.unique_for IS NULL AND enqueue.debounce IS NULL
            AND enqueue.debounce_max IS NULL AND enqueue.merge_into IS NULL) IS NOT TRUE THEN
        -- The kind's rule, ^[A-Za-z0-9_.:/@+-]{1,200}$, without a regular expression: after a
        -- pause the regex engine took up to a quarter of an enqueue's time (bench/README.md, issue 19,
        -- sixth pass), translate() a loop over the characters.
        IF enqueue.kind IS NULL OR length(enqueue.kind) NOT BETWEEN 1 AND 200
           OR translate(enqueue.kind,
                        'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/@+-',
                        '') <> '' THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'kind %s is not valid: use 1-200 characters from letters, digits and _ . : / @ + -',
                -- A kind with a control character is shown JSON-quoted (escaped), so that a newline
                -- in it cannot break the one-line error.
                CASE WHEN enqueue.kind IS NULL THEN 'NULL'
                     WHEN enqueue.kind ~ '[\x01-\x1f\x7f]' THEN to_jsonb(left(enqueue.kind, 80))::text
                     ELSE quote_literal(left(enqueue.kind, 80)) END);
        END IF;
        -- Each label set is checked; an unset one costs nothing (no query, no call).
        problem := coalesce(
            CASE WHEN enqueue.key IS NOT NULL THEN 'key ' || leasework.label_problem(enqueue.key) END,
            CASE WHEN enqueue.tenant IS NOT NULL
                 THEN 'tenant ' || leasework.label_problem(enqueue.tenant) END,
            CASE WHEN enqueue."group" IS NOT NULL
                 THEN 'group ' || leasework.label_problem(enqueue."group") END);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = problem;
        END IF;
        -- A key under 'leasework:' is the families' (leasework:connection:{id}, leasework:file:{id}):
        -- refused to a caller that may not insert into leasework.runs itself, so the enqueue role can
        -- neither hold nor take a connection's or a file's runs (the worker role and the owner, whose
        -- sessions enqueue them, gain nothing by it). The caller is the role its session SET, else its
        -- login: inside this function current_user is the function's owner.
        -- coalesce: without a key starts_with gives NULL, and NULL AND x still evaluates x, so the
        -- privilege look-up ran on every enqueue without a key (migration 0034).
        IF coalesce(starts_with(enqueue.key, 'leasework:'), false) AND NOT has_table_privilege(
               coalesce(nullif(current_setting('role'), 'none'), session_user),
               'leasework.runs', 'INSERT') THEN
            RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
                'key %s is refused: keys starting with ''leasework:'' are reserved for leasework''s '
                'own families (connections, files); use a key without that prefix',
                quote_literal(left(enqueue.key, 80)));
        END IF;
        IF enqueue.priority IS NULL OR enqueue.exclusive IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'priority and exclusive must not be NULL';
        END IF;
        IF NOT (enqueue.priority = trunc(enqueue.priority)
                AND enqueue.priority BETWEEN -2147483648 AND 2147483647) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'priority must be an integer from -2147483648 to 2147483647 (lower runs first), got %s',
                enqueue.priority);
        END IF;
        IF NOT coalesce(enqueue.delay >= 0 AND enqueue.delay <= 31536000, false) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'delay must be a number of seconds from 0 to 31536000 (365 days), got %s', enqueue.delay);
        END IF;
        IF NOT coalesce(enqueue.max_attempts BETWEEN 1 AND 1000
                        AND enqueue.max_attempts = trunc(enqueue.max_attempts), false) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'max_attempts must be an integer from 1 to 1000, got %s', enqueue.max_attempts);
        END IF;
        IF NOT coalesce(enqueue.lease_seconds >= 1 AND enqueue.lease_seconds <= 86400, true) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'lease_seconds must be from 1 to 86400, got %s', enqueue.lease_seconds);
        END IF;
        IF NOT coalesce(enqueue.timeout_seconds > 0 AND enqueue.timeout_seconds <= 2592000, true) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
                'timeout_seconds must be > 0 and at most 2592000 (30 days), got %s',
                enqueue.timeout_seconds);
        END IF;
        IF enqueue.unique_for IS NOT NULL OR enqueue.debounce IS NOT NULL
           OR enqueue.debounce_max IS NOT NULL OR enqueue.merge_into IS NOT NULL THEN
            problem := leasework.window_problem(enqueue.key, enqueue.exclusive, enqueue.delay,
                                                enqueue.unique_for, enqueue.debounce,
                                                enqueue.debounce_max, enqueue.merge_into);
            IF problem IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = problem;
            END IF;
        END IF;
    END IF;
    -- SQL NULL and JSON null alike are stored as {}, as the Python path stores None.
    IF enqueue.payload IS NULL OR jsonb_typeof(enqueue.payload) = 'null' THEN
        enqueue.payload := '{}';
    ELSIF octet_length(enqueue.payload::text) > 67108864 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'payload is over 67108864 bytes (64 MiB)';
    END IF;
    -- The payloads the kind's workers declared their handler takes (leasework.kinds.accepts,
    -- migration 0029): one look-up by primary key; nothing more for a kind that declared none or
    -- takes any JSON.
    SELECT k.accepts INTO declared FROM leasework.kinds k WHERE k.kind = enqueue.kind;
    IF declared IS NOT NULL AND declared->>'takes' <> 'any' THEN
        problem := leasework.payload_problem(enqueue.kind, enqueue.payload, declared);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = problem;
        END IF;
    END IF;
    IF enqueue.tenant IS NOT NULL THEN
        INSERT INTO leasework.tenants (name) VALUES (enqueue.tenant) ON CONFLICT (name) DO NOTHING;
    END IF;
    -- A run that waits for others (migration 0026): its own function, so that nothing above or
    -- below changes for a run without them.
    IF enqueue.after IS NOT NULL OR enqueue.on_parent_failure IS NOT NULL THEN
        RETURN leasework.enqueue_blocked(
            enqueue.kind, enqueue.payload, enqueue.key, enqueue.tenant, enqueue."group",
            enqueue.exclusive, enqueue.priority::integer, enqueue.delay,
            enqueue.max_attempts::integer, enqueue.lease_seconds, enqueue.timeout_seconds,
            enqueue.unique_for IS NOT NULL OR enqueue.debounce IS NOT NULL,
            enqueue.after, enqueue.on_parent_failure);
    END IF;
    -- Without a key nothing can conflict: a plain INSERT, not the ON CONFLICT one below, whose
    -- speculative insertion takes and releases a lock per row. An enqueue's time counts in its
    -- run's pickup latency (created_at is its transaction's start; bench/pickup_latency.py).
    IF enqueue.key IS NULL THEN
        INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                    payload, max_attempts, lease_seconds, timeout_seconds,
                                    queued_at)
        VALUES (enqueue.kind, NULL, enqueue.tenant, enqueue."group", enqueue.exclusive,
                enqueue.priority, 'queued', enqueue.payload, enqueue.max_attempts,
                enqueue.lease_seconds, enqueue.timeout_seconds,
                leasework.now() + make_interval(secs => enqueue.delay))
        RETURNING id INTO run_id;
        -- One PERFORM, not two: each runs a query of its own (migration 0034).
        PERFORM pg_notify('leasework', enqueue.kind),
                set_config('leasework.enqueued_existing', 'false', true);
        RETURN run_id;
    END IF;
    -- Held until this transaction ends: expire_and_promote skips a key whose enqueue is still
    -- open rather than wait on it (promoting the key's waiting run would wait for this insert's
    -- fate in runs_one_active_per_key). Shared: enqueues of one key never wait on each other.
    -- The pair (hashtext('leasework.key'), leasework.key_lock(tenant, key)): a collision only
    -- delays a promotion.
    PERFORM pg_advisory_xact_lock_shared(-1682930272,
                                         leasework.key_lock(enqueue.tenant, enqueue.key));
    IF enqueue.unique_for IS NOT NULL THEN
        FOR attempt IN 1..10 LOOP
            SELECT r.id, r.status, r.unique_at INTO held
              FROM leasework.runs r
             WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
               AND r.unique_at IS NOT NULL;
            IF held.id IS NOT NULL THEN
                IF held.unique_at > leasework.now() - make_interval(secs => enqueue.unique_for)
                   AND held.status NOT IN ('failed', 'cancelled') THEN
                    PERFORM set_config('leasework.enqueued_existing', 'window', true);
                    RETURN held.id;
                ELSIF held.status IN ('waiting', 'queued', 'running') THEN
                    PERFORM set_config('leasework.enqueued_existing', 'true', true);
                    RETURN held.id;
                END IF;
                -- Its window is over (or it did not do its work): it gives up the mark, which a
                -- racing enqueue of the key waits on here (or, under REPEATABLE READ, fails on).
                UPDATE leasework.runs r SET unique_at = NULL
                 WHERE r.id = held.id AND r.unique_at = held.unique_at
                   AND r.status IN ('succeeded', 'partial', 'failed', 'cancelled');
                CONTINUE WHEN NOT FOUND;
            END IF;
            -- No ON CONFLICT target: the key's active run (runs_one_active_per_key) and a racing
            -- enqueue's window run (runs_one_window_per_key) both stop it.
            INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                        payload, max_attempts, lease_seconds, timeout_seconds,
                                        queued_at, unique_at)
            VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", false,
                    enqueue.priority, 'queued', enqueue.payload, enqueue.max_attempts,
                    enqueue.lease_seconds, enqueue.timeout_seconds,
                    leasework.now() + make_interval(secs => enqueue.delay), leasework.now())
            ON CONFLICT DO NOTHING
            RETURNING id INTO run_id;
            IF run_id IS NOT NULL THEN
                PERFORM pg_notify('leasework', enqueue.kind);
                PERFORM set_config('leasework.enqueued_existing', 'false', true);
                RETURN run_id;
            END IF;
            SELECT r.id INTO run_id
              FROM leasework.runs r
             WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
               AND r.status IN ('queued', 'running');
            IF run_id IS NOT NULL THEN
                PERFORM set_config('leasework.enqueued_existing', 'true', true);
                RETURN run_id;
            END IF;
            -- A racing enqueue's window run, or an active run that ended meanwhile: read again.
        END LOOP;
        RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
            MESSAGE = format('could not enqueue for key %L: it kept changing', enqueue.key);
    END IF;
    IF enqueue.debounce IS NOT NULL THEN
        FOR attempt IN 1..10 LOOP
            -- The key's pending run that a debounce of this kind made, locked: a claim passes it
            -- by (SKIP LOCKED) until this transaction ends; one claimed meanwhile is running and
            -- no longer matches once its claim commits.
            SELECT r.id, r.queued_at, r.debounce_count, r.debounce_deadline INTO pending
              FROM leasework.runs r
             WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
               AND r.status = 'queued' AND r.kind = enqueue.kind
               AND r.debounce_count IS NOT NULL AND NOT r.exclusive
               FOR UPDATE;
            IF pending.id IS NULL THEN
                SELECT r.id, r.queued_at, r.debounce_count, r.debounce_deadline INTO pending
                  FROM leasework.runs r
                 WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
                   AND r.status = 'waiting' AND r.kind = enqueue.kind
                   AND r.debounce_count IS NOT NULL AND NOT r.exclusive
                   FOR UPDATE;
            END IF;
            IF pending.id IS NOT NULL THEN
                IF enqueue.merge_into IS NOT NULL AND (enqueue.merge_into <> pending.id
                        OR enqueue.merge_seen IS DISTINCT FROM pending.debounce_count) THEN
                    RETURN NULL;  -- merged with what is no longer there: the caller merges again
                END IF;
                due := least(leasework.now() + make_interval(secs => enqueue.debounce),
                             pending.debounce_deadline);
                UPDATE leasework.runs r
                   SET payload = enqueue.payload, queued_at = due,
                       debounce_count = r.debounce_count + 1
                 WHERE r.id = pending.id;
                IF due < pending.queued_at THEN  -- sooner than idle workers may expect it
                    PERFORM pg_notify('leasework', enqueue.kind);
                END IF;
                PERFORM set_config('leasework.enqueued_existing', 'debounced', true);
                RETURN pending.id;
            END IF;
            IF coalesce(enqueue.merge_into, 0) <> 0 THEN
                RETURN NULL;  -- the run it merged with was claimed or ended: merge again
            END IF;
            INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                        payload, max_attempts, lease_seconds, timeout_seconds,
                                        queued_at, debounce_count, debounce_deadline)
            VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", false,
                    enqueue.priority, 'queued', enqueue.payload, enqueue.max_attempts,
                    enqueue.lease_seconds, enqueue.timeout_seconds,
                    leasework.now() + make_interval(secs => enqueue.debounce), 1,
                    leasework.now() + make_interval(secs => enqueue.debounce_max))
            ON CONFLICT (key, tenant) WHERE status IN ('queued', 'running') AND key IS NOT NULL
            DO NOTHING
            RETURNING id INTO run_id;
            IF run_id IS NOT NULL THEN
                PERFORM pg_notify('leasework', enqueue.kind);
                PERFORM set_config('leasework.enqueued_existing', 'false', true);
                RETURN run_id;
            END IF;
            SELECT r.id, r.status,
                   (r.kind = enqueue.kind AND r.debounce_count IS NOT NULL AND NOT r.exclusive)
                       AS debounced
              INTO active
              FROM leasework.runs r
             WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
               AND r.status IN ('queued', 'running');
            CONTINUE WHEN active.id IS NULL;  -- it ended meanwhile
            IF active.status = 'queued' THEN
                -- A debounced run made meanwhile is merged into; any other queued run of the key
                -- (another kind's, one enqueued without debounce) is returned: the key rule.
                CONTINUE WHEN active.debounced;
                PERFORM set_config('leasework.enqueued_existing', 'true', true);
                RETURN active.id;
            END IF;
            -- Running: this edit must not be lost in it, so a debounced run waits behind it.
            INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                        payload, max_attempts, lease_seconds, timeout_seconds,
                                        queued_at, debounce_count, debounce_deadline)
            VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", false,
                    enqueue.priority, 'waiting', enqueue.payload, enqueue.max_attempts,
                    enqueue.lease_seconds, enqueue.timeout_seconds,
                    leasework.now() + make_interval(secs => enqueue.debounce), 1,
                    leasework.now() + make_interval(secs => enqueue.debounce_max))
            ON CONFLICT (key, tenant) WHERE status = 'waiting' AND key IS NOT NULL DO NOTHING
            RETURNING id INTO run_id;
            IF run_id IS NOT NULL THEN
                PERFORM set_config('leasework.enqueued_existing', 'false', true);
                RETURN run_id;
            END IF;
            SELECT (r.kind = enqueue.kind AND r.debounce_count IS NOT NULL AND NOT r.exclusive)
              INTO mergeable
              FROM leasework.runs r
             WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
               AND r.status = 'waiting';
            -- A debounced waiting run made meanwhile is merged into (so is none: the key ended
            -- meanwhile); an exclusive one waiting for the key leaves this enqueue to the key
            -- rule (the running run).
            CONTINUE WHEN mergeable IS NOT FALSE;
            PERFORM set_config('leasework.enqueued_existing', 'true', true);
            RETURN active.id;
        END LOOP;
        RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
            MESSAGE = format('could not enqueue for key %L: it kept changing', enqueue.key);
    END IF;
    FOR attempt IN 1..10 LOOP
        INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                    payload, max_attempts, lease_seconds, timeout_seconds,
                                    queued_at)
        VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", enqueue.exclusive,
                enqueue.priority, 'queued', enqueue.payload, enqueue.max_attempts,
                enqueue.lease_seconds, enqueue.timeout_seconds,
                leasework.now() + make_interval(secs => enqueue.delay))
        ON CONFLICT (key, tenant) WHERE status IN ('queued', 'running') AND key IS NOT NULL
        DO NOTHING
        RETURNING id INTO run_id;
        IF run_id IS NOT NULL THEN
            PERFORM pg_notify('leasework', enqueue.kind);
            -- Read back by enqueue_run (runs.sql): a new run, not the key's existing one.
            PERFORM set_config('leasework.enqueued_existing', 'false', true);
            RETURN run_id;
        END IF;
        IF enqueue.exclusive THEN
            INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                        payload, max_attempts, lease_seconds, timeout_seconds,
                                        queued_at)
            VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", true,
                    enqueue.priority, 'waiting', enqueue.payload, enqueue.max_attempts,
                    enqueue.lease_seconds, enqueue.timeout_seconds,
                    leasework.now() + make_interval(secs => enqueue.delay))
            ON CONFLICT (key, tenant) WHERE status = 'waiting' AND key IS NOT NULL DO NOTHING
            RETURNING id INTO run_id;
            IF run_id IS NOT NULL THEN
                PERFORM set_config('leasework.enqueued_existing', 'false', true);
                RETURN run_id;
            END IF;
            wanted := ARRAY['waiting'];
        ELSE
            wanted := ARRAY['queued', 'running'];
        END IF;
        SELECT r.id INTO run_id
          FROM leasework.runs r
         WHERE r.key = enqueue.key AND r.tenant IS NOT DISTINCT FROM enqueue.tenant
           AND r.status = ANY (wanted)
         ORDER BY r.id DESC
         LIMIT 1;
        IF run_id IS NOT NULL THEN
            PERFORM set_config('leasework.enqueued_existing', 'true', true);
            RETURN run_id;
        END IF;
        -- The run that held the key finished between the two statements: try again.
    END LOOP;
    RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
        MESSAGE = format('could not enqueue for key %L: it kept changing', enqueue.key);
END
$$;

-- The first half of a debounced merge done by the caller (Python's debounce_merge): the key's
-- pending run of `kind` that a debounce made (queued, else waiting), locked until the caller's
-- transaction ends (a claim passes it by meanwhile), with its payload and debounce_count; no row
-- when there is none. The caller merges the payload with its own and hands both to
-- leasework.enqueue (merge_into, merge_seen), which writes the merge only if that run is still
-- pending at that count. SECURITY DEFINER as leasework.enqueue: the enqueue role reads a pending
-- payload only of a key it could enqueue a debounce for (a family's key under 'leasework:' is
-- refused as leasework.enqueue refuses it), and of a run a debounce made (README "Security").
CREATE OR REPLACE FUNCTION leasework.debounce_pending(kind text, key text, tenant text)
RETURNS TABLE (id bigint, payload jsonb, debounce_count integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF starts_with(debounce_pending.key, 'leasework:') AND NOT has_table_privilege(
           coalesce(nullif(current_setting('role'), 'none'), session_user),
           'leasework.runs', 'INSERT') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
            'key %s is refused: keys starting with ''leasework:'' are reserved for leasework''s '
            'own families (connections, files); use a key without that prefix',
            quote_literal(left(debounce_pending.key, 80)));
    END IF;
    RETURN QUERY
        SELECT r.id, r.payload, r.debounce_count
          FROM leasework.runs r
         WHERE r.key = debounce_pending.key
           AND r.tenant IS NOT DISTINCT FROM debounce_pending.tenant
           AND r.status = 'queued' AND r.kind = debounce_pending.kind
           AND r.debounce_count IS NOT NULL AND NOT r.exclusive
           FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY
            SELECT r.id, r.payload, r.debounce_count
              FROM leasework.runs r
             WHERE r.key = debounce_pending.key
               AND r.tenant IS NOT DISTINCT FROM debounce_pending.tenant
               AND r.status = 'waiting' AND r.kind = debounce_pending.kind
               AND r.debounce_count IS NOT NULL AND NOT r.exclusive
               FOR UPDATE;
    END IF;
END
$$;

-- Cancel from SQL, and App.cancel: the enqueue role's only write to an existing run. A queued,
-- waiting or blocked run is cancelled at once (what waits on it is then decided by the deps stage,
-- migration 0026); a running one gets cancel_requested_at, which its worker's
-- control query sees (and which stops any reclaim); a finished one is left as it is. Returns the
-- run's status afterwards, or NULL when there is no such run. SECURITY DEFINER (see enqueue).
CREATE OR REPLACE FUNCTION leasework.cancel(run_id bigint) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    result text;
BEGIN
    UPDATE leasework.runs
       SET status = CASE WHEN status IN ('blocked', 'waiting', 'queued') THEN 'cancelled'
                         ELSE status END,
           finished_at = CASE WHEN status IN ('blocked', 'waiting', 'queued')
                              THEN leasework.now() ELSE finished_at END,
           error = CASE WHEN status IN ('blocked', 'waiting', 'queued')
                        THEN 'cancelled before it started' ELSE error END,
           cancel_requested_at = coalesce(cancel_requested_at, leasework.now())
     WHERE id = cancel.run_id AND status IN ('blocked', 'waiting', 'queued', 'running')
    RETURNING status INTO result;
    IF result IS NULL THEN
        SELECT status INTO result FROM leasework.runs WHERE id = cancel.run_id;
    END IF;
    RETURN result;
END
$$;

-- Only the roles deploy/roles.sql names may call these (functions are executable by PUBLIC by
-- default; a SECURITY DEFINER one must not be).
REVOKE EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision,
    double precision, double precision, double precision, bigint, integer, bigint[], text, text[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.enqueue_blocked(text, jsonb, text, text, text, boolean,
    integer, double precision, integer, double precision, double precision, boolean, bigint[],
    text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.run_ended() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.join_batch(bigint, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.written_by_this_transaction(xid) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.set_dependency_policy(bigint, bigint, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.debounce_pending(text, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.cancel(bigint) FROM PUBLIC;

-- A timestamp written as text inside a run's history (started_at, ended_at) as a timestamptz, or
-- NULL when it is not one, or not finite: the readers (status, the dashboard, /metrics) cast
-- through this so that no history entry, however written, turns a page into an error.
CREATE OR REPLACE FUNCTION leasework.try_instant(value text) RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    result timestamptz;
BEGIN
    IF value IS NULL OR value !~ '^[0-9]{4}-' THEN
        RETURN NULL;
    END IF;
    result := value::timestamptz;
    RETURN CASE WHEN isfinite(result) THEN result END;
EXCEPTION WHEN data_exception THEN
    RETURN NULL;
END
$$;

-- Finished runs by age, for pruning. Serves: maintenance pruning.
CREATE INDEX IF NOT EXISTS runs_finished_at
    ON leasework.runs (finished_at) WHERE finished_at IS NOT NULL;

-- Operators' searches (migration 0030; docs/operations.md, "Search, tags and bulk actions"). Both partial:
-- a run without tags, or without an error, is in neither, so an enqueue without tags and a run
-- that succeeds at its first attempt write nothing here. Serves: list_runs, select_runs,
-- count_runs (operations.sql) with --tag.
CREATE INDEX IF NOT EXISTS runs_tags ON leasework.runs USING gin (tags) WHERE tags IS NOT NULL;

-- Serves: the same with --error TEXT (ILIKE '%TEXT%'), when pg_trgm can be had: installed
-- already (in whichever schema), or installable here (a trusted extension since Postgres 13:
-- the database's CREATE privilege is enough), into the schema leasework. Without it the search
-- reads the runs its other filters leave (bench/README.md, "Search"). Created once: a database
-- that has the index keeps it.
DO $$
DECLARE
    home text;
BEGIN
    IF to_regclass('leasework.runs_error_trgm') IS NOT NULL THEN
        RETURN;
    END IF;
    SELECT n.nspname INTO home
      FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
     WHERE e.extname = 'pg_trgm';
    IF home IS NULL THEN
        BEGIN
            CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA leasework;
            home := 'leasework';
        EXCEPTION WHEN undefined_file OR insufficient_privilege OR feature_not_supported THEN
            RAISE NOTICE 'pg_trgm is not available (%): --error searches read the runs', SQLERRM;
            RETURN;
        END;
    END IF;
    EXECUTE format('CREATE INDEX runs_error_trgm ON leasework.runs USING gin (error %I.gin_trgm_ops)'
                   ' WHERE error IS NOT NULL', home);
END
$$;

-- One row per worker process start; the id is never reused after a restart.
CREATE TABLE IF NOT EXISTS leasework.workers (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stopped_at   timestamptz,
    current_run  bigint
);

-- The worker's pool (config `pools`; NULL: every kind) and its kinds (NULL with a pool: every
-- kind no other pool of its host names). Written by upsert_worker; read by status.
ALTER TABLE leasework.workers ADD COLUMN IF NOT EXISTS pool text;
ALTER TABLE leasework.workers ADD COLUMN IF NOT EXISTS pool_kinds text[];

-- ---------------------------------------------------------------------------------------------
-- Connections, synced records and schedules (stages/sync.py, stages/schedule.py).

-- An external system kept synced into `records`. Its sync and purge runs live in `runs` with
-- key 'leasework:connection:{id}' (a reserved key: the enqueue role cannot take it), tenant =
-- workspace and group = provider, so the partial unique indexes give one active run and one
-- pending purge per connection, and the claim's limiter keeps two connections to one provider
-- in a workspace from syncing at once.
CREATE TABLE IF NOT EXISTS leasework.connections (
    id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workspace             text NOT NULL,
    provider              text NOT NULL,
    status                text NOT NULL DEFAULT 'active',
    config                jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- NULL: synced on demand only.
    sync_interval_seconds double precision,
    next_run_at           timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT connections_status_valid CHECK (status IN ('active', 'disconnected', 'deleting')),
    CONSTRAINT connections_interval_positive CHECK (
        sync_interval_seconds IS NULL OR sync_interval_seconds > 0)
);

-- Due connections, in next_run_at order. Serves: advance_due_connections.
CREATE INDEX IF NOT EXISTS connections_due
    ON leasework.connections (next_run_at) WHERE status = 'active' AND next_run_at IS NOT NULL;

-- The synced rows. `synced_by` is the lease owner token of the attempt that last saw the row:
-- a table read to the end tombstones (deleted_at) the rows of that table this attempt did not
-- see. A row that reappears upstream is live again (deleted_at back to NULL).
CREATE TABLE IF NOT EXISTS leasework.records (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- No cascade: the purge deletes records in bounded batches before the connection row.
    connection_id bigint NOT NULL REFERENCES leasework.connections (id),
    table_name    text NOT NULL,
    external_id   text NOT NULL,
    data          jsonb NOT NULL,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    synced_at     timestamptz NOT NULL DEFAULT now(),
    synced_by     uuid,
    deleted_at    timestamptz
);

-- One row per (connection, table, external id). Serves: upsert_records (ON CONFLICT),
-- tombstone_unseen, purge_records (by connection prefix), the caller's reads by table.
CREATE UNIQUE INDEX IF NOT EXISTS records_identity
    ON leasework.records (connection_id, table_name, external_id);

-- Tombstones by age. Serves: prune_tombstones (maintenance).
CREATE INDEX IF NOT EXISTS records_tombstoned
    ON leasework.records (deleted_at) WHERE deleted_at IS NOT NULL;

-- Recurring user tasks (@app.task(kind, every= | cron=)). Workers upsert the rows of their
-- app's periodic tasks on start; the schedule stage enqueues due ones with the same no-backlog
-- rule as connections: next_run_at is computed from now, never from its old value.
CREATE TABLE IF NOT EXISTS leasework.schedules (
    name             text PRIMARY KEY,
    kind             text NOT NULL,
    every_seconds    double precision,
    cron             text,
    timezone         text NOT NULL DEFAULT 'UTC',
    next_run_at      timestamptz NOT NULL,
    last_enqueued_at timestamptz,
    last_run_id      bigint,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT schedules_one_spec CHECK ((every_seconds IS NULL) <> (cron IS NULL)),
    CONSTRAINT schedules_every_positive CHECK (every_seconds IS NULL OR every_seconds > 0)
);

-- Due schedules, in next_run_at order. Serves: lock_due_schedules.
CREATE INDEX IF NOT EXISTS schedules_due ON leasework.schedules (next_run_at);

-- A key's runs, newest first (finished ones too). Serves: status_connections (each
-- connection's last run), find_purge.
CREATE INDEX IF NOT EXISTS runs_by_key ON leasework.runs (key, id) WHERE key IS NOT NULL;

-- ---------------------------------------------------------------------------------------------
-- Files, chunks, uploads and maintenance markers (the ingest, expand and maintenance stages).

-- A ZIP archive to expand into files. The second claim shape: no lease, a processing_since
-- timestamp; an upload stuck in `processing` past expand_reclaim is claimed again. The claim's
-- processing_since is also the token the finishing write is scoped by.
CREATE TABLE IF NOT EXISTS leasework.uploads (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project          text NOT NULL,
    name             text NOT NULL,
    store_key        text NOT NULL,
    size             bigint NOT NULL,
    status           text NOT NULL DEFAULT 'pending',
    processing_since timestamptz,
    attempts         integer NOT NULL DEFAULT 0,
    error            text,
    result           jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT uploads_status_valid CHECK (status IN ('pending', 'processing', 'done', 'failed')),
    CONSTRAINT uploads_processing_has_since CHECK ((status = 'processing') = (processing_since IS NOT NULL))
);

-- Only unfinished uploads, so it stays small. Serves: claim_upload, fail_stuck_uploads.
CREATE INDEX IF NOT EXISTS uploads_claimable
    ON leasework.uploads (id, processing_since) WHERE status IN ('pending', 'processing');

-- Finished uploads by age. Serves: prune_uploads.
CREATE INDEX IF NOT EXISTS uploads_finished_at
    ON leasework.uploads (finished_at) WHERE finished_at IS NOT NULL;

-- A document in a project (the scope its chunks are searched in). Its bytes are in the file
-- store under store_key; each (re)index is an `ingest` run keyed `leasework:file:{id}` (a
-- reserved key).
CREATE TABLE IF NOT EXISTS leasework.files (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project     text NOT NULL,
    name        text NOT NULL,
    store_key   text NOT NULL,
    size        bigint NOT NULL,
    sha256      text NOT NULL,
    status      text NOT NULL DEFAULT 'pending',
    error       text,
    chunks      integer,
    -- The content an ingest attempt started on: a later attempt that finds sha256 changed
    -- starts over instead of resuming from processed_units.
    indexing_sha256 text,
    -- Set when the file came out of an archive: the upload and the member's path inside it.
    upload_id   bigint REFERENCES leasework.uploads (id) ON DELETE SET NULL,
    member      text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    indexed_at  timestamptz,
    CONSTRAINT files_status_valid CHECK (status IN ('pending', 'indexing', 'ready', 'failed'))
);

-- One file per archive member, so redoing an expansion after a crash is harmless.
-- Serves: insert_member_file (ON CONFLICT), member_files.
CREATE UNIQUE INDEX IF NOT EXISTS files_upload_member
    ON leasework.files (upload_id, member) WHERE upload_id IS NOT NULL;

-- Files by scope. Serves: the caller's own listing/search by project; status_files.
CREATE INDEX IF NOT EXISTS files_project ON leasework.files (project, status);

-- One row per chunk; the primary key (file_id, idx) is what makes an upsert of a redone batch
-- harmless. Serves: upsert_chunks, delete_tail_chunks.
CREATE TABLE IF NOT EXISTS leasework.chunks (
    file_id   bigint NOT NULL REFERENCES leasework.files (id) ON DELETE CASCADE,
    idx       integer NOT NULL,
    project   text NOT NULL,
    page      integer NOT NULL,
    text      text NOT NULL,
    embedding real[] NOT NULL,
    PRIMARY KEY (file_id, idx),
    CONSTRAINT chunks_idx_valid CHECK (idx >= 0)
);

-- Chunks by scope. Serves: the caller's search restricted to one project; move_file.
CREATE INDEX IF NOT EXISTS chunks_project ON leasework.chunks (project);

-- The durable marker of each self-throttled maintenance handler: calling a handler every poll
-- costs one read of this table; claim_maintenance lets one worker win each period. `backlog`
-- means the last run stopped at its bound with work left, so it is due again at once.
CREATE TABLE IF NOT EXISTS leasework.maintenance (
    handler     text PRIMARY KEY,
    last_run_at timestamptz NOT NULL,
    backlog     boolean NOT NULL DEFAULT false,
    runs        bigint NOT NULL DEFAULT 0,
    last_result jsonb
);

-- ---------------------------------------------------------------------------------------------
-- Operators (leasework/operations.py): paused kinds, and the durable counters behind /metrics.

-- A paused kind is claimed by no worker (claim_runs reads this table once per statement, in its
-- `live` CTE); its running runs finish. Durable: a restart does not resume it. Serves: claim_runs,
-- pause_kinds, resume_kinds, list_paused.
CREATE TABLE IF NOT EXISTS leasework.paused_kinds (
    kind      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);

-- Counters that only go up, for Prometheus: what finished runs and lost leases added before their
-- rows left the table (pruned or deleted) or were retried. /metrics adds the runs still in the
-- table to these, so pruning never lowers a count. Written only when runs are deleted (the
-- trigger below) or retried (retry_runs), never on the hot path. Serves: metrics_counters.
-- name: `finished` (label: the outcome), `duration` and `wait` (label: a bucket's upper bound or
-- +Inf, not cumulative), `duration_sum` and `wait_sum` (label ''), `lost` (label: expired or
-- crashed), `reclaimed`, `attempts` (label: leasework.attempt_outcome), `debounced` (label '').
CREATE TABLE IF NOT EXISTS leasework.counters (
    kind  text NOT NULL,
    name  text NOT NULL,
    label text NOT NULL,
    value double precision NOT NULL,
    PRIMARY KEY (kind, name, label)
);

-- The upper bounds (seconds) of the run-duration and queue-wait histograms: one place, read by /metrics too.
CREATE OR REPLACE FUNCTION leasework.duration_buckets() RETURNS float8[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ARRAY[0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 10800]::float8[];
$$;

-- The histogram bucket (its upper bound as text, or +Inf) of a run that took `seconds`.
CREATE OR REPLACE FUNCTION leasework.duration_bucket(seconds float8) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce((SELECT min(b)::text FROM unnest(leasework.duration_buckets()) b
                      WHERE b >= seconds), '+Inf');
$$;

-- An ended attempt's outcome as /metrics counts it (leasework_attempts_total), from its history
-- entry's `outcome` (leasework.history_entry): fixed once the entry is written, so the counter
-- only goes up. `failed` is an attempt that raised (or a Fail, or a Partial), whether or not its
-- run was retried; `retried` is one whose handler raised Retry; expired and crashed leases are
-- `lost`. (Migration 0025.)
CREATE OR REPLACE FUNCTION leasework.attempt_outcome(outcome text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE outcome
               WHEN 'succeeded' THEN 'succeeded'
               WHEN 'retry' THEN 'retried'
               WHEN 'timeout' THEN 'timed_out'
               WHEN 'cancelled' THEN 'cancelled'
               WHEN 'released' THEN 'released'
               WHEN 'snoozed' THEN 'snoozed'
               WHEN 'expired' THEN 'lost'
               WHEN 'crashed' THEN 'lost'
               ELSE 'failed' END;
$$;

-- Adds what the runs in `gone` (a jsonb array of runs rows) counted to leasework.counters: their
-- finish (terminal runs: outcome, duration and queue wait) and, with `losses` (their history
-- leaves too), the lost leases in their history, how many of those were reclaimed, every
-- ended attempt by outcome (leasework.attempt_outcome) and the enqueues a debounce merged into
-- them. Called by the delete trigger and by retry_runs (tally_retried, which keeps the row's
-- history and debounce_count: `losses` false).
CREATE OR REPLACE FUNCTION leasework.add_to_counters(gone jsonb, losses boolean) RETURNS void
LANGUAGE sql VOLATILE AS $$
    WITH g AS (
        SELECT * FROM jsonb_to_recordset(gone) AS x(kind text, status text, attempts int,
                   queued_at timestamptz, started_at timestamptz, finished_at timestamptz,
                   history jsonb, debounce_count int)
    ), terminal AS (
        SELECT kind, status, extract(epoch FROM finished_at - started_at)::float8 AS took,
               extract(epoch FROM started_at - queued_at)::float8 AS waited
          FROM g WHERE status IN ('succeeded', 'partial', 'failed', 'cancelled')
    ), entries AS (
        SELECT g.kind, g.started_at, e.entry
          FROM g CROSS JOIN LATERAL jsonb_array_elements(
                   CASE WHEN jsonb_typeof(g.history) = 'array' THEN g.history ELSE '[]' END
               ) AS e(entry)
         WHERE losses AND jsonb_typeof(e.entry) = 'object'
    ), lost AS (
        SELECT kind, entry ->> 'outcome' AS outcome,
               coalesce(started_at > leasework.try_instant(entry ->> 'started_at'), false)
                   AS reclaimed
          FROM entries
         WHERE entry ->> 'outcome' IN ('expired', 'crashed')
    ), added AS (
        SELECT kind, 'finished' AS name, status AS label, 1::float8 AS value FROM terminal
        UNION ALL
        SELECT kind, 'duration', leasework.duration_bucket(greatest(took, 0)), 1
          FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'duration_sum', '', greatest(took, 0) FROM terminal WHERE took IS NOT NULL
        UNION ALL
        SELECT kind, 'wait', leasework.duration_bucket(greatest(waited, 0)), 1
          FROM terminal WHERE waited IS NOT NULL
        UNION ALL
        SELECT kind, 'wait_sum', '', greatest(waited, 0) FROM terminal WHERE waited IS NOT NULL
        UNION ALL
        SELECT kind, 'lost', outcome, 1 FROM lost
        UNION ALL
        SELECT kind, 'reclaimed', '', 1 FROM lost WHERE reclaimed
        UNION ALL
        SELECT kind, 'attempts', leasework.attempt_outcome(entry ->> 'outcome'), 1 FROM entries
        UNION ALL
        -- A success is recorded by the row, not its history (leasework.run_history).
        SELECT kind, 'attempts', 'succeeded', 1 FROM g
         WHERE losses AND status = 'succeeded'
           AND (CASE WHEN jsonb_typeof(history) = 'array' THEN history -> -1 ->> 'outcome' END)
               IS DISTINCT FROM 'succeeded'
        UNION ALL
        SELECT kind, 'debounced', '', debounce_count - 1 FROM g
         WHERE losses AND debounce_count > 1
    )
    INSERT INTO leasework.counters AS c (kind, name, label, value)
    SELECT kind, name, label, sum(value) FROM added GROUP BY 1, 2, 3
    ON CONFLICT (kind, name, label) DO UPDATE SET value = c.value + EXCLUDED.value;
$$;

-- Deleted runs (pruning, `leasework delete`, or the user's own DELETE) hand their counts over to
-- leasework.counters in the same transaction, and take their durable steps (leasework.run_steps,
-- below) with them. Statement-level: one call per DELETE. The edges of a deleted run that waited
-- for others go with it (migration 0026; run_deps' primary key); an edge whose parent is deleted
-- stays until its child is (the child counts it as ended well).
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

DROP TRIGGER IF EXISTS runs_deleted ON leasework.runs;
CREATE TRIGGER runs_deleted AFTER DELETE ON leasework.runs
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION leasework.runs_deleted();

-- ---------------------------------------------------------------------------------------------
-- Flow control (migration 0023): concurrency caps and rate limits across the fleet, admitted
-- inside the claim (leasework/leases/lease.sql, claim_runs; README, "Flow control").

-- A kind's limits: as its app declares them (`@app.task(kind, max_running=, group_limit=,
-- rate=, rate_per=)`, written by each worker when it starts: `declared`) and as an operator sets
-- them at run time (`leasework limits set`, operations.set_limits: `overrides`, whose keys win over
-- the declared ones until reset; a key set to JSON null removes that limit). The effective
-- values are generated from the two, so every host reads the same ones whatever its version.
-- Only kinds with a limit have a row: the claim reads this table once per statement (`rules`),
-- an index probe that finds nothing for a queue without limits. A claim that may take a run of
-- a kind with a cap or a rate locks its row (FOR UPDATE, in kind order: claims of that kind are
-- serialized, leasework.admit). `win` held the window of its rate until migration 0031 moved it
-- to leasework.rate_windows: nothing reads or writes it now; it goes in a later release.
-- A rate's window (below, leasework.rate_window) has its shape and ranges, whoever wrote it: 44
-- numbers, a width from 1 microsecond to a twentieth of 7 days, a slice number and running totals
-- from 0 to 2^62, so that no reader's arithmetic overflows (a reader shows any row).
-- PL/pgSQL (migration 0035), not SQL: a CHECK's expression is read and prepared again by every
-- statement that writes its table, and an SQL function in it was inlined there, its body parsed
-- each time (a third of the cost of a rated claim's write); a PL/pgSQL function keeps its
-- expression prepared for the session.
CREATE OR REPLACE FUNCTION leasework.rate_window_valid(win bigint[]) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN win IS NULL
        OR (cardinality(win) = 44 AND array_ndims(win) = 1 AND array_lower(win, 1) = 1
            AND win[1] BETWEEN 1 AND 30240000000
            AND 0 <= ALL(win[2:44]) AND 4611686018427387904 > ALL(win[2:44])
            AND win[2] <= 4611686018427387904 / win[1]);
END
$$;

CREATE TABLE IF NOT EXISTS leasework.kind_limits (
    kind         text PRIMARY KEY,
    declared     jsonb NOT NULL DEFAULT '{}',
    overrides    jsonb NOT NULL DEFAULT '{}',
    max_running  integer GENERATED ALWAYS AS ((CASE WHEN overrides ? 'max_running'
        THEN overrides ->> 'max_running' ELSE declared ->> 'max_running' END)::integer) STORED,
    group_limit  integer GENERATED ALWAYS AS ((CASE WHEN overrides ? 'group_limit'
        THEN overrides ->> 'group_limit' ELSE declared ->> 'group_limit' END)::integer) STORED,
    rate_count   integer GENERATED ALWAYS AS ((CASE WHEN overrides ? 'rate'
        THEN overrides -> 'rate' ELSE declared -> 'rate' END ->> 0)::integer) STORED,
    rate_seconds double precision GENERATED ALWAYS AS ((CASE WHEN overrides ? 'rate'
        THEN overrides -> 'rate' ELSE declared -> 'rate' END ->> 1)::double precision) STORED,
    rate_per     text GENERATED ALWAYS AS (CASE WHEN overrides ? 'rate_per'
        THEN overrides ->> 'rate_per' ELSE declared ->> 'rate_per' END) STORED,
    win          bigint[],
    CONSTRAINT kind_limits_valid CHECK (
        coalesce(max_running BETWEEN 1 AND 100000, true)
        AND coalesce(group_limit BETWEEN 1 AND 100000, true)
        AND (rate_count IS NULL) = (rate_seconds IS NULL)
        AND coalesce(rate_count BETWEEN 1 AND 1000000, true)
        AND coalesce(rate_seconds >= 0.1 AND rate_seconds <= 604800, true)
        AND coalesce(rate_per IN ('tenant', 'group'), true)),
    CONSTRAINT kind_limits_window_valid CHECK (leasework.rate_window_valid(win))
);

-- Per kind and tenant, for a kind rated per tenant (rate_per = 'tenant'): the tenant's window
-- (`win`, written by leasework.admit under the kind's row lock) and the rate an operator gave
-- this tenant (`rate_count`, `rate_seconds`; NULL: the kind's). Rows with no rate of their own
-- whose window has gone quiet are pruned by maintenance (prune_rate_windows).
CREATE TABLE IF NOT EXISTS leasework.tenant_rates (
    kind         text NOT NULL,
    tenant       text NOT NULL,
    rate_count   integer,
    rate_seconds double precision,
    win          bigint[],
    PRIMARY KEY (kind, tenant),
    CONSTRAINT tenant_rates_valid CHECK (
        (rate_count IS NULL) = (rate_seconds IS NULL)
        AND coalesce(rate_count BETWEEN 1 AND 1000000, true)
        AND coalesce(rate_seconds >= 0.1 AND rate_seconds <= 604800, true)),
    CONSTRAINT tenant_rates_window_valid CHECK (leasework.rate_window_valid(win))
);

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

-- A kind's rate window as migration 0031 kept it, one row per kind: no longer read or written
-- since migration 0035 split the window into shards (leasework.rate_shards, below); it stays for
-- a release so that an earlier release's workers keep running (docs/operations.md, Upgrades).
CREATE TABLE IF NOT EXISTS leasework.rate_windows (
    kind text PRIMARY KEY,
    win  bigint[],
    CONSTRAINT rate_windows_valid CHECK (leasework.rate_window_valid(win))
) WITH (fillfactor = 20);

-- A rate's window: the claims it admitted, counted in slices of a twentieth of its period, as
-- one bigint[]: {slice width in microseconds, the newest slice's number (database time in
-- microseconds since the epoch / width), then 42 running totals: the claims recorded before the
-- slice newest - 40, and up to each of the slices newest - 40 .. newest}. Running totals, so that
-- the claims since a slice are one subtraction (a claim reads the window, and most write it).
-- A claim at time t (its leasework.now(), which it writes as started_at) in slice c counts every
-- claim recorded in slices c - 20 and later: each one made within the period before it, and
-- more (up to a twentieth of the period older: a claim frees its place T to T + T/20 after it
-- was made). So no span of the period, however placed, holds more claims than the rate: a
-- sliding window, never a bucket that refills in bulk. The 20 slices kept beyond those a claim
-- now counts serve a claim whose statement started (its now()) before others were recorded, as
-- concurrent claims waiting for the kind's lock do: it still sees everything within a period of
-- it. A claim older than that (more than a period behind the newest recorded) is refused
-- (leasework.rate_used answers a count no rate allows): never a claim admitted on a partial view.
-- The width follows the rate's period: a window recorded under another period is first read as
-- if all its claims were made at the end of its newest slice (leasework.rate_window), which
-- holds them longer than they need, never shorter. Pure functions of their arguments.
CREATE OR REPLACE FUNCTION leasework.rate_window(win bigint[], seconds double precision)
RETURNS bigint[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    width bigint := greatest(1, round(seconds * 50000))::bigint;
BEGIN
    IF win IS NULL OR cardinality(win) <> 44 THEN
        RETURN NULL;
    ELSIF win[1] = width THEN
        RETURN win;
    END IF;
    RETURN ARRAY[width, ((win[2] + 1) * win[1] - 1) / width]
           || array_fill(0::bigint, ARRAY[41]) || ARRAY[win[44] - win[3]];
END
$$;

-- The slice a moment falls in, for a period of `seconds` (20 slices per period). Its time since
-- the epoch is read from an interval (`at - epoch`: immutable operators, where extract() from a
-- timestamptz is only stable), so that the planner inlines it into an expression that calls it,
-- as leasework.rate_used_fast does (migration 0035; the same number as before).
CREATE OR REPLACE FUNCTION leasework.rate_slice(seconds double precision, at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT floor(extract(epoch FROM at - timestamptz '1970-01-01 00:00:00+00') * 1000000
                 / greatest(1, round(seconds * 50000))::bigint)::bigint;
$$;

-- The claims a claim at `at` counts against its rate (see above): those recorded from the slice
-- a period before it on; a count no rate allows when `at` is more than a period behind the
-- newest recorded claim.
CREATE OR REPLACE FUNCTION leasework.rate_used(
    win bigint[], seconds double precision, at timestamptz)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    w bigint[] := leasework.rate_window(win, seconds);
    d bigint;  -- the claim's slice less the newest recorded
BEGIN
    IF w IS NULL THEN
        RETURN 0;
    END IF;
    d := leasework.rate_slice(seconds, at) - w[2];
    IF d < -20 THEN
        RETURN 9223372036854775807;
    ELSIF d > 20 THEN
        RETURN 0;
    END IF;
    -- The total up to the newest slice, less the total up to the slice before c - 20.
    RETURN w[44] - w[(d + 23)::integer];
END
$$;

-- The window with `n` more claims made at `at`.
CREATE OR REPLACE FUNCTION leasework.rate_recorded(
    win bigint[], seconds double precision, at timestamptz, n bigint)
RETURNS bigint[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    w bigint[] := leasework.rate_window(win, seconds);
    c bigint := leasework.rate_slice(seconds, at);
    d bigint;
BEGIN
    IF w IS NULL THEN
        RETURN ARRAY[greatest(1, round(seconds * 50000))::bigint, c]
               || array_fill(0::bigint, ARRAY[41]) || ARRAY[n];
    END IF;
    d := c - w[2];
    IF d <= 0 THEN
        -- At the newest slice, or behind it (admitted only within a period of it): the totals
        -- from its slice on.
        FOR p IN greatest(4, d + 44)::integer .. 44 LOOP
            w[p] := w[p] + n;
        END LOOP;
        RETURN w;
    ELSIF d >= 41 THEN
        RETURN ARRAY[w[1], c] || array_fill(w[44], ARRAY[41]) || ARRAY[w[44] + n];
    END IF;
    -- Newer slices: the totals move down by d, and the new slices hold the newest total.
    RETURN ARRAY[w[1], c, w[(d + 3)::integer]] || w[(4 + d)::integer:44]
           || array_fill(w[44], ARRAY[(d - 1)::integer]) || ARRAY[w[44] + n];
END
$$;

-- The first moment from `at` on at which one more claim fits in `count` (`at` itself when one
-- does now): the start of the first slice whose period back holds fewer claims.
CREATE OR REPLACE FUNCTION leasework.rate_window_free_at(
    win bigint[], count integer, seconds double precision, at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    w bigint[] := leasework.rate_window(win, seconds);
    d bigint;
BEGIN
    IF leasework.rate_used(w, seconds, at) < count THEN
        RETURN at;
    END IF;
    d := leasework.rate_slice(seconds, at) - w[2];
    -- The newest slice + 21 counts nothing: a claim fits there at the latest.
    FOR o IN greatest(d + 1, -20)::integer .. 21 LOOP
        IF o = 21 OR w[44] - w[o + 23] < count THEN
            RETURN timestamptz 'epoch' + (((w[2] + o) * w[1])::text || ' microseconds')::interval;
        END IF;
    END LOOP;
    RETURN at;
END
$$;

-- A kind's rate window in shards (leasework.rate_window's shape), the kind's, or with rate_per =
-- 'tenant' that of its runs without a tenant: shard 0 .. K - 1 with K = least(8, the rate's
-- count), each with `share` claims of the rate (count / K, and one more for the first count % K),
-- `win` counting the claims recorded in it, `last_pid` the backend that recorded the last (a
-- rated claim looks at its own shard first, so two workers keep to their own). `carried`, the
-- same in every shard of a kind: the claims made before the rate last changed (all the old
-- shards' together), while they still count; a shard with any is not taken by the quick
-- statement, and leasework.admit counts them with every shard's against the whole rate (exactly
-- the single window's rule), then clears them once they count nothing. Made and split again by
-- leasework.rate_split whenever the kind's rate is set or changed (a trigger on
-- leasework.kind_limits), under the kind's row lock. Written by leasework.admit (under the kind's
-- row lock, every shard locked) and by finish_and_claim_rated (one shard's lock alone, taken
-- with SKIP LOCKED). Its one index is the key, which no claim changes, and pages are kept mostly
-- empty (fillfactor): a claim's write is a HOT update on the same page.
CREATE TABLE IF NOT EXISTS leasework.rate_shards (
    kind     text NOT NULL,
    shard    smallint NOT NULL,
    share    integer NOT NULL,
    win      bigint[],
    carried  bigint[],
    last_pid integer,
    PRIMARY KEY (kind, shard),
    CONSTRAINT rate_shards_valid CHECK (
        shard BETWEEN 0 AND 7 AND share BETWEEN 1 AND 1000000
        AND leasework.rate_window_valid(win)
        AND (carried IS NULL OR leasework.rate_window_valid(carried)))
) WITH (fillfactor = 20);

-- The claims a claim at `at` counts against a window (leasework.rate_used: the same answer),
-- for the quick statement: while `at` falls in the window's newest slice (the common case: a
-- slice is a twentieth of the period) one subtraction, else rate_used. An SQL function that the
-- planner inlines into a prepared statement once: the claim pays no call for it.
CREATE OR REPLACE FUNCTION leasework.rate_used_fast(
    win bigint[], seconds double precision, at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN win[1] = greatest(1, round(seconds * 50000))::bigint
                     AND win[2] = leasework.rate_slice(seconds, at)
                THEN win[44] - win[23]
                ELSE leasework.rate_used(win, seconds, at) END;
$$;

-- The window with one more claim made at `at` (leasework.rate_recorded(win, seconds, at, 1): the
-- same window), inlined as rate_used_fast is: in the newest slice, its last total plus one.
CREATE OR REPLACE FUNCTION leasework.rate_recorded_fast(
    win bigint[], seconds double precision, at timestamptz)
RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN win[1] = greatest(1, round(seconds * 50000))::bigint
                     AND win[2] = leasework.rate_slice(seconds, at)
                THEN win[1:43] || (win[44] + 1)
                ELSE leasework.rate_recorded(win, seconds, at, 1) END;
$$;

-- Two windows' claims in one (for a period of `seconds`): both read in its width
-- (leasework.rate_window), moved on to the newer one's newest slice, and added up; the totals
-- start again from 0 before the oldest slice kept (only their differences are ever read).
CREATE OR REPLACE FUNCTION leasework.rate_window_sum(
    a bigint[], b bigint[], seconds double precision)
RETURNS bigint[]
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    x bigint[] := leasework.rate_window(a, seconds);
    y bigint[] := leasework.rate_window(b, seconds);
    at timestamptz;
BEGIN
    IF x IS NULL THEN
        RETURN y;
    ELSIF y IS NULL THEN
        RETURN x;
    END IF;
    at := timestamptz 'epoch' + ((greatest(x[2], y[2]) * x[1])::text || ' microseconds')::interval;
    x := leasework.rate_recorded(x, seconds, at, 0);
    y := leasework.rate_recorded(y, seconds, at, 0);
    RETURN x[1:2] || ARRAY(SELECT (p - x[3]) + (q - y[3])
                             FROM unnest(x[3:44], y[3:44]) WITH ORDINALITY AS u(p, q, i)
                            ORDER BY i);
END
$$;

-- The claims of a kind's window (every shard's, and those carried from before its rate last
-- changed) as one window, for a period of `seconds`: what the kind's rate counts as a whole.
CREATE OR REPLACE FUNCTION leasework.rate_shards_window(kind text, seconds double precision)
RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    merged bigint[];
    s record;
BEGIN
    FOR s IN
        SELECT x.win, x.carried, x.shard = min(x.shard) OVER () AS first
          FROM leasework.rate_shards x WHERE x.kind = rate_shards_window.kind
    LOOP
        IF s.first THEN
            merged := leasework.rate_window_sum(merged, s.carried, seconds);
        END IF;
        merged := leasework.rate_window_sum(merged, s.win, seconds);
    END LOOP;
    RETURN merged;
END
$$;

-- Whether a kind's window has room for one more claim at `at`, under a rate of `count` per
-- `seconds`: a shard with room under its share, and while claims are carried from before the
-- rate last changed, the whole window under the rate (no shard yet: room; admit splits it).
CREATE OR REPLACE FUNCTION leasework.rate_shards_open(
    kind text, count integer, seconds double precision, at timestamptz)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    room boolean;
    carried boolean;
BEGIN
    SELECT bool_or(leasework.rate_used(s.win, seconds, at) < s.share),
           bool_or(s.carried IS NOT NULL)
      INTO room, carried
      FROM leasework.rate_shards s WHERE s.kind = rate_shards_open.kind;
    IF room IS NULL THEN
        RETURN true;
    END IF;
    RETURN room AND (NOT carried
                     OR leasework.rate_used(leasework.rate_shards_window(kind, seconds), seconds, at)
                        < count);
END
$$;

-- Splits the rate window of `kind` into its shards again, for its rate now (none: the shards
-- are kept as they are, and count again if a rate comes back): called when the rate is set or
-- changed (the trigger below) and by leasework.admit when a rated
-- kind has no shard. The caller holds the kind's leasework.kind_limits row lock; every shard is
-- locked here first (in shard order, as admit locks them), so a rated claim recording in one
-- commits first and is counted. The claims of the old window that still count go into the
-- first shard when they fit in its share (they count there until they age out, as the claims it
-- takes do), else into every new shard as `carried`: until those count nothing, leasework.admit
-- alone admits, against the whole rate (a change that leaves more claims counting than a share
-- costs a period of claims through admit).
CREATE OR REPLACE FUNCTION leasework.rate_split(kind text)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    l leasework.kind_limits;
    merged bigint[];
    used bigint;
    k integer;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = rate_split.kind;
    IF l.rate_count IS NULL THEN
        RETURN;
    END IF;
    PERFORM 1 FROM leasework.rate_shards s WHERE s.kind = rate_split.kind
      ORDER BY s.shard
        FOR UPDATE;
    merged := leasework.rate_shards_window(rate_split.kind, l.rate_seconds);
    used := leasework.rate_used(merged, l.rate_seconds, leasework.now());
    DELETE FROM leasework.rate_shards s WHERE s.kind = rate_split.kind;
    k := least(8, l.rate_count);
    -- The first shard's share is the largest (count / k, and one of the count % k).
    INSERT INTO leasework.rate_shards (kind, shard, share, win, carried)
    SELECT rate_split.kind, s, l.rate_count / k + (s < l.rate_count % k)::integer,
           CASE WHEN used > 0 AND s = 0 AND used <= l.rate_count / k + (l.rate_count % k > 0)::integer
                THEN merged END,
           CASE WHEN used > l.rate_count / k + (l.rate_count % k > 0)::integer THEN merged END
      FROM generate_series(0, k - 1) s;
END
$$;

-- A kind's rate set, changed or removed (an app's declaration, an operator's override): its
-- window split again in the same transaction (leasework.rate_split), so the shards' shares
-- always add up to the rate that is committed.
CREATE OR REPLACE FUNCTION leasework.rate_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasework.rate_split(NEW.kind);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS kind_limits_rate_set ON leasework.kind_limits;
CREATE TRIGGER kind_limits_rate_set AFTER INSERT ON leasework.kind_limits
    FOR EACH ROW WHEN (NEW.rate_count IS NOT NULL) EXECUTE FUNCTION leasework.rate_changed();
DROP TRIGGER IF EXISTS kind_limits_rate_changed ON leasework.kind_limits;
CREATE TRIGGER kind_limits_rate_changed AFTER UPDATE ON leasework.kind_limits
    FOR EACH ROW
    WHEN (OLD.rate_count IS DISTINCT FROM NEW.rate_count
          OR OLD.rate_seconds IS DISTINCT FROM NEW.rate_seconds)
    EXECUTE FUNCTION leasework.rate_changed();

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

-- Whether the claim may look at the runs of kind `l` at all, in the claim's own snapshot (a
-- hint that keeps a full kind's runs out of the walk; leasework.admit decides, under the kind's
-- lock and with a fresh snapshot): its cap has a free place and its rate (per kind) room for one
-- more (leasework.rate_shards_open). The run being sealed with the claim (finish_and_claim:
-- `finishing`, this `worker`'s) does not hold a place: its seal commits with the claim.
-- (Migration 0035: the window is read from leasework.rate_shards.)
CREATE OR REPLACE FUNCTION leasework.kind_open(l leasework.kind_limits, finishing bigint, worker text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF l.rate_count IS NOT NULL AND l.rate_per IS NULL
       AND NOT leasework.rate_shards_open(l.kind, l.rate_count, l.rate_seconds, leasework.now()) THEN
        RETURN false;
    END IF;
    RETURN l.max_running IS NULL OR leasework.running_of_kind(l.kind, finishing, worker) < l.max_running;
END
$$;

-- Runs of `kind` holding a live lease (a place under its cap), but the run `finishing` when it is
-- `worker`'s (its seal commits in the same statement as the claim that asks). Reads every live
-- lease through runs_running_by_expiry (no index by kind: one more index on running runs would
-- cost every claim of every kind).
CREATE OR REPLACE FUNCTION leasework.running_of_kind(kind text, finishing bigint, worker text)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    n bigint;
BEGIN
    SELECT count(*) INTO n
      FROM leasework.runs r
     WHERE r.status = 'running' AND r.lease_expires_at >= leasework.now()
       AND r.kind = running_of_kind.kind
       AND (running_of_kind.finishing IS NULL OR r.id <> running_of_kind.finishing
            OR r.lease_worker IS DISTINCT FROM running_of_kind.worker);
    RETURN n;
END
$$;

-- The hand-on of a cap's place (migration 0024; leases/lease.sql, handed_on): whether the quick
-- one-at-a-time statement, sealing run `sealed` (owned by `owner`) and claiming the next run of
-- its kind `kind` in the same commit, may give that run the sealed run's place under the kind's
-- cap `cap`. The sealed run is locked first (it stays ours until this statement commits), then
-- the kind's cap lock is taken shared: hand-ons never wait on each other, and leasework.admit,
-- which takes it exclusive before it counts, waits for every hand-on in flight to commit (and
-- they for it). Then, on a fresh clock and a fresh snapshot: the sealed run's lease is still live
-- (an admit that committed before this one could not have counted its place as free: its clock
-- was earlier still), and the kind's live leases, the sealed run's included, are no more than
-- the cap (a cap lowered below them stops the hand-on). The seal and the claim commit together,
-- so the kind's count of live leases is the same before and after them.
CREATE OR REPLACE FUNCTION leasework.hand_on(kind text, sealed bigint, owner uuid, cap integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    until timestamptz;
    fresh timestamptz;
    n bigint;
BEGIN
    SELECT r.lease_expires_at INTO until
      FROM leasework.runs r
     WHERE r.id = hand_on.sealed AND r.kind = hand_on.kind AND r.status = 'running'
       AND r.lease_owner = hand_on.owner
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(hashtext('leasework.cap'), hashtext(hand_on.kind));
    fresh := leasework.now() + (clock_timestamp() - now());
    IF until < fresh THEN
        RETURN false;
    END IF;
    SELECT count(*) INTO n
      FROM leasework.runs r
     WHERE r.status = 'running' AND r.lease_expires_at >= fresh AND r.kind = hand_on.kind;
    RETURN n <= hand_on.cap;
END
$$;

-- Whether a tenant's runs of a kind rated per tenant have room for one more claim, in the
-- claim's snapshot (the walk's hint; leasework.admit decides).
CREATE OR REPLACE FUNCTION leasework.tenant_rate_open(kind text, tenant text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l leasework.kind_limits;
    t leasework.tenant_rates;
    r record;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = tenant_rate_open.kind;
    IF l.rate_count IS NULL OR l.rate_per IS NULL THEN
        RETURN true;
    END IF;
    SELECT * INTO t FROM leasework.tenant_rates x
     WHERE x.kind = tenant_rate_open.kind AND x.tenant = tenant_rate_open.tenant;
    r := leasework.tenant_rate(l, t);
    RETURN leasework.rate_used(t.win, r.seconds, leasework.now()) < r.count;
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

-- ---------------------------------------------------------------------------------------------
-- Tracing (migration 0025; README "Tracing"): the enqueuing span's W3C traceparent, written into
-- a run the enqueue just made, only when the enqueuing process has an active span (so an enqueue
-- without tracing sends nothing more, and leasework.enqueue is unchanged). The worker reads it
-- back only when its own tracing is on. SECURITY DEFINER, so that the enqueue role, which has no
-- privilege on the tables, may call it: it sets a traceparent of the right shape once, on a
-- queued or waiting run that has none, and nothing else.
CREATE OR REPLACE FUNCTION leasework.trace_run(run_id bigint, traceparent text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF trace_run.traceparent IS NULL
       OR trace_run.traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'traceparent %s is not valid: use the W3C form 00-<32 hex>-<16 hex>-<2 hex>',
            left(trace_run.traceparent, 80));
    END IF;
    UPDATE leasework.runs r SET traceparent = trace_run.traceparent
     WHERE r.id = trace_run.run_id AND r.status IN ('queued', 'waiting')
       AND r.traceparent IS NULL;
    RETURN FOUND;
END
$$;
REVOKE EXECUTE ON FUNCTION leasework.trace_run(bigint, text) FROM PUBLIC;
-- Waiting for a result and durable steps (migration 0027; docs/workflows.md). A run someone
-- waits for is marked notify_ended by leasework.run_outcome, and only such a run NOTIFYs
-- `leasework_ended` with its id when it ends (the trigger runs_ended, with leasework.run_ended,
-- above: an ordinary run's seal queues nothing).
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
