-- Migration 0002: the rate limiter's index holds tenanted runs only, so claiming a run without a
-- tenant does not pay an insert here (replaces runs_running_by_tenant). Idempotent.
DROP INDEX IF EXISTS leasework.runs_running_by_tenant;
CREATE INDEX IF NOT EXISTS runs_running_tenanted
    ON leasework.runs (tenant, lease_expires_at) WHERE status = 'running' AND tenant IS NOT NULL;
