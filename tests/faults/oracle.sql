-- The chaos oracle (test-only, applied to the private cluster after `migrate`).

-- Every effect the test app commits, one row per step; deliberately no unique constraint, so a
-- step committed twice is counted, not prevented.
CREATE TABLE IF NOT EXISTS public.chaos_effects (
    run_id  bigint NOT NULL,
    step    int NOT NULL,
    owner   uuid NOT NULL,
    attempt int NOT NULL,
    pid     int NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    client  inet DEFAULT inet_client_addr()  -- the writing host (tests/process/test_hosts.py)
);

-- Each start of a handler (autocommit, before any effect): executions, committed or not.
CREATE TABLE IF NOT EXISTS public.chaos_exec (
    run_id  bigint NOT NULL,
    attempt int NOT NULL,
    owner   uuid NOT NULL,
    pid     int NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The fencing oracle: a write whose run is not owned by the writing token and running is
-- refused (SQLSTATE LW001), whatever the code path. Never fires if every effect is fenced.
CREATE OR REPLACE FUNCTION public.chaos_fence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM leasework.runs
                    WHERE id = NEW.run_id AND lease_owner = NEW.owner AND status = 'running') THEN
        RAISE EXCEPTION 'chaos oracle: stale write to run % by %', NEW.run_id, NEW.owner
              USING ERRCODE = 'LW001';
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS chaos_fence ON public.chaos_effects;
CREATE TRIGGER chaos_fence BEFORE INSERT OR UPDATE ON public.chaos_effects
    FOR EACH ROW EXECUTE FUNCTION public.chaos_fence();

-- Every run transition (and renewal), for invariants checked over the history afterwards.
CREATE TABLE IF NOT EXISTS public.chaos_transitions (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id       bigint NOT NULL,
    old_status   text,
    new_status   text NOT NULL,
    old_owner    uuid,
    new_owner    uuid,
    old_attempts int,
    new_attempts int NOT NULL,
    max_attempts int NOT NULL,
    old_expires  timestamptz,
    new_expires  timestamptz,
    old_units    bigint,
    new_units    bigint NOT NULL,
    cancel_requested boolean NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    client       inet DEFAULT inet_client_addr(),  -- the writing session's host
    app          text DEFAULT current_setting('application_name')  -- and its worker
);

CREATE OR REPLACE FUNCTION public.chaos_log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.chaos_transitions (run_id, old_status, new_status, old_owner, new_owner,
        old_attempts, new_attempts, max_attempts, old_expires, new_expires, old_units, new_units,
        cancel_requested)
    VALUES (NEW.id, CASE WHEN TG_OP = 'UPDATE' THEN OLD.status END, NEW.status,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.lease_owner END, NEW.lease_owner,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.attempts END, NEW.attempts, NEW.max_attempts,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.lease_expires_at END, NEW.lease_expires_at,
        CASE WHEN TG_OP = 'UPDATE' THEN OLD.processed_units END, NEW.processed_units,
        NEW.cancel_requested_at IS NOT NULL);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS chaos_log_transition ON leasework.runs;
CREATE TRIGGER chaos_log_transition AFTER INSERT OR UPDATE ON leasework.runs
    FOR EACH ROW EXECUTE FUNCTION public.chaos_log_transition();

-- Every call of a durable step's function (chaosapp's `durable`), logged (autocommit, outside the
-- fence) as it returns, with the token it returns: calls, stored or not (leasework.run_steps
-- holds the value stored, once).
CREATE TABLE IF NOT EXISTS public.chaos_step_calls (
    seq     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id  bigint NOT NULL,
    name    text NOT NULL,
    token   text NOT NULL,
    attempt int NOT NULL,
    owner   uuid NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
