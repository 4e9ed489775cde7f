-- What a handler reads of the runs its run waited for (ctx.parents(), workers/parents.py;
-- docs/workflows.md): one statement, when the handler asks. A parent deleted since (pruned) is
-- left out.

-- name: parents
SELECT p.id, p.kind, p.status, p.result, p.error, d.member
  FROM leasework.run_deps d
  JOIN leasework.runs p ON p.id = d.parent
 WHERE d.child = %(id)s
 ORDER BY p.id
