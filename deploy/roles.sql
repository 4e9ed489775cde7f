-- Least-privilege roles for leasework. Run as the owner of the `leasework` schema (the role that
-- ran `leasework migrate`), after migrating; re-run after each upgrade (it revokes what an
-- older copy of this file granted, then grants what this release needs). No superuser is needed
-- at run time. Grant these NOLOGIN roles to your login roles, e.g.
--   CREATE ROLE jobs_host LOGIN PASSWORD '...' IN ROLE leasework_worker;
--   CREATE ROLE web_app   LOGIN PASSWORD '...' IN ROLE leasework_enqueue;
-- What each role can and cannot do: README.md, "Security".

-- Roles are cluster-wide: two sessions running this file at once must not fail on each other.
DO $$
BEGIN
    BEGIN
        CREATE ROLE leasework_worker NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
    END;
    BEGIN
        CREATE ROLE leasework_enqueue NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
    END;
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
    double precision, double precision, double precision, double precision, double precision)
    TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.cancel(bigint) TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.now() TO leasework_enqueue;
