-- Queries of leasework.testing: reading runs back, and making delayed runs due in a test
-- database. None of them changes a status or writes a lease column.

-- name: run_row
SELECT id, kind, status, payload, result, error, attempts, queued_at, key, tenant,
       leasework.run_history(runs) AS history, snoozes
  FROM leasework.runs
 WHERE id = %(id)s

-- name: make_next_due
-- drain(jump_delays=True): the queued runs of these kinds due soonest (the earliest queued_at
-- after now) become due now, as if time had moved on to them; later ones keep their order.
UPDATE leasework.runs SET queued_at = leasework.now()
 WHERE status = 'queued' AND kind = ANY (%(kinds)s::text[])
   AND queued_at = (SELECT min(queued_at) FROM leasework.runs
                     WHERE status = 'queued' AND kind = ANY (%(kinds)s::text[])
                       AND queued_at > leasework.now())
RETURNING id

-- name: enqueued
SELECT id, kind, status, payload, key, tenant, "group", priority, queued_at
  FROM leasework.runs
 WHERE (%(kind)s::text IS NULL OR kind = %(kind)s::text)
   AND (%(payload)s::jsonb IS NULL OR payload = %(payload)s::jsonb)
   AND (%(key)s::text IS NULL OR key = %(key)s::text)
   AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
   AND (%(status)s::text IS NULL OR status = %(status)s::text)
 ORDER BY id
