-- The ingest stage: one file indexed per `ingest` run. Every write here runs inside the run's
-- fenced transaction (ctx.transaction()) or is scoped by the run's owner token itself
-- (mark_file_if_ours), so a worker that lost its lease commits nothing.

-- name: get_file
SELECT id, project, name, store_key, size, sha256, status
  FROM leasework.files
 WHERE id = %(id)s

-- name: start_indexing
-- Returns the content the previous attempt started on (previous_sha256): if it differs from
-- the file's current content, the checkpoint is stale and indexing starts over.
UPDATE leasework.files f
   SET status = 'indexing', error = NULL, indexing_sha256 = f.sha256
  FROM leasework.files old
 WHERE f.id = %(id)s AND old.id = f.id
RETURNING f.project, f.name, f.store_key, f.size, f.sha256, old.indexing_sha256 AS previous_sha256

-- name: upsert_chunks
-- Keyed by (file_id, idx): redoing a batch after a crash overwrites it, harmlessly.
INSERT INTO leasework.chunks (file_id, idx, project, page, text, embedding)
VALUES (%(file_id)s, %(idx)s, %(project)s, %(page)s, %(text)s, %(embedding)s)
ON CONFLICT (file_id, idx) DO UPDATE
   SET project = EXCLUDED.project, page = EXCLUDED.page, text = EXCLUDED.text,
       embedding = EXCLUDED.embedding

-- name: delete_tail_chunks
-- Chunks past the new tail, left by an earlier attempt on longer content.
DELETE FROM leasework.chunks WHERE file_id = %(id)s AND idx >= %(total)s

-- name: delete_file_chunks
DELETE FROM leasework.chunks WHERE file_id = %(id)s

-- name: lock_file
-- The re-check before `ready`: the row is locked until commit, so a move or a replacement
-- either happened before (and we start over) or waits for us (and sees `ready`).
SELECT project, sha256 FROM leasework.files WHERE id = %(id)s FOR UPDATE

-- name: mark_ready
UPDATE leasework.files
   SET status = 'ready', chunks = %(chunks)s, error = NULL, indexed_at = leasework.now()
 WHERE id = %(id)s AND project = %(project)s AND sha256 = %(sha256)s

-- name: mark_file
-- Failed: a file no attempt could index (the stage's reject, inside its own fence).
UPDATE leasework.files
   SET status = %(status)s, error = %(error)s
 WHERE id = %(id)s AND status IN ('pending', 'indexing')

-- name: mark_file_if_ours
-- Failed on the last attempt, or back to pending after a cancel, while the run is still ours:
-- owner-scoped like the run's outcome written next (finish_run, requeue_run), so a worker whose
-- run was settled or taken meanwhile (and a newer run may be indexing the file) writes nothing.
-- The run row is locked FOR KEY SHARE first, as fence_run does, so it cannot be settled or taken
-- (their FOR UPDATE SKIP LOCKED skips it) before this statement commits. Unlike fence_run it also
-- accepts a lease that ran out with nobody taking it, as finish_run does: a run with a cancel
-- request or on its last attempt is never reclaimed, so a cancel seen late (after a slow embed)
-- still resets its file. One row always: whether the run was ours.
WITH ours AS MATERIALIZED (
    SELECT id
      FROM leasework.runs
     WHERE id = %(run_id)s AND lease_owner = %(owner)s
       FOR KEY SHARE
), marked AS (
    UPDATE leasework.files
       SET status = %(status)s, error = %(error)s
     WHERE id = %(id)s AND status IN ('pending', 'indexing')
       AND EXISTS (SELECT 1 FROM ours)
)
SELECT EXISTS (SELECT 1 FROM ours) AS ours
