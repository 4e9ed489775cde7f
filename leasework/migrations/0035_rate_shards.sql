-- Migration 0035: a kind's rate window split into shards (issue 31, the rate's cost;
-- bench/README.md, issue 31, fourth pass). With one window row per kind, every rated claim held that row's lock
-- until its commit, so two workers' rated claims of a kind took turns for the length of a commit
-- (a quarter of their time waiting, measured) and a claim that waited re-checked its whole
-- statement (EvalPlanQual). leasework.rate_shards holds a kind's window in up to 8 rows, each
-- with its own share of the rate (the shares add up to the rate's count exactly), and each held
-- to its share by the window's rule: the claims of all the shards in any span of the period never
-- pass the rate. The quick statement's rated form (leases/lease.sql, finish_and_claim_rated)
-- takes any shard with room that no other claim holds (FOR UPDATE SKIP LOCKED), so claims on
-- different shards never wait on each other. leasework.rate_windows is no longer read or
-- written: it stays for a release so that an earlier release's workers keep running
-- (docs/operations.md, Upgrades); its windows are carried into the shards once, below.
-- leasework.rate_window_valid becomes PL/pgSQL and leasework.rate_slice inlinable (each cost a
-- rated claim a parse per statement before). Self-contained and idempotent: CREATE ...
-- IF NOT EXISTS, CREATE OR REPLACE, DROP TRIGGER IF EXISTS.

-- Whether a window has its shape and ranges (schema.sql, above kind_limits).
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

-- The windows of 0031 carried into shards, once: a rated kind without shards gets its old window
-- as a shard of its own, then split (its claims carried into the new shards).
DO $$
DECLARE
    k text;
BEGIN
    FOR k IN
        SELECT l.kind FROM leasework.kind_limits l
         WHERE l.rate_count IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM leasework.rate_shards s WHERE s.kind = l.kind)
    LOOP
        INSERT INTO leasework.rate_shards (kind, shard, share, win)
        SELECT k, 0, 1, w.win FROM leasework.rate_windows w WHERE w.kind = k;
        PERFORM leasework.rate_split(k);
    END LOOP;
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

-- When a run of `kind` (and `tenant`: NULL for runs without one) fits in its rate again: NULL
-- when it has no rate, now when it fits now. Serves next_due: an idle worker sleeps until then.
-- (Migration 0035: the kind's window is its shards, and a run fits when one of them has room,
-- and while claims are carried from before the rate changed, the whole window too.)
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
        RETURN greatest(
            (SELECT min(leasework.rate_window_free_at(s.win, s.share, l.rate_seconds,
                                                      leasework.now()))
               FROM leasework.rate_shards s WHERE s.kind = rate_free_at.kind),
            leasework.rate_window_free_at(
                leasework.rate_shards_window(rate_free_at.kind, l.rate_seconds), l.rate_count,
                l.rate_seconds, leasework.now()));
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
-- 'tenant' its tenant's (runs without a tenant share one budget, the kind's shards). What it
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
