-- Least-privilege roles for leasework. Run as the owner of the `leasework` schema (the role that
-- ran `leasework migrate`), after migrating; re-run after each upgrade (it revokes what an
-- older copy of this file granted, then grants what this release needs). No superuser is needed
-- at run time, nor CREATEROLE once the two roles exist (a superuser can make them first:
--   CREATE ROLE leasework_worker NOLOGIN; CREATE ROLE leasework_enqueue NOLOGIN;
-- this file says so when they are missing). With psql: `psql -v ON_ERROR_STOP=1 -f roles.sql`.
-- Grant these NOLOGIN roles to your login roles, e.g.
--   CREATE ROLE jobs_host LOGIN PASSWORD '...' IN ROLE leasework_worker;
--   CREATE ROLE web_app   LOGIN PASSWORD '...' IN ROLE leasework_enqueue;
-- What each role can and cannot do: docs/security.md.

-- Roles are cluster-wide. Each is made only when missing, so a schema owner without CREATEROLE
-- can run this file once they exist; when one is missing and cannot be made, one line says what
-- to ask a superuser for. Two sessions making them at once do not fail on each other.
DO $$
DECLARE
    wanted text;
    missing text[] := '{}';
BEGIN
    FOREACH wanted IN ARRAY ARRAY['leasework_worker', 'leasework_enqueue'] LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = wanted);
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', wanted);
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- made meanwhile by another session
            WHEN insufficient_privilege THEN
                missing := missing || wanted;
        END;
    END LOOP;
    IF cardinality(missing) > 0 THEN
        RAISE EXCEPTION 'deploy/roles.sql: % missing and role % cannot create roles (it lacks CREATEROLE): ask a superuser to run `%` (or to grant % CREATEROLE), then run this file again',
            array_to_string(missing, ' and ') || CASE WHEN cardinality(missing) = 1 THEN ' is' ELSE ' are' END,
            current_user,
            (SELECT string_agg(format('CREATE ROLE %I NOLOGIN;', m), ' ') FROM unnest(missing) AS m),
            current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$$;

-- Start from nothing, so that re-running this file after an upgrade also takes away privileges
-- an older release granted (before 0006 the enqueue role could insert and update runs).
REVOKE ALL ON ALL TABLES IN SCHEMA leasework FROM leasework_worker, leasework_enqueue;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA leasework FROM leasework_worker, leasework_enqueue;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA leasework FROM leasework_worker, leasework_enqueue;

-- Workers and supervisors: the DML of every stage, nothing else (no DDL, no TRUNCATE), and only
-- a read of schema_version: `leasework migrate` runs as the owner.
GRANT USAGE ON SCHEMA leasework TO leasework_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA leasework TO leasework_worker;
REVOKE INSERT, UPDATE, DELETE ON leasework.schema_version FROM leasework_worker;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA leasework TO leasework_worker;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA leasework TO leasework_worker;

-- Web processes: enqueue and cancel through two SECURITY DEFINER functions that check their
-- arguments, and nothing else: no table of leasework's is readable or writable by this role, so
-- it cannot choose a run's status, lease, id or timestamps, nor read other tenants' payloads.
-- (It reads schema_version to check the schema is current.)
GRANT USAGE ON SCHEMA leasework TO leasework_enqueue;
GRANT SELECT ON leasework.schema_version TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text, boolean,
    double precision, double precision, double precision, double precision, double precision,
    double precision, double precision, double precision, bigint, integer, bigint[], text, text[])
    TO leasework_enqueue;
-- The first half of a debounce_merge (a pending payload of a key this role could debounce).
GRANT EXECUTE ON FUNCTION leasework.debounce_pending(text, text, text) TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.cancel(bigint) TO leasework_enqueue;
-- The enqueuing span's traceparent, written into the run it just made (docs/operations.md, "Tracing").
GRANT EXECUTE ON FUNCTION leasework.trace_run(bigint, text) TO leasework_enqueue;
-- Add a run to an open batch (docs/workflows.md).
GRANT EXECUTE ON FUNCTION leasework.join_batch(bigint, bigint) TO leasework_enqueue;
-- A dependency's own policy, on a run enqueued in the same transaction (docs/workflows.md).
GRANT EXECUTE ON FUNCTION leasework.set_dependency_policy(bigint, bigint, text) TO leasework_enqueue;
-- Waiting for a run's end (`handle.wait`, `app.wait`): the status, result and error of a run
-- named by its id, and the mark that makes its end NOTIFY (leasework.run_outcome). Revoke it if
-- the web role must not read results.
GRANT EXECUTE ON FUNCTION leasework.run_outcome(bigint, boolean) TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.now() TO leasework_enqueue;
