-- Least-privilege roles for leasework. Run as the owner of the `leasework` schema (the role that
-- ran `leasework migrate`), after migrating; re-run after each upgrade that adds tables.
-- No superuser is needed at run time. Grant these NOLOGIN roles to your login roles, e.g.
--   CREATE ROLE jobs_host LOGIN PASSWORD '...' IN ROLE leasework_worker;
--   CREATE ROLE web_app   LOGIN PASSWORD '...' IN ROLE leasework_enqueue;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'leasework_worker') THEN
        CREATE ROLE leasework_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'leasework_enqueue') THEN
        CREATE ROLE leasework_enqueue NOLOGIN;
    END IF;
END
$$;

-- Workers and supervisors: the DML of every stage, nothing else (no DDL, no TRUNCATE).
GRANT USAGE ON SCHEMA leasework TO leasework_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA leasework TO leasework_worker;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA leasework TO leasework_worker;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA leasework TO leasework_worker;

-- Web processes: enqueue and cancel. They can insert runs and tenants and read runs, and may
-- update only the columns a cancel touches: never a lease column.
GRANT USAGE ON SCHEMA leasework TO leasework_enqueue;
GRANT SELECT, INSERT ON leasework.runs TO leasework_enqueue;
GRANT UPDATE (status, finished_at, error, cancel_requested_at) ON leasework.runs TO leasework_enqueue;
GRANT SELECT, INSERT ON leasework.tenants TO leasework_enqueue;
GRANT SELECT ON leasework.schema_version TO leasework_enqueue;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA leasework TO leasework_enqueue;
GRANT EXECUTE ON FUNCTION leasework.now() TO leasework_enqueue;
