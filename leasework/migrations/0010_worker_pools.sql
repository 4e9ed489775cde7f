-- Migration 0010: a worker's pool (config `pools`) on its row, for `status` and the dashboard.
-- pool_kinds NULL with a pool: the pool that takes every kind no other pool of its host names.
-- Idempotent.
ALTER TABLE leasework.workers ADD COLUMN IF NOT EXISTS pool text;
ALTER TABLE leasework.workers ADD COLUMN IF NOT EXISTS pool_kinds text[];
