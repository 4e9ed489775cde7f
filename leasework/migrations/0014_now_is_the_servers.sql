-- Migration 0014: leasework.now() is the server's now(), nothing added. It used to add the session
-- setting leasework.now_offset, a way for tests to move time that production never set; inlined
-- four times into the one-at-a-time statement, its current_setting, nullif, cast and coalesce were
-- 5 % of the server's instructions per job (bench/README.md, issue 19, fifth pass). The test
-- suite puts the movable clock back in its own databases (tests/clock.py). Idempotent.
CREATE OR REPLACE FUNCTION leasework.now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT now();
$$;
