-- Migration 0004: the queue table's storage settings as measured (why: schema.sql, beside the
-- table; bench/README.md "Bloat"). fillfactor back to 100 (no update of a run can be HOT, so the
-- room bought nothing) and the vacuum thresholds and cost limit back to Postgres' defaults (at a
-- busy rate autovacuum_naptime decides the cadence, not the table's thresholds); analyze at 2 %
-- is kept. Idempotent.
ALTER TABLE leasework.runs
    SET (autovacuum_analyze_scale_factor = 0.02, fillfactor = 100),
    RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
           autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_cost_limit);
