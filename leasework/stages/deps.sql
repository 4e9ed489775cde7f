-- The deps stage (stages/deps.py; docs/workflows.md): decides the runs that wait for others
-- (status `blocked`, leasework.run_deps) once their parents ended. Each statement runs in the
-- stage's one transaction per step. Nothing here writes a lease column, and no worker waits on
-- it: every row lock is taken SKIP LOCKED, and a row skipped is tried again at the next step.

-- name: take_parent
-- The oldest inbox row's parent, with every inbox row of that parent, locked (another worker's
-- stage takes the next parent); `skipped`: the parents this step left for the next one.
WITH first AS MATERIALIZED (
    SELECT e.parent
      FROM leasework.run_deps_ended e
     WHERE e.parent <> ALL (%(skipped)s::bigint[])
     ORDER BY e.id
     LIMIT 1
       FOR UPDATE SKIP LOCKED
)
SELECT first.parent,
       ARRAY(SELECT e.id FROM leasework.run_deps_ended e
              WHERE e.parent = first.parent
              ORDER BY e.id
                FOR UPDATE SKIP LOCKED) AS ids,
       r.status, r.has_dependents, r.id IS NOT NULL AS present
  FROM first
  LEFT JOIN leasework.runs r ON r.id = first.parent

-- name: mark_parent
-- A parent not yet marked: its row locked unless someone holds it (then NULL: its inbox rows
-- wait for the next step) and marked, so that from the commit on its end fires
-- runs_ended (schema.sql). The status returned is the latest committed, read under the
-- lock: a parent that has not ended here records its own end. A parent already marked is never
-- locked: its end records itself, and the status read without a lock says whether it ended.
WITH p AS MATERIALIZED (
    SELECT r.id, r.status
      FROM leasework.runs r
     WHERE r.id = %(parent)s
       FOR NO KEY UPDATE SKIP LOCKED
), marked AS (
    UPDATE leasework.runs r SET has_dependents = true
      FROM p
     WHERE r.id = p.id
)
SELECT status FROM p

-- name: lock_children
-- The blocked children of one ended parent, each locked (SKIP LOCKED: one another worker is
-- deciding, or a run joining its batch holds, is left to it, and this parent's inbox row stays
-- for the next step). Returns how many blocked children it saw (`seen`) and the ids it locked,
-- for decide_children, the next statement: it reads the edges and the parents' ends with a
-- snapshot taken after these locks. This statement's snapshot is older than its locks, so an
-- edge committed in between (leasework.join_batch: its lock of the callback's row gone with its
-- commit) would be missing from it.
WITH seen AS MATERIALIZED (
    SELECT c.id
      FROM leasework.run_deps d
      JOIN leasework.runs c ON c.id = d.child
     WHERE d.parent = %(parent)s AND c.status = 'blocked'
), kids AS MATERIALIZED (
    SELECT c.id
      FROM leasework.runs c
     WHERE c.id IN (SELECT id FROM seen) AND c.status = 'blocked'
     ORDER BY c.id
       FOR UPDATE SKIP LOCKED
)
SELECT (SELECT count(*) FROM seen) AS seen, ARRAY(SELECT id FROM kids) AS locked

-- name: decide_children
-- The children lock_children locked (`kids`), in the same transaction, each decided once its
-- every parent has ended, read with this statement's snapshot: taken after the inbox row of this
-- parent committed (every parent's end commits with its own inbox row, so the step that reads
-- the last one sees them all) and after the child's row lock (a run joining a batch holds the
-- callback's row until it commits, so every member that joined is read here, and a join that
-- comes later finds the batch closed): `queued`, due now (or at its delay, if later), its tenant
-- back in the turns (leasework.tenant_queued_run); or `cancelled` when a parent ended `failed`
-- or `cancelled` and the edge is not `anyway`. A parent gone (pruned) counts as ended well.
-- Returns how many it decided, and the kinds made due, to NOTIFY (at commit).
WITH verdict AS MATERIALIZED (
    SELECT k.id,
           count(*) FILTER (
               WHERE p.status NOT IN ('succeeded', 'partial', 'failed', 'cancelled')) AS open,
           min(d.parent) FILTER (
               WHERE NOT d.anyway AND p.status IN ('failed', 'cancelled')) AS bad
      FROM leasework.runs k
      JOIN leasework.run_deps d ON d.child = k.id
      LEFT JOIN leasework.runs p ON p.id = d.parent
     WHERE k.id = ANY (%(kids)s::bigint[]) AND k.status = 'blocked'
     GROUP BY k.id
), decided AS (
    UPDATE leasework.runs r
       SET status = CASE WHEN v.bad IS NULL THEN 'queued' ELSE 'cancelled' END,
           queued_at = CASE WHEN v.bad IS NULL THEN greatest(r.queued_at, leasework.now())
                            ELSE r.queued_at END,
           finished_at = CASE WHEN v.bad IS NULL THEN NULL ELSE leasework.now() END,
           error = CASE WHEN v.bad IS NULL THEN r.error
                        ELSE format('run %%s, which it waited for, ended %%s', v.bad,
                                    (SELECT p.status FROM leasework.runs p WHERE p.id = v.bad))
                   END
      FROM verdict v
     WHERE r.id = v.id AND v.open = 0
       -- Its tenant has a queued run again (leasework.tenant_queued_run, schema.sql).
       AND (v.bad IS NOT NULL OR r.tenant IS NULL
            OR leasework.tenant_queued_run(r.tenant, r.priority))
    RETURNING r.id, r.kind, r.status
)
SELECT (SELECT count(*) FROM decided) AS decided,
       (SELECT count(pg_notify('leasework', q.kind))
          FROM (SELECT DISTINCT kind FROM decided WHERE status = 'queued') q) AS notified

-- name: done_ended
-- The inbox rows of the parents handled in this step.
DELETE FROM leasework.run_deps_ended WHERE id = ANY (%(ids)s::bigint[])
