-- Files and uploads, written by the App in the caller's own connection and transaction.
-- None of them writes lease columns; ingest runs are enqueued through App.enqueue.

-- name: insert_file
INSERT INTO leasework.files (project, name, store_key, size, sha256)
VALUES (%(project)s, %(name)s, %(store_key)s, %(size)s, %(sha256)s)
RETURNING id

-- name: insert_upload
INSERT INTO leasework.uploads (project, name, store_key, size)
VALUES (%(project)s, %(name)s, %(store_key)s, %(size)s)
RETURNING id

-- name: notify_upload
SELECT pg_notify('leasework', 'upload')

-- name: replace_file_bytes
-- New bytes for an existing file; the previous key is returned so its bytes can be removed.
UPDATE leasework.files f
   SET store_key = %(store_key)s, size = %(size)s, sha256 = %(sha256)s, status = 'pending',
       error = NULL
  FROM leasework.files old
 WHERE f.id = %(id)s AND old.id = f.id
RETURNING old.store_key

-- name: move_file
-- A new scope: the file's chunks follow it at once. An ingest run in flight re-checks the scope
-- before marking the file ready and starts over if it changed under it.
WITH f AS (
    UPDATE leasework.files SET project = %(project)s WHERE id = %(id)s RETURNING id
)
UPDATE leasework.chunks c SET project = %(project)s FROM f WHERE c.file_id = f.id

-- name: file_exists
SELECT 1 FROM leasework.files WHERE id = %(id)s

-- name: old_uploads
-- Finished uploads past retention (their archives are deleted from the store first).
SELECT id, store_key
  FROM leasework.uploads
 WHERE finished_at < leasework.now() - make_interval(secs => %(retention)s)
 ORDER BY finished_at
 LIMIT %(limit)s

-- name: delete_uploads
DELETE FROM leasework.uploads WHERE id = ANY(%(ids)s) RETURNING id

-- name: reconcile_files
-- Files left `indexing` by an ingest run that ended outside its handler (expire_and_promote fails a
-- run whose lease expired on its last attempt, and knows nothing of files): follow the run.
-- A cancelled run leaves the file `pending`, any other ending leaves it `failed`.
WITH stuck AS MATERIALIZED (
    SELECT f.id, r.status AS run_status, r.error
      FROM leasework.files f
     CROSS JOIN LATERAL (
            SELECT status, error
              FROM leasework.runs
             WHERE key = 'leasework:file:' || f.id
             ORDER BY id DESC
             LIMIT 1) r
     WHERE f.status = 'indexing'
       AND r.status IN ('failed', 'cancelled', 'partial')
     ORDER BY f.id
     LIMIT %(limit)s
       FOR UPDATE OF f SKIP LOCKED
)
UPDATE leasework.files f
   SET status = CASE WHEN stuck.run_status = 'cancelled' THEN 'pending' ELSE 'failed' END,
       error = left(coalesce(stuck.error, 'ingest run ended ' || stuck.run_status), 2000)
  FROM stuck
 WHERE f.id = stuck.id
RETURNING f.id
