-- Migration 0031: a kind's rate window in a narrow table of its own (issue 31, the rate's cost;
-- README "Flow control", What limits cost). Every rated claim writes its kind's window; written in
-- leasework.kind_limits it made a new version of that wide row (two jsonb, five generated columns
-- recomputed, two CHECKs) per claim. leasework.rate_windows holds the window alone, one row per
-- kind, and the quick statement's rated form (leases/lease.sql, finish_and_claim_rated) writes it
-- with no PL/pgSQL call while the claim falls in the window's newest slice (the common case: a
-- slice is a twentieth of the period). kind_limits.win is no longer read or written: it stays
-- for a release so that an earlier release's workers keep running (README "Upgrading"), and is
-- copied here once. Self-contained and idempotent: CREATE ... IF NOT EXISTS, ON CONFLICT DO
-- NOTHING, CREATE OR REPLACE.

-- A kind's rate window (leasework.rate_recorded's shape: see leasework.rate_window): the kind's,
-- or with rate_per = 'tenant' that of its runs without a tenant. Made by leasework.admit the
-- first time it admits a claim of a rated kind, written by admit (under the kind's
-- kind_limits row lock, then this row's) and by finish_and_claim_rated (this row's lock alone:
-- admit locks it before it reads the window, so the two take turns). Its one index is the key,
-- which no write changes, and pages are kept mostly empty (fillfactor): every write is a HOT
-- update on the same page.
CREATE TABLE IF NOT EXISTS leasework.rate_windows (
    kind text PRIMARY KEY,
    win  bigint[],
    CONSTRAINT rate_windows_valid CHECK (leasework.rate_window_valid(win))
) WITH (fillfactor = 20);

INSERT INTO leasework.rate_windows (kind, win)
SELECT l.kind, l.win FROM leasework.kind_limits l WHERE l.win IS NOT NULL
ON CONFLICT (kind) DO NOTHING;

-- Whether the claim may look at the runs of kind `l` at all, in the claim's own snapshot (a
-- hint that keeps a full kind's runs out of the walk; leasework.admit decides, under the kind's
-- lock and with a fresh snapshot): its cap has a free place and its rate (per kind) room for one
-- more. The run being sealed with the claim (finish_and_claim: `finishing`, this `worker`'s)
-- does not hold a place: its seal commits with the claim. (Migration 0031: the window is read
-- from leasework.rate_windows.)
CREATE OR REPLACE FUNCTION leasework.kind_open(l leasework.kind_limits, finishing bigint, worker text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF l.rate_count IS NOT NULL AND l.rate_per IS NULL
       AND leasework.rate_used((SELECT w.win FROM leasework.rate_windows w WHERE w.kind = l.kind),
                               l.rate_seconds, leasework.now()) >= l.rate_count THEN
        RETURN false;
    END IF;
    RETURN l.max_running IS NULL OR leasework.running_of_kind(l.kind, finishing, worker) < l.max_running;
END
$$;

-- When a run of `kind` (and `tenant`: NULL for runs without one) fits in its rate again: NULL
-- when it has no rate, now when it fits now. Serves next_due: an idle worker sleeps until then.
-- (Migration 0031: the kind's window is read from leasework.rate_windows.)
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
        RETURN leasework.rate_window_free_at(
            (SELECT w.win FROM leasework.rate_windows w WHERE w.kind = rate_free_at.kind),
            l.rate_count, l.rate_seconds, leasework.now());
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
-- claims never wait on each other), then each rated kind's window (leasework.rate_windows, made
-- if missing; the quick statement's rated form writes it under that row's lock alone), and every
-- count is read after that, with a fresh snapshot (VOLATILE): it sees each claim of the kind that
-- committed before, which the claim statement's own snapshot may not. Then, in order, a
-- candidate of a limited kind is taken while its kind has a free place under max_running (live
-- leases, but the run `finishing` of `worker`: its seal commits with this claim) and room in its
-- rate: the kind's, or with rate_per = 'tenant' its tenant's (runs without a tenant share one
-- budget, the kind's window). What it takes is recorded in the windows before it returns: the
-- claim statement updates every run it returns. (Migration 0024 added the cap lock, 0031 the
-- window's table.)
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
    kw bigint[];
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
        kw := NULL;
        IF l.max_running IS NOT NULL THEN
            n := l.max_running - leasework.running_of_kind(l.kind, finishing, worker);
        END IF;
        IF l.rate_count IS NOT NULL THEN
            -- The kind's window, locked before it is read (the rated quick statement writes it
            -- under this lock alone); made the first time.
            SELECT w.win INTO kw FROM leasework.rate_windows w WHERE w.kind = l.kind FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO leasework.rate_windows (kind) VALUES (l.kind)
                ON CONFLICT (kind) DO NOTHING;
                SELECT w.win INTO kw FROM leasework.rate_windows w WHERE w.kind = l.kind FOR UPDATE;
            END IF;
            IF l.rate_per IS NULL THEN
                n := least(n, l.rate_count - leasework.rate_used(kw, l.rate_seconds, at));
            END IF;
            took := took || 0::bigint;
        ELSE
            took := took || NULL::bigint;
        END IF;
        lk := lk || l.kind;
        room := room || n;
        secs := secs || l.rate_seconds;
        per := per || (l.rate_per IS NOT NULL AND l.rate_count IS NOT NULL);
        loose := loose || CASE WHEN l.rate_per IS NOT NULL
                               THEN l.rate_count - leasework.rate_used(kw, l.rate_seconds, at)
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
            UPDATE leasework.rate_windows x
               SET win = leasework.rate_recorded(x.win, secs[j], at, took[j])
             WHERE x.kind = lk[j];
        END IF;
    END LOOP;
    RETURN taken;
END
$$;
