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
