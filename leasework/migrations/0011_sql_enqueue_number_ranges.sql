-- Migration 0011: leasework.enqueue takes priority and max_attempts as double precision and
-- checks them inside (whole, in range), so that an out-of-range value from SQL (2^40,
-- 1099511627776) gets an error naming the range rather than "function leasework.enqueue(...) does
-- not exist". A parameter's type cannot be changed in place: the old function is dropped and the
-- new one made, and whoever could EXECUTE the old one (deploy/roles.sql grants it to
-- leasework_enqueue) is granted the new one. Idempotent: where the old one is gone already, only
-- the CREATE OR REPLACE and the grants (of nobody) run again.

-- The roles granted EXECUTE on the old function, kept (transaction-local) for after its drop.
DO $$
BEGIN
    PERFORM set_config('leasework.enqueue_grantees', coalesce((
        SELECT string_agg(quote_ident(r.rolname), ',')
          FROM pg_proc p, aclexplode(p.proacl) a
          JOIN pg_roles r ON r.oid = a.grantee
         WHERE p.oid = to_regprocedure('leasework.enqueue(text, jsonb, text, text, text, boolean,'
                                       ' integer, double precision, integer, double precision,'
                                       ' double precision)')
           AND a.privilege_type = 'EXECUTE' AND r.oid <> p.proowner), ''), true);
END
$$;

DROP FUNCTION IF EXISTS leasework.enqueue(text, jsonb, text, text, text, boolean, integer,
    double precision, integer, double precision, double precision);

-- leasework.enqueue as in schema.sql.
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
    label record;
    wanted text[];
BEGIN
    IF enqueue.kind IS NULL OR enqueue.kind !~ '^[A-Za-z0-9_.:/@+-]{1,200}$' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'kind %s is not valid: use 1-200 characters from letters, digits and _ . : / @ + -',
            -- A kind with a control character is shown JSON-quoted (escaped), so that a newline
            -- in it cannot break the one-line error.
            CASE WHEN enqueue.kind IS NULL THEN 'NULL'
                 WHEN enqueue.kind ~ '[\x01-\x1f\x7f]' THEN to_jsonb(left(enqueue.kind, 80))::text
                 ELSE quote_literal(left(enqueue.kind, 80)) END);
    END IF;
    FOR label IN SELECT * FROM (VALUES ('key', enqueue.key), ('tenant', enqueue.tenant),
                                       ('group', enqueue."group")) AS l(name, value) LOOP
        problem := leasework.label_problem(label.value);
        IF problem IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('%s %s', label.name, problem);
        END IF;
    END LOOP;
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
    FOR attempt IN 1..10 LOOP
        INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,
                                    payload, max_attempts, lease_seconds, timeout_seconds,
                                    queued_at)
        VALUES (enqueue.kind, enqueue.key, enqueue.tenant, enqueue."group", enqueue.exclusive,
                enqueue.priority, 'queued', enqueue.payload, enqueue.max_attempts,
                enqueue.lease_seconds, enqueue.timeout_seconds,
                leasework.now() + make_interval(secs => enqueue.delay))
        ON CONFLICT (key) WHERE status IN ('queued', 'running') AND key IS NOT NULL DO NOTHING
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
            ON CONFLICT (key) WHERE status = 'waiting' AND key IS NOT NULL DO NOTHING
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
         WHERE r.key = enqueue.key AND r.status = ANY (wanted)
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

REVOKE EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision)
    FROM PUBLIC;

DO $$
DECLARE
    grantees text := current_setting('leasework.enqueue_grantees', true);
BEGIN
    IF coalesce(grantees, '') <> '' THEN
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,'
                ' double precision, double precision, double precision, double precision,'
                ' double precision) TO ' || grantees;
    END IF;
END
$$;
