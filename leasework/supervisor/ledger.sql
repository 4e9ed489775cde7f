-- The supervisor's own statement (its other writes go through workers/registry.sql and the
-- lease module's expire_worker_leases).

-- name: wake_workers
-- After a reaped child's leases were expired: wake every idle worker's LISTEN so the run is
-- reclaimed at once instead of at the next poll.
SELECT pg_notify('leasework', 'reclaim')
