-- Migration 0024: a cap's place handed on in the quick one-at-a-time statement (issue 31;
-- leases/lease.sql, handed_on; README "Flow control", What limits cost). leasework.hand_on
-- decides it under the kind's cap lock held shared; leasework.admit now takes that lock
-- exclusive, before the kind's row, so that it counts what every hand-on in flight did.
-- Self-contained and idempotent: CREATE OR REPLACE.

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
