-- Migration 0007: least privilege that holds (why: schema.sql, beside each object; README
-- "Security"). Every timestamp of leasework.runs becomes the domain leasework.instant (finite,
-- from 1970 to 2200), so no role and no bug can store a lease or due time that breaks a reader;
-- rows already outside it (an infinite lease, a run due in year 33715) are moved to now() first
-- (an out-of-range lease expires at once and is reclaimed). The enqueue role's writes move into
-- two SECURITY DEFINER functions, leasework.enqueue(...) and leasework.cancel(id), that check what
-- they are given as the Python path does; deploy/roles.sql then grants it those and no table.
-- Idempotent.
DO $$
BEGIN
    IF to_regtype('leasework.instant') IS NULL THEN
        CREATE DOMAIN leasework.instant AS timestamptz CONSTRAINT instant_in_range
            CHECK (VALUE >= '1970-01-01 00:00:00+00' AND VALUE < '2200-01-01 00:00:00+00');
    END IF;
END
$$;

UPDATE leasework.runs
   SET queued_at = CASE WHEN queued_at >= '1970-01-01 00:00:00+00' AND queued_at < '2200-01-01 00:00:00+00'
                        THEN queued_at ELSE now() END,
       created_at = CASE WHEN created_at >= '1970-01-01 00:00:00+00' AND created_at < '2200-01-01 00:00:00+00'
                         THEN created_at ELSE now() END,
       started_at = CASE WHEN started_at IS NULL OR (started_at >= '1970-01-01 00:00:00+00' AND started_at < '2200-01-01 00:00:00+00')
                         THEN started_at ELSE now() END,
       finished_at = CASE WHEN finished_at IS NULL OR (finished_at >= '1970-01-01 00:00:00+00' AND finished_at < '2200-01-01 00:00:00+00')
                          THEN finished_at ELSE now() END,
       lease_expires_at = CASE WHEN lease_expires_at IS NULL OR (lease_expires_at >= '1970-01-01 00:00:00+00' AND lease_expires_at < '2200-01-01 00:00:00+00')
                               THEN lease_expires_at ELSE now() END,
       cancel_requested_at = CASE WHEN cancel_requested_at IS NULL OR (cancel_requested_at >= '1970-01-01 00:00:00+00' AND cancel_requested_at < '2200-01-01 00:00:00+00')
                                  THEN cancel_requested_at ELSE now() END
 WHERE NOT (queued_at >= '1970-01-01 00:00:00+00' AND queued_at < '2200-01-01 00:00:00+00')
    OR NOT (created_at >= '1970-01-01 00:00:00+00' AND created_at < '2200-01-01 00:00:00+00')
    OR NOT coalesce(started_at >= '1970-01-01 00:00:00+00' AND started_at < '2200-01-01 00:00:00+00', true)
    OR NOT coalesce(finished_at >= '1970-01-01 00:00:00+00' AND finished_at < '2200-01-01 00:00:00+00', true)
    OR NOT coalesce(lease_expires_at >= '1970-01-01 00:00:00+00' AND lease_expires_at < '2200-01-01 00:00:00+00', true)
    OR NOT coalesce(cancel_requested_at >= '1970-01-01 00:00:00+00' AND cancel_requested_at < '2200-01-01 00:00:00+00', true);

ALTER TABLE leasework.runs
    ALTER COLUMN queued_at TYPE leasework.instant,
    ALTER COLUMN created_at TYPE leasework.instant,
    ALTER COLUMN started_at TYPE leasework.instant,
    ALTER COLUMN finished_at TYPE leasework.instant,
    ALTER COLUMN lease_expires_at TYPE leasework.instant,
    ALTER COLUMN cancel_requested_at TYPE leasework.instant;

-- Why a label (key, tenant, group) is refused by leasework.enqueue, or NULL when it is fine: the
-- rule of leasework.tasks.check_label (1-200 characters, no control character).
CREATE OR REPLACE FUNCTION leasework.label_problem(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN value IS NULL THEN NULL
        WHEN length(value) NOT BETWEEN 1 AND 200 THEN 'must be 1-200 characters long'
        WHEN value ~ '[\x01-\x1f\x7f]' THEN 'contains control characters'
    END;
$$;

-- Enqueue from SQL (triggers, other languages, and App.enqueue itself): the one way the enqueue
-- role writes a run. SECURITY DEFINER, so that role needs no privilege on leasework.runs or
-- leasework.tenants and cannot choose a status, a lease, an id or a timestamp; it checks what it
-- is given as leasework/tasks.py does (kind, labels, priority, attempts, a finite delay of at
-- most 365 days, lease and timeout in range, a payload of at most 64 MiB: the top of
-- payload_max_bytes, whose configured value the Python path enforces) and raises 22023 naming
-- the bad argument. With a key, at most one active run per key: a second enqueue returns the
-- active run's id; an exclusive run whose key is busy waits (one waiting run per key). NOTIFY
-- wakes idle workers at commit. search_path is pinned so a caller's objects cannot stand in for
-- ours.
CREATE OR REPLACE FUNCTION leasework.enqueue(
    kind text,
    payload jsonb DEFAULT '{}',
    key text DEFAULT NULL,
    tenant text DEFAULT NULL,
    "group" text DEFAULT NULL,
    exclusive boolean DEFAULT false,
    priority integer DEFAULT 0,
    delay double precision DEFAULT 0,
    max_attempts integer DEFAULT 3,
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
            coalesce(quote_literal(left(enqueue.kind, 200)), 'NULL'));
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
    IF NOT coalesce(enqueue.delay >= 0 AND enqueue.delay <= 31536000, false) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'delay must be a number of seconds from 0 to 31536000 (365 days), got %s', enqueue.delay);
    END IF;
    IF NOT coalesce(enqueue.max_attempts BETWEEN 1 AND 1000, false) THEN
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
    IF enqueue.payload IS NULL THEN
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

-- Cancel from SQL, and App.cancel: the enqueue role's only write to an existing run. A queued or
-- waiting run is cancelled at once; a running one gets cancel_requested_at, which its worker's
-- control query sees (and which stops any reclaim); a finished one is left as it is. Returns the
-- run's status afterwards, or NULL when there is no such run. SECURITY DEFINER (see enqueue).
CREATE OR REPLACE FUNCTION leasework.cancel(run_id bigint) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    result text;
BEGIN
    UPDATE leasework.runs
       SET status = CASE WHEN status IN ('waiting', 'queued') THEN 'cancelled' ELSE status END,
           finished_at = CASE WHEN status IN ('waiting', 'queued') THEN leasework.now()
                              ELSE finished_at END,
           error = CASE WHEN status IN ('waiting', 'queued') THEN 'cancelled before it started'
                        ELSE error END,
           cancel_requested_at = coalesce(cancel_requested_at, leasework.now())
     WHERE id = cancel.run_id AND status IN ('waiting', 'queued', 'running')
    RETURNING status INTO result;
    IF result IS NULL THEN
        SELECT status INTO result FROM leasework.runs WHERE id = cancel.run_id;
    END IF;
    RETURN result;
END
$$;

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

-- Only the roles deploy/roles.sql names may call these (functions are executable by PUBLIC by
-- default; a SECURITY DEFINER one must not be).
REVOKE EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean, integer,
    double precision, integer, double precision, double precision) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.cancel(bigint) FROM PUBLIC;
