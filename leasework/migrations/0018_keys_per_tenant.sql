-- Migration 0018: keys per tenant. A key is unique among the active (and among the waiting) runs
-- of its tenant, not of every tenant: tenant B's enqueue of a key tenant A holds makes B's own
-- run instead of returning A's, and no tenant can hold another's key. Runs without a tenant are a
-- namespace of their own (NULLS NOT DISTINCT: two untenanted runs of one key conflict, an
-- untenanted and a tenanted one do not). Keys under 'leasework:' are the families' own:
-- leasework.enqueue refuses them to a caller that may not insert into leasework.runs itself (the
-- enqueue role), and the families' existing keys 'connection:{id}' and 'file:{id}' are renamed
-- into it. The key's advisory lock (0017) hashes the tenant with the key (leasework.key_lock).
--
-- On a live table: it takes leasework.runs ACCESS EXCLUSIVE first (its DROP INDEX needs that
-- lock anyway; taken first, no lock is upgraded half-way, which could deadlock with a worker),
-- waiting at most 5 s for it: behind a long transaction on runs it fails, nothing applied (run
-- `leasework migrate` again), rather than queue every claim and enqueue behind that transaction.
-- Held until the migration commits: one pass over runs for the renames, one per index built
-- (partial indexes: the live runs only). Not additive: a process of an older release fails its
-- keyed enqueue_many (its ON CONFLICT (key) has no index left) and keys its families' runs the
-- old way, so stop them before migrating (README "Upgrades"). Idempotent.
SET LOCAL lock_timeout = '5s';
LOCK TABLE leasework.runs IN ACCESS EXCLUSIVE MODE;
SET LOCAL lock_timeout = DEFAULT;

-- The families' keys, renamed where the run is one of theirs (its kind, and its payload naming
-- the connection or file its key names); a user's run keyed 'file:7' keeps its key.
UPDATE leasework.runs
   SET key = 'leasework:' || key
 WHERE (kind IN ('sync', 'purge') AND key = 'connection:' || (payload ->> 'connection_id'))
    OR (kind = 'ingest' AND key = 'file:' || (payload ->> 'file_id'));

DROP INDEX IF EXISTS leasework.runs_one_active_per_key;
CREATE UNIQUE INDEX runs_one_active_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE status IN ('queued', 'running') AND key IS NOT NULL;
DROP INDEX IF EXISTS leasework.runs_one_waiting_per_key;
CREATE UNIQUE INDEX runs_one_waiting_per_key
    ON leasework.runs (key, tenant) NULLS NOT DISTINCT
    WHERE status = 'waiting' AND key IS NOT NULL;

-- The second half of the advisory lock a keyed enqueue holds (shared) until its transaction ends
-- and expire_and_promote tries (exclusive) before promoting the key's waiting run, with classid
-- -1682930272 (hashtext('leasework.key')): the tenant and the key hashed together, a run without
-- a tenant its key alone (as before 0018). A collision only delays a promotion. One definition for
-- both sides: if they hashed differently, the promotion would wait on an open enqueue again.
-- Qualified and without SET, so that the planner inlines it.
CREATE OR REPLACE FUNCTION leasework.key_lock(tenant text, key text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtext(CASE WHEN tenant IS NULL THEN key
                                    ELSE tenant OPERATOR(pg_catalog.||) E'\x1f'
                                         OPERATOR(pg_catalog.||) key END);
$$;

-- leasework.enqueue: the same checks and results, per (tenant, key), and keys under 'leasework:'
-- refused to callers that may not write runs. CREATE OR REPLACE keeps its owner and grants.
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
    timeout_seconds double precision DEFAULT 3600
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    run_id bigint;
    problem text;
    wanted text[];
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
