-- The ingest stage: one file indexed per `ingest` run. Every write here runs inside the run's
-- fenced transaction (ctx.transaction()), so a worker that lost its lease commits nothing.

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
-- Failed, or back to pending after a cancel.
UPDATE leasework.files
   SET status = %(status)s, error = %(error)s
 WHERE id = %(id)s AND status IN ('pending', 'indexing')
