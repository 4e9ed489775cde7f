-- Migration 0023: flow control across the fleet, admitted inside the claim: concurrency caps
-- (`max_running`: live leases of a kind; `group_limit`: live leases of a tenant's group) and rate
-- limits (`rate`: claims per period, a sliding window counted in twentieths of the period, per
-- kind or per tenant), declared by the app and settable at run time (leasework.kind_limits,
-- leasework.tenant_rates). claim_runs locks a limited kind's row and admits its runs with
-- leasework.admit (a fresh snapshot under the lock); leasework.limiter_conflict, the tenant
-- limiter's re-check, now counts a group's live leases against its kind's group_limit (1 by
-- default: the rule before). A kind without a limit has no row. Self-contained and idempotent:
-- CREATE ... IF NOT EXISTS, CREATE OR REPLACE. README, "Flow control".

-- A kind's limits: as its app declares them (`@app.task(kind, max_running=, group_limit=,
-- rate=, rate_per=)`, written by each worker when it starts: `declared`) and as an operator sets
-- them at run time (`leasework limits set`, operations.set_limits: `overrides`, whose keys win over
-- the declared ones until reset; a key set to JSON null removes that limit). The effective
-- values are generated from the two, so every host reads the same ones whatever its version.
-- Only kinds with a limit have a row: the claim reads this table once per statement (`rules`),
-- an index probe that finds nothing for a queue without limits. A claim that may take a run of
-- a kind with a cap or a rate locks its row (FOR UPDATE, in kind order: claims of that kind are
-- serialized, leasework.admit), and `win` is the window of its rate (leasework.rate_recorded):
-- the kind's, or with rate_per = 'tenant' that of its runs without a tenant.
-- A rate's window (below, leasework.rate_window) has its shape and ranges, whoever wrote it: 44
-- numbers, a width from 1 microsecond to a twentieth of 7 days, a slice number and running totals
-- from 0 to 2^62, so that no reader's arithmetic overflows (a reader shows any row).
CREATE OR REPLACE FUNCTION leasework.rate_window_valid(win bigint[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT win IS NULL
        OR (cardinality(win) = 44 AND array_ndims(win) = 1 AND array_lower(win, 1) = 1
            AND win[1] BETWEEN 1 AND 30240000000
            AND 0 <= ALL(win[2:44]) AND 4611686018427387904 > ALL(win[2:44])
            AND win[2] <= 4611686018427387904 / win[1]);
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
        AND coalesce(rate_per = 'tenant', true)),
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

-- The slice a moment falls in, for a period of `seconds` (20 slices per period).
CREATE OR REPLACE FUNCTION leasework.rate_slice(seconds double precision, at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT floor(extract(epoch FROM at) * 1000000
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

-- The rate a tenant's runs of a kind rated per tenant are held to: the tenant's own (an
-- operator's, leasework.tenant_rates), else the kind's. (count, seconds) in one row; NULLs when
-- the kind has no rate per tenant.
CREATE OR REPLACE FUNCTION leasework.tenant_rate(
    l leasework.kind_limits, t leasework.tenant_rates, OUT count integer, OUT seconds double precision)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF l.rate_per = 'tenant' THEN
        count := coalesce(t.rate_count, l.rate_count);
        seconds := coalesce(t.rate_seconds, l.rate_seconds);
    END IF;
END
$$;

-- Whether the claim may look at the runs of kind `l` at all, in the claim's own snapshot (a
-- hint that keeps a full kind's runs out of the walk; leasework.admit decides, under the kind's
-- lock and with a fresh snapshot): its cap has a free place and its rate (per kind) room for one
-- more. The run being sealed with the claim (finish_and_claim: `finishing`, this `worker`'s)
-- does not hold a place: its seal commits with the claim.
CREATE OR REPLACE FUNCTION leasework.kind_open(l leasework.kind_limits, finishing bigint, worker text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF l.rate_count IS NOT NULL AND l.rate_per IS NULL
       AND leasework.rate_used(l.win, l.rate_seconds, leasework.now()) >= l.rate_count THEN
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

-- When a run of `kind` (and `tenant`: NULL for runs without one) fits in its rate again: NULL
-- when it has no rate, now when it fits now. Serves next_due: an idle worker sleeps until then.
CREATE OR REPLACE FUNCTION leasework.rate_free_at(kind text, tenant text)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    l leasework.kind_limits;
    t leasework.tenant_rates;
    r record;
BEGIN
    SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = rate_free_at.kind;
    IF l.rate_count IS NULL THEN
        RETURN NULL;
    ELSIF l.rate_per IS NULL OR rate_free_at.tenant IS NULL THEN
        RETURN leasework.rate_window_free_at(l.win, l.rate_count, l.rate_seconds, leasework.now());
    END IF;
    SELECT * INTO t FROM leasework.tenant_rates x
     WHERE x.kind = rate_free_at.kind AND x.tenant = rate_free_at.tenant;
    r := leasework.tenant_rate(l, t);
    RETURN leasework.rate_window_free_at(t.win, r.count, r.seconds, leasework.now());
END
$$;

-- The admission of a claim's candidates (claim_runs' `chosen`, when a kind it may take has a cap
-- or a rate): `ids` in the claim's order, with their `kinds` and `tenants`; returns those it
-- takes, at most `wanted`. The rows of the limited kinds among them are locked first, in kind
-- order (FOR UPDATE: a second claim of the kind waits for this one to commit; one order, so two
-- claims never wait on each other), and every count is read after that, with a fresh snapshot
-- (VOLATILE): it sees each claim of the kind that committed before, which the claim statement's
-- own snapshot may not. Then, in order, a candidate of a limited kind is taken while its kind has
-- a free place under max_running (live leases, but the run `finishing` of `worker`: its seal
-- commits with this claim) and room in its rate: the kind's, or with rate_per = 'tenant' its
-- tenant's (runs without a tenant share one budget, the kind's window). What it takes is recorded
-- in the windows before it returns: the claim statement updates every run it returns.
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
    taken bigint[] := '{}';
    l leasework.kind_limits;
    t leasework.tenant_rates;
    r record;
    j integer;
    n bigint;
BEGIN
    FOR l IN
        SELECT * FROM leasework.kind_limits x
         WHERE x.kind = ANY(kinds) AND (x.max_running IS NOT NULL OR x.rate_count IS NOT NULL)
         ORDER BY x.kind
           FOR UPDATE
    LOOP
        n := NULL;
        IF l.max_running IS NOT NULL THEN
            n := l.max_running - leasework.running_of_kind(l.kind, finishing, worker);
        END IF;
        IF l.rate_count IS NOT NULL THEN
            IF l.rate_per IS NULL THEN
                n := least(n, l.rate_count - leasework.rate_used(l.win, l.rate_seconds, at));
            END IF;
            took := took || 0::bigint;
        ELSE
            took := took || NULL::bigint;
        END IF;
        lk := lk || l.kind;
        room := room || n;
        per := per || (l.rate_per IS NOT NULL AND l.rate_count IS NOT NULL);
        loose := loose || CASE WHEN l.rate_per IS NOT NULL
                               THEN l.rate_count - leasework.rate_used(l.win, l.rate_seconds, at)
                          END;
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
            -- holds); one run per tenant in a claim (claim_runs' DISTINCT ON).
            SELECT * INTO l FROM leasework.kind_limits x WHERE x.kind = lk[j];
            SELECT * INTO t FROM leasework.tenant_rates x
             WHERE x.kind = lk[j] AND x.tenant = tenants[i];
            r := leasework.tenant_rate(l, t);
            CONTINUE WHEN leasework.rate_used(t.win, r.seconds, at) >= r.count;
            INSERT INTO leasework.tenant_rates AS x (kind, tenant, win)
            VALUES (lk[j], tenants[i], leasework.rate_recorded(NULL, r.seconds, at, 1))
            ON CONFLICT (kind, tenant)
            DO UPDATE SET win = leasework.rate_recorded(x.win, r.seconds, at, 1);
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
        IF took[j] > 0 THEN
            UPDATE leasework.kind_limits x
               SET win = leasework.rate_recorded(x.win, x.rate_seconds, at, took[j])
             WHERE x.kind = lk[j];
        END IF;
    END LOOP;
    RETURN taken;
END
$$;

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
