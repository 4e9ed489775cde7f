-- Migration 0003: the queue table's fillfactor and autovacuum settings (why: schema.sql, beside
-- the table). Idempotent: setting storage parameters again is harmless.
ALTER TABLE leasework.runs SET (
    fillfactor = 90,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 1000
);
