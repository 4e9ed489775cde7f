-- Migration 0005: the single-column rules of leasework.runs on numbers move from table CHECKs to
-- domains, checked only where a value is written (why: schema.sql, above the table). The two
-- CHECKs that relate columns (running <=> lease set, terminal <=> finished_at set) stay, and so
-- does the status rule: older workers bind one untyped parameter to `status` and to a text
-- argument, which a domain column would make ambiguous during a rolling upgrade. Changing a
-- column to a domain over its own type rewrites nothing; Postgres checks the existing rows
-- against the domain and rebuilds the indexes on the changed columns. Idempotent.
DO $$
BEGIN
    IF to_regtype('leasework.attempt_count') IS NULL THEN
        CREATE DOMAIN leasework.attempt_count AS integer CONSTRAINT attempt_count_valid
            CHECK (VALUE >= 0);
    END IF;
    IF to_regtype('leasework.max_attempts') IS NULL THEN
        CREATE DOMAIN leasework.max_attempts AS integer CONSTRAINT max_attempts_valid
            CHECK (VALUE >= 1);
    END IF;
    IF to_regtype('leasework.units') IS NULL THEN
        CREATE DOMAIN leasework.units AS bigint CONSTRAINT units_valid CHECK (VALUE >= 0);
    END IF;
    IF to_regtype('leasework.seconds') IS NULL THEN
        CREATE DOMAIN leasework.seconds AS double precision CONSTRAINT seconds_positive
            CHECK (VALUE > 0);
    END IF;
END
$$;

ALTER TABLE leasework.runs
    DROP CONSTRAINT IF EXISTS runs_attempts_valid,
    DROP CONSTRAINT IF EXISTS runs_units_valid,
    DROP CONSTRAINT IF EXISTS runs_lease_positive,
    DROP CONSTRAINT IF EXISTS runs_timeout_positive,
    ALTER COLUMN attempts TYPE leasework.attempt_count,
    ALTER COLUMN max_attempts TYPE leasework.max_attempts,
    ALTER COLUMN processed_units TYPE leasework.units,
    ALTER COLUMN total_units TYPE leasework.units,
    ALTER COLUMN lease_seconds TYPE leasework.seconds,
    ALTER COLUMN timeout_seconds TYPE leasework.seconds;
