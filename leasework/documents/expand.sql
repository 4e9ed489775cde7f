-- The expand stage: ZIP uploads expanded into files. The seed's second claim shape: no lease, a
-- processing_since timestamp; anything stuck in `processing` past the reclaim time is claimed
-- again (the work is safe to redo). processing_since is the claim's token: the finishing writes
-- match nothing once another worker has re-claimed the upload.

-- name: fail_stuck_uploads
-- Stuck again after its last allowed attempt (an archive that keeps killing its worker).
UPDATE leasework.uploads
   SET status = 'failed', processing_since = NULL, finished_at = leasework.now(),
       error = format('expansion did not finish in %%s attempts', attempts)
 WHERE status = 'processing'
   AND processing_since < leasework.now() - make_interval(secs => %(reclaim)s)
   AND attempts >= %(max_attempts)s
RETURNING id

-- name: next_stuck
-- Seconds until the first upload in `processing` has been so for %(reclaim)s (claimed again, or
-- failed, then); NULL: none is. How long an idle worker may sleep as far as uploads go (a new
-- one NOTIFYs). Walks uploads_claimable.
SELECT extract(epoch FROM min(processing_since) + make_interval(secs => %(reclaim)s)
                          - leasework.now())::float8
  FROM leasework.uploads
 WHERE status = 'processing'

-- name: claim_upload
UPDATE leasework.uploads u
   SET status = 'processing', processing_since = leasework.now(), attempts = u.attempts + 1
 WHERE u.id = (
        SELECT id
          FROM leasework.uploads
         WHERE (status = 'pending'
             OR (status = 'processing'
                 AND processing_since < leasework.now() - make_interval(secs => %(reclaim)s)))
           AND attempts < %(max_attempts)s
         ORDER BY id
         LIMIT 1
           FOR UPDATE SKIP LOCKED)
RETURNING u.id, u.project, u.name, u.store_key, u.processing_since, u.attempts

-- name: fence_upload
-- Inside the finishing transaction: still ours? Locks the row until commit.
SELECT 1 FROM leasework.uploads
 WHERE id = %(id)s AND status = 'processing' AND processing_since = %(since)s
   FOR UPDATE

-- name: member_files
SELECT member FROM leasework.files WHERE upload_id = %(id)s

-- name: insert_member_file
-- Keyed by (upload, member path): a redo after a crash inserts nothing twice.
INSERT INTO leasework.files (project, name, store_key, size, sha256, upload_id, member)
VALUES (%(project)s, %(name)s, %(store_key)s, %(size)s, %(sha256)s, %(upload_id)s, %(member)s)
ON CONFLICT (upload_id, member) WHERE upload_id IS NOT NULL DO NOTHING
RETURNING id

-- name: finish_upload
UPDATE leasework.uploads
   SET status = %(status)s, result = %(result)s, error = %(error)s,
       processing_since = NULL,
       finished_at = CASE WHEN %(status)s IN ('done', 'failed') THEN leasework.now() END
 WHERE id = %(id)s AND status = 'processing' AND processing_since = %(since)s
RETURNING id
