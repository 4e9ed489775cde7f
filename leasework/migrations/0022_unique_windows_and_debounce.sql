-- Migration 0022: unique windows and debounce (issue 31, item 3; README "Flow control").
-- Three columns of leasework.runs, NULL on every run enqueued without these options: unique_at
-- (the key's window run), debounce_count and debounce_deadline (a debounced run); the unique
-- index runs_one_window_per_key; leasework.enqueue with five more parameters (unique_for,
-- debounce, debounce_max, and merge_into / merge_seen for a merge done by the caller);
-- leasework.window_problem, the rules on those arguments; leasework.debounce_pending, the first
-- half of a merge done by the caller. A parameter list cannot be changed in place: the old
-- leasework.enqueue is dropped and the new one made, and whoever could EXECUTE the old one
-- (deploy/roles.sql grants it to leasework_enqueue) is granted the new one and
-- leasework.debounce_pending (as migration 0011 did). An older release's callers keep working:
-- its enqueue_run names the first eleven arguments, which keep their order and defaults.
--
-- On a live table: the columns are added without a default (no rewrite) and the index is built
-- over runs under a SHARE lock (enqueues and claims wait for the build: one pass over the table,
-- no entry to write, since no run has unique_at yet). The locks are waited for 5 s at most:
-- behind a long transaction on runs it fails, nothing applied (run `leasework migrate` again),
-- rather than queue every claim and enqueue behind that transaction. Idempotent.
SET LOCAL lock_timeout = '5s';
ALTER TABLE leasework.runs
    ADD COLUMN IF NOT EXISTS unique_at leasework.instant,
    ADD COLUMN IF NOT EXISTS debounce_count integer,
    ADD COLUMN IF NOT EXISTS debounce_deadline leasework.instant;

-- At most one window run per key in its tenant: the run an enqueue with unique_for measures its
-- window from; racing enqueues of the key give one (migration 0022). Runs enqueued without
-- unique_for have no entry. Serves: leasework.enqueue (unique_for).
CREATE UNIQUE INDEX IF NOT EXISTS runs_one_window_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE unique_at IS NOT NULL;
SET LOCAL lock_timeout = DEFAULT;

-- The roles granted EXECUTE on the old function, kept (transaction-local) for after its drop.
DO $$
BEGIN
    PERFORM set_config('leasework.enqueue_grantees', coalesce((
        SELECT string_agg(quote_ident(r.rolname), ',')
          FROM pg_proc p, aclexplode(p.proacl) a
          JOIN pg_roles r ON r.oid = a.grantee
         WHERE p.oid = to_regprocedure('leasework.enqueue(text, jsonb, text, text, text, boolean,'
                                       ' double precision, double precision, double precision,'
                                       ' double precision, double precision)')
           AND a.privilege_type = 'EXECUTE' AND r.oid <> p.proowner), ''), true);
END
$$;

DROP FUNCTION IF EXISTS leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision);

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
    merge_seen integer DEFAULT NULL
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
BEGIN
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
    IF starts_with(enqueue.key, 'leasework:') AND NOT has_table_privilege(
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
    -- SQL NULL and JSON null alike are stored as {}, as the Python path stores None.
    IF enqueue.payload IS NULL OR jsonb_typeof(enqueue.payload) = 'null' THEN
        enqueue.payload := '{}';
    ELSIF octet_length(enqueue.payload::text) > 67108864 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'payload is over 67108864 bytes (64 MiB)';
    END IF;
    IF enqueue.tenant IS NOT NULL THEN
        INSERT INTO leasework.tenants (name) VALUES (enqueue.tenant) ON CONFLICT (name) DO NOTHING;
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
        PERFORM pg_notify('leasework', enqueue.kind);
        PERFORM set_config('leasework.enqueued_existing', 'false', true);
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

REVOKE EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision,
    double precision, double precision, double precision, bigint, integer)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.debounce_pending(text, text, text) FROM PUBLIC;

DO $$
DECLARE
    grantees text := current_setting('leasework.enqueue_grantees', true);
BEGIN
    IF coalesce(grantees, '') <> '' THEN
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,'
                ' double precision, double precision, double precision, double precision,'
                ' double precision, double precision, double precision, double precision, bigint,'
                ' integer) TO ' || grantees;
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.debounce_pending(text, text, text) TO '
                || grantees;
    END IF;
END
$$;
