-- The supervisor's own statement (its other writes go through workers/presence.sql and the
-- lease module's expire_worker_leases).

-- name: wake_workers
-- After a reaped child's leases were expired: wake every idle worker's LISTEN so the run is
-- reclaimed at once instead of at the next poll.
SELECT pg_notify('leasework', 'reclaim')

-- name: cancel_requested
-- The runs its children hold (id, owner) whose cancel was requested: a child stuck where it
-- cannot see the cancel itself (a C call holding the GIL) is killed after abort_grace.
SELECT r.id
  FROM leasework.runs r
  JOIN unnest(%(ids)s::bigint[], %(owners)s::uuid[]) AS h(id, owner)
    ON h.id = r.id AND h.owner = r.lease_owner
 WHERE r.id = ANY(%(ids)s::bigint[])
   AND r.cancel_requested_at IS NOT NULL
