-- Migration 0034: leasework.enqueue's checks in one expression first, for an enqueue's share of
-- a run's pickup latency (bench/README.md, issue 30, fourth pass). Same signature, same grants
-- (CREATE OR REPLACE), the same checks and errors; the body is 0030's with three changes:
-- - the checks run behind one expression that is true only when every one of them passes (each
--   IF was an expression PL/pgSQL compiles again in every transaction): an enqueue with a
--   label, a window, a NULL or a value out of range runs them one by one as before;
-- - the reserved-key check no longer asks for the caller's privilege when there is no key
--   (NULL AND x evaluated x);
-- - an enqueue without a key NOTIFYs and sets leasework.enqueued_existing in one PERFORM.

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
