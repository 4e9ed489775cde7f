-- Migration 0026: dependencies (issue 32, items 1-3; README "Workflows"). A run may wait for
-- other runs (`after`): status `blocked` (leasework.run_state_valid takes it) until they have
-- all ended, then `queued`, or `cancelled` by its policy; the edges in leasework.run_deps; the
-- column runs.has_dependents (false on every run nothing waits for) and the trigger
-- runs_parent_ended, which records the end of a run something waits for in
-- leasework.run_deps_ended for the deps stage (stages/deps.sql), its WHEN false for every
-- other run; leasework.enqueue_blocked; leasework.enqueue with two more parameters (`after`,
-- `on_parent_failure`), dropped and made again, whoever could EXECUTE the old one granted the
-- new one (as migration 0022 did); leasework.cancel cancels a blocked run too.
--
-- On a live table: the column is added with a constant default (no rewrite); the locks are
-- waited for 5 s at most (behind a long transaction on runs it fails, nothing applied: run
-- `leasework migrate` again). Idempotent.
SET LOCAL lock_timeout = '5s';
ALTER TABLE leasework.runs
    ADD COLUMN IF NOT EXISTS has_dependents boolean NOT NULL DEFAULT false;
SET LOCAL lock_timeout = DEFAULT;

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

-- A parent's children. Serves: decide_children (stages/deps.sql), `leasework show`.
CREATE INDEX IF NOT EXISTS run_deps_by_parent ON leasework.run_deps (parent);

-- The deps stage's inbox: a parent whose children may now be decided (it ended: the trigger
-- runs_parent_ended) or whose end must be watched for (an enqueue after a run it did not make:
-- the stage sets its has_dependents, which that enqueue must not do itself, since the lock of a
-- running parent's row would hold its worker's renewal and seal until the enqueue commits). No
-- unique constraint: a seal must never wait on an enqueue's uncommitted row of the same parent.
CREATE TABLE IF NOT EXISTS leasework.run_deps_ended (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    parent  bigint NOT NULL
);

-- A parent's inbox rows, taken together. Serves: take_parent (stages/deps.sql).
CREATE INDEX IF NOT EXISTS run_deps_ended_by_parent ON leasework.run_deps_ended (parent);

-- A run that something waits for ended: record it for the deps stage and wake it (at commit).
-- SECURITY DEFINER: whoever ends the run (a worker, leasework.cancel for the enqueue role, an
-- operator) need not write run_deps_ended itself.
CREATE OR REPLACE FUNCTION leasework.parent_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO leasework.run_deps_ended (parent) VALUES (NEW.id);
    PERFORM pg_notify('leasework', 'leasework:deps');
    RETURN NULL;
END
$$;

-- AFTER, with a WHEN: Postgres evaluates an AFTER ROW trigger's WHEN when it would queue the
-- event, so for a run nothing waits for (has_dependents false: every run enqueued without
-- being waited on) no event is queued and no function runs. What it still costs such a run:
-- for any AFTER ROW UPDATE trigger Postgres fetches the updated row's old version before it
-- tests the column list and the WHEN (a heap fetch of a row the statement just read, on every
-- update of runs: claim, renewal, seal), then the test itself, a column read. Not BEFORE: a
-- BEFORE trigger locks each row first whatever its WHEN says (bench/README.md, issue 29).
DROP TRIGGER IF EXISTS runs_parent_ended ON leasework.runs;
CREATE TRIGGER runs_parent_ended
    AFTER UPDATE OF status ON leasework.runs
    FOR EACH ROW WHEN (NEW.has_dependents
                       AND NEW.status IN ('succeeded', 'partial', 'failed', 'cancelled')
                       AND OLD.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled'))
    EXECUTE FUNCTION leasework.parent_ended();

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


-- The roles granted EXECUTE on the old function, kept (transaction-local) for after its drop.
DO $$
BEGIN
    PERFORM set_config('leasework.enqueue_grantees', coalesce((
        SELECT string_agg(quote_ident(r.rolname), ',')
          FROM pg_proc p, aclexplode(p.proacl) a
          JOIN pg_roles r ON r.oid = a.grantee
         WHERE p.oid = to_regprocedure('leasework.enqueue(text, jsonb, text, text, text, boolean,'
                                       ' double precision, double precision, double precision,'
                                       ' double precision, double precision, double precision,'
                                       ' double precision, double precision, bigint, integer)')
           AND a.privilege_type = 'EXECUTE' AND r.oid <> p.proowner), ''), true);
END
$$;

DROP FUNCTION IF EXISTS leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision,
    double precision, double precision, double precision, bigint, integer);

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
    on_parent_failure text DEFAULT NULL
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

REVOKE EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision,
    double precision, double precision, double precision, bigint, integer, bigint[], text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.enqueue_blocked(text, jsonb, text, text, text, boolean,
    integer, double precision, integer, double precision, double precision, boolean, bigint[],
    text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.parent_ended() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.join_batch(bigint, bigint) FROM PUBLIC;

DO $$
DECLARE
    grantees text := current_setting('leasework.enqueue_grantees', true);
BEGIN
    IF coalesce(grantees, '') <> '' THEN
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,'
                ' double precision, double precision, double precision, double precision,'
                ' double precision, double precision, double precision, double precision, bigint,'
                ' integer, bigint[], text) TO ' || grantees;
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.join_batch(bigint, bigint) TO ' || grantees;
    END IF;
END
$$;

-- Deleted runs (pruning, `leasework delete`, or the user's own DELETE) hand their counts over to
-- leasework.counters in the same transaction. Statement-level: one call per DELETE. The edges of
-- a deleted run that waited for others go with it (migration 0026; run_deps' primary key); an
-- edge whose parent is deleted stays until its child is (the child counts it as ended well).
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
    RETURN NULL;
END
$$;
