-- The lease: every statement that writes lease columns lives here, and every one after the claim
-- is scoped by the claim's owner token (unique per claim), so a stale worker's write matches
-- nothing. All times are database time: leasework.now(), never the worker's clock.
--
-- The owner-scoped statements match `id = %(id)s AND lease_owner = %(owner)s` and no status:
-- lease_owner is set only while a run is running (this file is its only writer, and every
-- statement that moves a run out of `running` clears it; runs_state_valid checks it), so
-- the owner implies the status. A `status = 'running'` test made their generic plans walk the
-- partial index of running runs (runs_running_by_expiry: every running run and every dead entry)
-- instead of the primary key, a cost that grows with the runs running (figures: bench/README.md,
-- "Fourth round", 2).

-- name: claim_runs
-- Claim up to %(limit)s runs of %(kinds)s in one statement: queued and due, or running with an
-- expired lease (crash recovery is this WHERE clause). Cancel beats reclaim: an expired run with a
-- cancel request is never reclaimed (expire_and_promote ends it), nor one that used its last attempt.
--
-- The rate limiter: a run with a tenant is not claimable while another run of that tenant holds
-- a live lease and either one is exclusive or both share a group. The tenant row is locked with
-- the run (FOR UPDATE OF r, t SKIP LOCKED) so claim decisions for one tenant are serialized.
-- That alone leaves a narrow race (a rival's claim can commit after our snapshot was taken but
-- before we lock the tenant row), so each locked tenanted pick is re-checked with
-- leasework.limiter_conflict(), a VOLATILE function and therefore a fresh snapshot taken after
-- the tenant lock (in the tenants' walk, and in `tenanted` for a reclaim): a conflicting run is
-- simply not claimed. The whole claim stays one autocommit
-- statement (one round trip, no BEGIN/COMMIT). DISTINCT ON (tenant)
-- takes at most one run per tenant per statement, since the NOT EXISTS cannot see this
-- statement's own claims. Runs without a tenant skip the limiter and lock no tenant row (FOR
-- UPDATE cannot lock the nullable side of an outer join, hence two branches).
--
-- The limiter's predicate stands twice, on purpose: in the NOT EXISTS of the tenants' walk (a
-- probe per run read, no function call) and in leasework.limiter_conflict() in schema.sql (the
-- fresh-snapshot re-check, which alone guards a reclaim: expired leases are few). A change to the
-- rule changes both; tests/db/lease/ (test_limiter.py, test_races.py) exercise each branch.
--
-- %(finishing)s is NULL for a claim on its own; finish_and_claim passes the id of the run it seals
-- in the same statement, which the expired branches must not take (one statement cannot update a
-- row twice).
--
-- Queued runs and expired leases are separate branches, each walking its own index in order:
-- the queued-only partial indexes never hold a running run, so a claim adds no entry to them and
-- the dead entries a busy queue leaves behind stay one per run (bench/README.md, flatness);
-- expired leases are few and come from runs_running_by_expiry.
--
-- Each branch is AS MATERIALIZED so the LIMIT and the row locks are evaluated exactly once: inlined
-- into the UPDATE, the planner may re-run the subquery per joined row and claim more than the limit.
-- The UPDATE finds its rows by `id = ANY(ARRAY(...))`, an index look-up whatever the row estimate,
-- so the generic plan (workers force it on their main connection: planning this statement
-- costs more than running it) never turns into a hash join over the whole table.
--
-- Paused kinds (leasework.paused_kinds, `leasework pause`) are taken out of %(kinds)s once per
-- statement, in `live`, and every branch reads one index range per live kind (LATERAL over
-- `live`): the queued runs of a paused kind, of a kind another pool serves or of a kind nobody
-- serves are never walked, whatever their number. It holds for every branch, batch claims and
-- reclaims included; a running run finishes.
--
-- Flow control (migration 0023, docs/flow-control.md): `rules` reads the limits of the kinds
-- asked for (leasework.kind_limits: no row, and nothing more to read, for a kind without one).
-- A kind at its cap or its rate's limit in the statement's snapshot (leasework.kind_open: a hint)
-- leaves `live`, so its runs are not walked and a tenant's other kinds' runs come first; a kind
-- rated per tenant leaves the walk of a tenant whose window is full (tenant_rate_open, a hint
-- too); a group admits as many runs as its kind's group_limit (the walk's NOT EXISTS ends in
-- OFFSET group_limit - 1; limiter_conflict counts the same with a fresh snapshot). When a kind
-- asked for has a cap or a rate, `candidates` (every branch's picks) go through leasework.admit,
-- which decides: it locks the limited kinds' rows (in kind order; a claim of such a kind waits
-- for the one before it to commit), counts live leases and reads the windows with a fresh
-- snapshot, takes the candidates in claim order while each fits (the run being sealed with this
-- claim, %(finishing)s of %(worker)s, holding no place), and records them in the windows. Taking
-- that lock after the scans is safe only because a statement that seals a run seals it before it
-- claims (finish_and_claim): a scan keeps a lock on a row it skipped (FOR UPDATE's re-check), and
-- a claim holding a kind's row must never wait for such a lock held by a claim waiting for it.
-- A kind with a cap or a rate is never claimed by the quick statements (quick_claim).
--
-- Turns (migration 0016): runs with a tenant are taken tenant by tenant, in the order of
-- leasework.tenants' (priority, turn, name), walking only tenants with queued runs (`priority`
-- is that of a tenant's best queued run, NULL when it has none), each one's best claimable run
-- (priority, queued_at, id) across the live kinds. A tenant whose exclusive run holds a live
-- lease is passed by one probe, without reading its queued runs; a (tenant, kind) whose first
-- queued run is not due is read only if leasework.due_priority finds one due at a later
-- priority, so its delayed runs are never walked (the first run due, the usual case, costs one
-- look-up and no PL/pgSQL call). The limiter's fresh-snapshot re-check runs in the walk, after
-- each tenant row is locked, and the walk goes on past a tenant it rejects (up to two more): the
-- workers all start at the tenant next in line, and one whose snapshot predates a rival's claim
-- of that tenant would otherwise claim nothing while other tenants' runs wait (and then idle).
-- leasework.tenant_served() advances a claimed tenant's turn by 1 / weight and sets its priority
-- again (schema.sql: when no enqueue of that tenant is in flight). Runs without a tenant are one
-- more participant (migration 0033): while tenants' picks compete with queued runs without a
-- tenant in a statement, `contest` locks their turn (leasework.untenanted_turn; SKIP LOCKED: a
-- rival claim holding it is taking them, and this one takes the tenants' picks), each such run
-- takes the next of their turns (up to the last pick's at its priority: a tenant offers one pick
-- per statement), `chosen` orders all by (priority, turn, queued_at, id), a reclaim (an expired
-- lease's run) first within its priority, and leasework.untenanted_served() advances their turn
-- by what it took. With no tenant competing they are taken by (priority, queued_at, id), and
-- with none of them queued nothing is locked or written. The tenants' walk is a function of its
-- own, leasework.tenant_picks (schema.sql, migration 0036; why: `tenanted_queued`). The two NOT
-- EXISTS of the walk end in OFFSET 0, which keeps the planner from turning them into joins: a
-- generic plan built while one tenant holds most queued runs otherwise read that tenant's runs in
-- full (a hash anti-join over a sequential scan) for every tenant walked, and its cost estimate
-- was high enough for JIT compilation, 0.7 s per claim (bench/README.md, issue 29). Per row, as
-- a probe of runs_running_tenanted, they cost what they read.
WITH rules AS MATERIALIZED (
    SELECT l.kind,
           l.max_running IS NOT NULL OR l.rate_count IS NOT NULL AS limited,
           leasework.kind_open(l, %(finishing)s::bigint, %(worker)s) AS open
      FROM leasework.kind_limits l
     WHERE l.kind = ANY(%(kinds)s::text[])
), live AS MATERIALIZED (
    SELECT ARRAY(SELECT unnest(%(kinds)s::text[]) EXCEPT SELECT kind FROM leasework.paused_kinds
                 EXCEPT SELECT kind FROM rules WHERE NOT open) k,
           EXISTS (SELECT 1 FROM rules WHERE limited) AS limited
), tenanted_queued AS MATERIALIZED (
    -- The tenants' walk is leasework.tenant_picks (schema.sql, migration 0036): a function, so
    -- that its locks re-check a row changed since the snapshot (EvalPlanQual) after setting up
    -- its own query again, not every CTE here. Not called on a queue that never had a tenant.
    -- (Not gated on a tenant in the turns: that read the head of tenants_in_turn, where every
    -- tenant served leaves a dead entry, before the walk read it again; and a sequential scan of
    -- tenants in an EXISTS reads every row when none is in the turns.)
    SELECT * FROM leasework.tenant_picks((SELECT k FROM live)::text[], %(limit)s)
     WHERE EXISTS (SELECT 1 FROM leasework.tenants)
), tenanted_expired AS MATERIALIZED (
    SELECT r.id, r.tenant, r.priority, r.queued_at, r.kind, NULL::double precision AS turn
      FROM leasework.runs r
      JOIN leasework.tenants t ON t.name = r.tenant
     WHERE r.status = 'running' AND r.lease_expires_at < leasework.now()
       AND r.cancel_requested_at IS NULL AND r.attempts < r.max_attempts
       AND r.id IS DISTINCT FROM %(finishing)s::bigint
       AND r.kind = ANY((SELECT k FROM live)::text[])
     ORDER BY r.priority, r.queued_at, r.id
     LIMIT %(limit)s
       FOR UPDATE OF r, t SKIP LOCKED
), tenanted AS (
    SELECT DISTINCT ON (c.tenant) c.id, c.tenant, c.priority, c.queued_at, c.kind, c.turn
      FROM (SELECT * FROM tenanted_queued
            UNION ALL
            SELECT * FROM tenanted_expired WHERE NOT leasework.limiter_conflict(id)) c
     ORDER BY c.tenant, c.priority, c.queued_at, c.id
), untenanted_queued AS MATERIALIZED (
    -- Each kind's due priority is asked once, before the range is read (OFFSET 0 keeps the call
    -- out of the range's index condition): a row updated by a claim that committed after this
    -- statement's snapshot is re-checked (EvalPlanQual) when this statement goes to lock it, and a
    -- call in the condition ran again per such row, each walking the kind's index from its head,
    -- past every entry a snapshot still held back. Two workers draining a batch kind made it
    -- quadratic: one claim of 100 ran for 60 s (its own snapshot holding the entries back) while
    -- the other worker drained on alone.
    SELECT c.id, NULL::text AS tenant, c.priority, c.queued_at, k.kind
      FROM (SELECT k.kind, leasework.due_priority(k.kind, NULL) AS due
              FROM unnest((SELECT k FROM live)::text[]) AS k(kind) OFFSET 0) k, LATERAL (
        SELECT r.id, r.priority, r.queued_at
          FROM leasework.runs r
         WHERE r.tenant IS NULL
           AND r.status = 'queued' AND r.queued_at <= leasework.now()
           AND r.kind = k.kind AND r.priority = k.due
         ORDER BY r.priority, r.queued_at, r.id
         LIMIT %(limit)s
           FOR UPDATE OF r SKIP LOCKED) c
), untenanted_expired AS MATERIALIZED (
    SELECT r.id, r.tenant, r.priority, r.queued_at, r.kind
      FROM leasework.runs r
     WHERE r.tenant IS NULL
       AND r.status = 'running' AND r.lease_expires_at < leasework.now()
       AND r.cancel_requested_at IS NULL AND r.attempts < r.max_attempts
       AND r.id IS DISTINCT FROM %(finishing)s::bigint
       AND r.kind = ANY((SELECT k FROM live)::text[])
     ORDER BY r.priority, r.queued_at, r.id
     LIMIT %(limit)s
       FOR UPDATE OF r SKIP LOCKED
), contest AS MATERIALIZED (
    -- Runs without a tenant are one more participant in the turns, while tenants' picks compete
    -- with them in this statement: their turn (leasework.untenanted_turn), locked if no rival
    -- claim holds it, and never more than one turn of a pick's tenant behind that pick's (turns
    -- taken in order stay that close; further behind, they were idle while the tenants were
    -- served: back, they get that one turn, not a burst for the turns they missed). No row: no
    -- tenant competes, or no run without a tenant is queued (a queue of tenants alone locks and
    -- writes nothing here), or a rival claim holds it.
    SELECT greatest(u.turn, (SELECT min(p.turn - 1 / (SELECT t.weight FROM leasework.tenants t
                                                      WHERE t.name = p.tenant))
                               FROM tenanted p)) AS base, u.weight
      FROM leasework.untenanted_turn u
     WHERE EXISTS (SELECT 1 FROM tenanted) AND EXISTS (SELECT 1 FROM untenanted_queued)
       FOR UPDATE OF u SKIP LOCKED
), untenanted AS MATERIALIZED (
    -- Each queued run without a tenant takes the next of their turns (NULL when no tenant
    -- competes); none while tenants compete and a rival claim holds their turn (it is taking
    -- them). With the row gone (a user's TRUNCATE), the first pick's turn and no advance. An
    -- expired lease's run (a reclaim), with or without a tenant, has no turn: it comes first
    -- within its priority, as crash recovery should.
    SELECT c.id, c.tenant, c.priority, c.queued_at, c.kind,
           coalesce((SELECT base FROM contest), (SELECT min(p.turn) FROM tenanted p))
           + (row_number() OVER (PARTITION BY c.priority ORDER BY c.queued_at, c.id) - 1)
           / coalesce((SELECT weight FROM contest), 1) AS turn
      FROM untenanted_queued c
     WHERE NOT EXISTS (SELECT 1 FROM tenanted) OR EXISTS (SELECT 1 FROM contest)
        OR NOT EXISTS (SELECT 1 FROM leasework.untenanted_turn)
    UNION ALL
    SELECT *, NULL FROM untenanted_expired
), candidates AS MATERIALIZED (
    -- A tenant offers one pick per statement, so runs without a tenant take turns up to the last
    -- pick's at their priority, not past it.
    SELECT * FROM tenanted
    UNION ALL
    SELECT u.* FROM untenanted u
     WHERE u.turn IS NULL
        OR u.turn <= coalesce((SELECT max(p.turn) FROM tenanted p WHERE p.priority = u.priority),
                              u.turn)
), admitted AS MATERIALIZED (
    SELECT leasework.admit(array_agg(id ORDER BY priority, turn NULLS FIRST, queued_at, id),
                           array_agg(kind ORDER BY priority, turn NULLS FIRST, queued_at, id),
                           array_agg(tenant ORDER BY priority, turn NULLS FIRST, queued_at, id),
                           %(limit)s, %(finishing)s::bigint, %(worker)s) AS ids
      FROM candidates
), chosen AS MATERIALIZED (
    SELECT id, tenant
      FROM candidates
     WHERE NOT (SELECT limited FROM live) OR id = ANY((SELECT ids FROM admitted)::bigint[])
     ORDER BY priority, turn NULLS FIRST, queued_at, id
     LIMIT %(limit)s
), served AS (
    SELECT (SELECT count(leasework.tenant_served(tenant, id)) FROM chosen
             WHERE tenant IS NOT NULL)
         + (SELECT count(leasework.untenanted_served(c.base, n.taken))
              FROM contest c, (SELECT count(*) AS taken FROM chosen WHERE tenant IS NULL) n
             WHERE n.taken > 0) AS n
)
UPDATE leasework.runs r
   SET status = 'running',
       attempts = r.attempts + 1,
       lease_owner = gen_random_uuid(),
       lease_worker = %(worker)s,
       lease_expires_at = leasework.now() + make_interval(secs => coalesce(r.lease_seconds, %(lease)s)),
       started_at = leasework.now(),
       -- A reclaimed run records the attempt that died holding it (unless the supervisor's fast
       -- release already did): leasework.claimed_history, schema.sql (its cast guarded: 0020).
       history = leasework.claimed_history(r)
 WHERE r.id = ANY(ARRAY(SELECT id FROM chosen))
   -- Each claimed tenant's turn and priority are written first (served: read once, an InitPlan).
   AND (SELECT n FROM served) >= 0
   -- The claim commits synchronously. An asynchronous claim saved a WAL flush, but a claim lost
   -- in a server crash is handed out again after the restart while its first worker may still
   -- be running the handler (a blocking one notices only at its next renewal): two attempts of
   -- one run alive at once. Guarded by tests/chaos (the non-cooperative Postgres crash).
-- Unqualified: the statement has no FROM, so these are the claimed row's new values (and the
-- shorter text keeps finish_and_claim within psycopg's parse cache, see queries.load).
RETURNING id, kind, key, tenant, payload, result, attempts, max_attempts, lease_owner,
          lease_seconds, timeout_seconds, processed_units, total_units, priority, queued_at

-- name: expire_and_promote
-- The poll's bookkeeping, bounded by %(limit)s, in one round trip (no reaper process):
-- an expired run with a cancel request ends `cancelled` (cancel beats reclaim); an expired run on
-- its last attempt ends `failed` (nothing stays `running` forever); a waiting run is promoted to
-- `queued` once nothing else is active for its key in its tenant (runs without a tenant: among
-- runs without one).
WITH expired AS MATERIALIZED (
    SELECT r.id
      FROM leasework.runs r
     WHERE r.status = 'running'
       AND r.lease_expires_at < leasework.now()
       AND (r.cancel_requested_at IS NOT NULL OR r.attempts >= r.max_attempts)
     ORDER BY r.lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), ended AS (
    UPDATE leasework.runs r
       SET status = CASE WHEN r.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'failed' END,
           error = CASE WHEN r.cancel_requested_at IS NOT NULL THEN r.error ELSE 'lease expired' END,
           finished_at = leasework.now(),
           lease_owner = NULL,
           lease_expires_at = NULL,
           lease_worker = NULL,
           -- Unless the last entry is this attempt's already (its owner: the supervisor's fast
           -- release recorded it), as in claim_runs (leasework.claimed_history, schema.sql).
           history = CASE
               WHEN (r.history -> -1 ->> 'owner') IS DISTINCT FROM r.lease_owner::text
               THEN r.history || jsonb_build_array(leasework.history_entry(
                    r.attempts, r.lease_owner, r.lease_worker, r.started_at, r.lease_expires_at,
                    'expired', 'lease expired'))
               ELSE r.history
           END
      FROM expired
     WHERE r.id = expired.id
    RETURNING r.id
), promotable AS MATERIALIZED (
    SELECT w.id, leasework.key_lock(w.tenant, w.key) AS lock
      FROM leasework.runs w
     WHERE w.status = 'waiting'
       AND w.key IS NOT NULL
       AND NOT EXISTS (
            SELECT 1 FROM leasework.runs a
             WHERE a.key = w.key AND a.tenant IS NOT DISTINCT FROM w.tenant
               AND a.status IN ('queued', 'running'))
     ORDER BY w.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), unheld AS MATERIALIZED (
    -- A key with an enqueue still open (leasework.enqueue holds its key's advisory lock until
    -- commit, leasework.key_lock: its tenant's and its own) is skipped, not waited on: its
    -- uncommitted run, invisible to the NOT EXISTS above, would make the promotion wait in
    -- runs_one_active_per_key for as long as that transaction stays open. Tried again at the next
    -- settle; `busy` names the sessions holding it.
    SELECT id FROM promotable WHERE pg_try_advisory_xact_lock(-1682930272, lock)
), promoted AS (
    UPDATE leasework.runs r
       SET status = 'queued',
           queued_at = greatest(r.queued_at, leasework.now())
      FROM unheld
     WHERE r.id = unheld.id
       -- Its tenant has a queued run again (leasework.tenant_queued_run, schema.sql).
       AND (r.tenant IS NULL OR leasework.tenant_queued_run(r.tenant, r.priority))
    RETURNING r.id, r.kind
)
-- A promoted run is due now: NOTIFY its kind (at commit), so that a worker of another pool, or
-- one asleep until its next due time, claims it at once (workers/idle.py).
-- `busy`: the pids of the sessions holding the keys skipped, read (pg_locks) only when one was.
SELECT (SELECT count(*) FROM ended) AS ended, (SELECT count(*) FROM promoted) AS promoted,
       (SELECT count(pg_notify('leasework', p.kind))
          FROM (SELECT DISTINCT kind FROM promoted) p) AS notified,
       CASE WHEN (SELECT count(*) FROM promotable) > (SELECT count(*) FROM unheld) THEN (
           SELECT coalesce(array_agg(DISTINCT l.pid ORDER BY l.pid), '{}')
             FROM pg_locks l
             JOIN promotable w ON l.objid = w.lock::oid
            WHERE l.locktype = 'advisory' AND l.classid = (-1682930272)::oid
              AND l.objsubid = 2 AND l.granted AND l.pid <> pg_backend_pid()
              AND w.id NOT IN (SELECT id FROM unheld)) END AS busy

-- name: renew_lease
-- Zero rows means the run is no longer ours: stop at once. A lease that ran out is lost even
-- before another worker reclaims it: the claim's limiter counts only live leases, so a lapsed
-- exclusive run's tenant may already run another, and a renewal must not revive the first.
UPDATE leasework.runs
   SET lease_expires_at = leasework.now() + make_interval(secs => %(lease)s)
 WHERE id = %(id)s AND lease_owner = %(owner)s AND lease_expires_at > leasework.now()
RETURNING lease_expires_at, cancel_requested_at IS NOT NULL AS cancel_requested

-- name: tend_leases
-- The lease keeper's one statement per tick, on its own connection: renew the leases of the runs
-- flagged in %(renew)s and read the state of every run the worker holds. Per run: `ours` (false:
-- the lease is lost, stop at once: another owner, or the lease ran out, as renew_lease), `renewed`
-- and `cancel_requested`. Owner-scoped like every statement after the claim. A run whose cancel
-- was requested stays ours after its lease ran out (nobody reclaims it), so that its owner records
-- the cancel and its effects (an ingest's file reset); it is never renewed.
-- SKIP LOCKED: a run whose row is locked is not renewed this tick but stays ours. The only
-- lasting lock on a running run is the worker's own ctx.transaction() after a checkpoint inside
-- it (which renewed the lease in that transaction); waiting for it would stall every other
-- run's renewal behind a handler.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(owners)s::uuid[], %(leases)s::float8[],
                         %(renew)s::bool[]) AS h(id, owner, lease, renew)
), due AS MATERIALIZED (
    SELECT r.id, h.lease
      FROM leasework.runs r
      JOIN held h ON h.id = r.id AND h.owner = r.lease_owner
     WHERE r.id = ANY(%(ids)s::bigint[]) AND h.renew AND r.lease_expires_at > leasework.now()
       FOR NO KEY UPDATE OF r SKIP LOCKED
), renewed AS (
    UPDATE leasework.runs r
       SET lease_expires_at = leasework.now() + make_interval(secs => due.lease)
      FROM due
     WHERE r.id = due.id
    RETURNING r.id
)
SELECT h.id,
       r.id IS NOT NULL AS ours,
       n.id IS NOT NULL AS renewed,
       coalesce(r.cancel_requested_at IS NOT NULL, false) AS cancel_requested
  FROM held h
  LEFT JOIN renewed n ON n.id = h.id
  LEFT JOIN leasework.runs r ON r.id = h.id AND r.lease_owner = h.owner
                            AND (n.id IS NOT NULL OR r.lease_expires_at > leasework.now()
                                 OR r.cancel_requested_at IS NOT NULL)

-- name: control_run
-- One query answers both questions: no row = lease lost (another owner, or it ran out: as
-- renew_lease); cancel_requested = the user cancelled.
SELECT cancel_requested_at IS NOT NULL AS cancel_requested
  FROM leasework.runs
 WHERE id = %(id)s AND lease_owner = %(owner)s
   AND (lease_expires_at > leasework.now() OR cancel_requested_at IS NOT NULL)

-- name: finish_run
-- Terminal: succeeded, partial, failed or cancelled. A NULL result keeps the one gathered so far.
-- A success appends no history entry: the row records that attempt, lease_worker kept
-- (leasework.run_history, schema.sql).
UPDATE leasework.runs
   SET status = %(status)s::text,
       result = coalesce(%(result)s::jsonb, result),
       error = %(error)s::text,
       finished_at = leasework.now(),
       lease_owner = NULL,
       lease_expires_at = NULL,
       lease_worker = CASE WHEN %(status)s::text = 'succeeded' THEN lease_worker END,
       history = CASE WHEN %(status)s::text = 'succeeded' THEN history
           ELSE history || jsonb_build_array(leasework.history_entry(
               attempts, lease_owner, lease_worker, started_at, leasework.now(),
               %(status)s::text, %(error)s::text)) END
 WHERE id = %(id)s AND lease_owner = %(owner)s
RETURNING status

-- name: finish_and_claim
-- One-at-a-time mode's steady state in one round trip: seal a run that succeeded (finish_run,
-- owner-scoped as ever) and claim the next (claim_runs, with %(finishing)s = the sealed run's id)
-- in one statement, one transaction that commits synchronously. Each part is the statement of
-- its own name, put in place of its <name> by lease.py, so neither is written twice.
-- The two parts touch different rows: the claim's expired branches skip the run being sealed,
-- and queued runs are never running. A run with a tenant may be sealed here too: the claim's
-- limiter reads the statement's snapshot, in which that run still holds its lease, so the rule
-- can only be stricter than after the seal (a run that conflicts with it, same tenant and group
-- or either exclusive, is not claimed), never looser. What it holds back is claimable once the
-- seal commits: the next claim takes it (another worker's, or this one's, which may first take a
-- run of another tenant), and when this statement claims nothing the caller claims again at once
-- (lease.finish_and_claim). Sealing a tenanted run on its own instead cost a commit per job: a
-- queue spread over 1,000 tenants ran at 0.44 x an untenanted one (bench/claim_flatness.py).
-- One row always: `finished` (1: sealed, 0: the run was no longer ours and nothing was written
-- for it), then the claimed run's columns, all NULL when nothing was claimed. The seal is made
-- first (`finished` is the outer side of the nested loop, which an `ON true` join keeps), then
-- the claim: a claim that locks a limited kind's row (leasework.admit) must not then wait to
-- seal a run another claim's scan holds a lock on while it waits for that row (claim_runs).
WITH finished AS (
<finish_run>
), claimed AS (
<claim_runs>
)
SELECT f.n AS finished, c.*
  FROM (SELECT count(*) AS n FROM finished) f
  LEFT JOIN claimed c ON true

-- name: finish_and_claim_queued
-- finish_and_claim for its common case, a queue whose next run is queued and has no tenant: the
-- same seal (finish_run's writes) and claim (claim_runs' untenanted_queued branch and its writes),
-- but ONE UPDATE that writes both rows. Each update of `runs` in a statement costs the server a
-- fixed price whatever the rows (opening nine indexes, compiling their predicates and the CHECK,
-- building the projections), and the seal and the claim as two updates, with claim_runs' other
-- branches beside them, were most of a job's server time (figures: bench/README.md, issue 19,
-- third pass). Each SET is `CASE WHEN r.id = %(id)s` (the run being sealed: finish_run's value)
-- `ELSE` (the run claimed: claim_runs' value); each RETURNING row says which it is (`sealed`).
-- The claim is a scalar subquery (an InitPlan) rather than a CTE and an ARRAY of it: fewer plan
-- nodes to start per statement (bench/README.md, issue 19, fourth pass).
--
-- Sent only by a caller that found nothing else due lately (lease.Chain). The claim is claim_runs'
-- untenanted_queued branch (a unit test compares the texts), over %(kinds)s less the paused ones
-- (asked per kind), at the priority of the run being sealed: the best due priority when it was
-- claimed, so one bounded range per kind with no look-up of its own (due_priority, a PL/pgSQL
-- call, was a sixth of a job's server time). The range starts after the sealed run's (queued_at,
-- id): what lies before it was claimed when the sealed run was (the claim takes the first free
-- run), and under a snapshot held open elsewhere (a long transaction, a replica's query with
-- hot_standby_feedback) those runs' index entries stay behind, dead but not removable, so a
-- range from the start walked every run claimed since the snapshot was taken: 100,000 claimed
-- made each claim 20 times dearer (bench/README.md, issue 29 (f)). A run of a better priority
-- enqueued since, or one at the same priority that lands before the sealed run (one released,
-- one whose enqueue committed late with an earlier queued_at, one a lock kept from that claim)
-- is seen by the probed form's gate (below), so it waits at most lease.PROBE_EVERY in a worker
-- kept busy;
-- when nothing is left at that priority this claims nothing and the caller claims with
-- claim_runs (as it does whenever this claims nothing: it cannot tell a gate shut from an empty
-- queue, and need not). <quick_claim> is the fragment quick_claim below, or quick_claim_one for a
-- worker of one kind (no unnest and LATERAL: about a tenth of a job's server time); lease.py
-- puts it in.
-- lease.py sends it in two forms. Probed: <due_elsewhere> is the fragment below, so the claim is
-- gated on whether claim_runs could take a run this statement cannot; when it could not, this
-- claims exactly what claim_runs would. Lean: <due_elsewhere> left out (NOT (false): no gate);
-- a caller sends it for at most lease.PROBE_EVERY after a probed one claimed a run (lease.Chain).
-- The gate is an EXISTS in place, not a CTE read twice, and says nothing in the rows: a CTE and a
-- column for it cost 3 % of the statement (bench/README.md, issue 19, fourth pass).
-- Rows: the sealed run (unless it was no longer ours: then nothing was written for it) and the
-- claimed one (if any), each with `sealed`, then the claimed run's columns (payload and result
-- NULL on the sealed row, which the caller does not read). No row: neither.
UPDATE leasework.runs r
   SET status = CASE WHEN r.id = %(id)s::bigint THEN 'succeeded' ELSE 'running' END,
       result = CASE WHEN r.id = %(id)s::bigint THEN coalesce(%(result)s::jsonb, r.result)
                ELSE r.result END,
       error = CASE WHEN r.id = %(id)s::bigint THEN NULL ELSE r.error END,
       finished_at = CASE WHEN r.id = %(id)s::bigint THEN leasework.now() END,
       attempts = CASE WHEN r.id = %(id)s::bigint THEN r.attempts ELSE r.attempts + 1 END,
       lease_owner = CASE WHEN r.id = %(id)s::bigint THEN NULL ELSE gen_random_uuid() END,
       lease_worker = CASE WHEN r.id = %(id)s::bigint THEN r.lease_worker ELSE %(worker)s END,
       lease_expires_at = CASE WHEN r.id = %(id)s::bigint THEN NULL
           ELSE leasework.now() + make_interval(secs => coalesce(r.lease_seconds, %(lease)s)) END,
       started_at = CASE WHEN r.id = %(id)s::bigint THEN r.started_at ELSE leasework.now() END
 WHERE r.id = ANY(ARRAY[%(id)s::bigint, CASE WHEN NOT (false <due_elsewhere>) THEN (
           <quick_claim>) END])
   -- The seal is owner-scoped as ever; the claimed run was locked queued by untenanted_queued.
   AND (r.id IS DISTINCT FROM %(id)s::bigint OR r.lease_owner = %(owner)s::uuid)
RETURNING r.id = %(id)s::bigint AS sealed,
          id, kind, key, tenant,
          CASE WHEN r.id = %(id)s::bigint THEN NULL ELSE payload END AS payload,
          CASE WHEN r.id = %(id)s::bigint THEN NULL ELSE result END AS result, attempts,
          max_attempts, lease_owner, lease_seconds, timeout_seconds, processed_units, total_units

-- name: quick_claim
-- finish_and_claim_queued's claim (its <quick_claim>), for a worker of several kinds: claim_runs'
-- untenanted_queued branch at the sealed run's priority, after the sealed run's (queued_at, id),
-- over the kinds polled less the paused ones and those with a cap or a rate (leasework.kind_limits:
-- claim_runs admits their runs), but the sealed run's own kind when its place is handed on
-- (<handed_on>, below). A fragment of that statement, not a statement.
SELECT c.id
  FROM unnest(%(kinds)s::text[]) AS k(kind), LATERAL (
    SELECT r.id, r.priority, r.queued_at
      FROM leasework.runs r
     WHERE r.tenant IS NULL
       AND r.status = 'queued' AND r.queued_at <= leasework.now()
       AND r.kind = k.kind AND r.priority = (
           SELECT s.priority FROM leasework.runs s WHERE s.id = %(id)s::bigint)
       AND (r.queued_at, r.id) > ((SELECT s.queued_at FROM leasework.runs s
                                    WHERE s.id = %(id)s::bigint), %(id)s::bigint)
     ORDER BY r.priority, r.queued_at, r.id
     LIMIT %(limit)s
       FOR UPDATE OF r SKIP LOCKED) c
 WHERE NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k.kind)
   AND NOT EXISTS (SELECT 1 FROM leasework.kind_limits l WHERE l.kind = k.kind
                      AND (l.max_running IS NOT NULL OR l.rate_count IS NOT NULL)
                      AND NOT <handed_on>)
 ORDER BY c.priority, c.queued_at, c.id
 LIMIT %(limit)s

-- name: quick_claim_one
-- The same for a worker of one kind: its one range, without unnest and LATERAL.
SELECT r.id
  FROM leasework.runs r
 WHERE r.tenant IS NULL
   AND r.status = 'queued' AND r.queued_at <= leasework.now()
   AND r.kind = (%(kinds)s::text[])[1] AND r.priority = (
       SELECT s.priority FROM leasework.runs s WHERE s.id = %(id)s::bigint)
   AND (r.queued_at, r.id) > ((SELECT s.queued_at FROM leasework.runs s
                                WHERE s.id = %(id)s::bigint), %(id)s::bigint)
   AND NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p
                    WHERE p.kind = (%(kinds)s::text[])[1])
   AND NOT EXISTS (SELECT 1 FROM leasework.kind_limits l
                    WHERE l.kind = (%(kinds)s::text[])[1]
                      AND (l.max_running IS NOT NULL OR l.rate_count IS NOT NULL)
                      AND NOT <handed_on>)
 ORDER BY r.priority, r.queued_at, r.id
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED

-- name: handed_on
-- Whether the run claimed may take the place under its kind's cap that the run being sealed
-- leaves (quick_claim's <handed_on>, for the kind_limits row `l` of the kind claimed): the kind
-- has a cap and no rate (a rate must record each claim: leasework.admit, or the rated form
-- below), and leasework.hand_on (schema.sql) hands the place on: the sealed run is of that kind,
-- still ours and live, locked until this statement commits, and the kind's live leases are no
-- more than its cap. The seal and the claim commit together, so the kind's count of live leases
-- is the same before and after them; a claim that admits (leasework.admit) waits for the hand-ons
-- in flight (the kind's cap lock) and counts after them. A cap lowered below the live count stops
-- the hand-on (then claim_runs admits, or not). A fragment, not a statement.
(l.rate_count IS NULL
 AND leasework.hand_on(l.kind, %(id)s::bigint, %(owner)s::uuid, l.max_running))

-- name: handed_on_rated
-- handed_on in finish_and_claim_rated, where a kind with a rate may be claimed too: a cap's place
-- is handed on as above (leasework.hand_on, after that statement's `sealing`). Whether the rate
-- has room is `slot`'s to decide, under a shard's row lock (no hint read before it: one
-- look-up and one PL/pgSQL call less per claim; a full window costs one run locked and left).
(l.max_running IS NULL
 OR leasework.hand_on(l.kind, %(id)s::bigint, %(owner)s::uuid, l.max_running))

-- name: finish_and_claim_rated
-- finish_and_claim_queued for a worker that polls a kind with a rate (lease.Chain learns it when
-- claim_runs took a run the quick statement left): the same seal and quick claim, with a rated
-- kind's claim recorded in its window in the same statement, so its runs need not go through
-- claim_runs and leasework.admit one by one (bench/README.md, issue 31). In order: `sealing`
-- locks the run being sealed if it is still ours (first, as finish_and_claim seals first: a
-- worker holding a kind's row never waits on a run's row; matched by id and owner alone, as the
-- owner-scoped statements are, so that its generic plan reads the primary key and not every
-- entry of runs_running_by_expiry); `candidate` is the quick claim (its
-- <handed_on> is handed_on_rated), gated as in the probed or lean form, and only while the seal
-- will be made; `slot` takes a shard of its kind's window (leasework.rate_shards, migration
-- 0035) that no other claim holds (FOR UPDATE SKIP LOCKED: claims on different shards never wait
-- on each other; this backend's shard of its last claim first, `last_pid`, so that two workers
-- keep to their own and rarely meet a shard written since their snapshot) and that has room for
-- one more claim under its share. The room is read on the version locked, above the lock (OFFSET
-- 0 keeps it there): the shard's latest, a rival's claim committed meanwhile counted (FOR
-- UPDATE's re-check), so no shard ever passes its share, and the shares add up to the rate; and
-- only the shards locked are read, most often one (read below the lock, every shard's window was
-- counted before the sort, a PL/pgSQL call for each one not written in the current slice).
-- `rated` records the claim there. leasework.admit locks every shard of the kind before it reads them.
-- A shard with claims carried from before the rate last changed is left to admit, which counts
-- them with every shard's against the whole rate (leasework.rate_split).
-- A candidate of a rated kind that finds no shard with room free (or no shard: admit splits the
-- window) is not claimed (it stays queued; its lock ends with the statement), and the caller
-- claims with claim_runs as when the quick statement claims nothing. Runs without a tenant
-- only, which take their kind's window (with rate_per, the budget runs without a tenant share).
-- The count and the record are leasework.rate_used_fast and rate_recorded_fast: SQL functions
-- the planner inlines into the prepared statement, one subtraction and one array append while
-- the claim falls in the window's newest slice (a twentieth of the period), no PL/pgSQL call.
-- Narrow rows whose key never changes: a HOT update (bench/README.md, issue 31, third pass).
-- Followed by finish_and_claim_queued's UPDATE, its claim being <rated_claim>.
WITH sealing AS MATERIALIZED (
    SELECT s.id FROM leasework.runs s
     WHERE s.id = %(id)s::bigint AND s.lease_owner = %(owner)s::uuid
       FOR UPDATE
), candidate AS MATERIALIZED (
    SELECT c.id, c.kind FROM (<quick_claim>) c
     WHERE EXISTS (SELECT 1 FROM sealing) AND NOT (false <due_elsewhere>)
), slot AS MATERIALIZED (
    SELECT z.kind, z.shard, z.seconds FROM (
        SELECT y.kind, y.shard, y.share, y.win, y.carried, l.rate_seconds AS seconds
          FROM candidate c
          JOIN leasework.kind_limits l ON l.kind = c.kind AND l.rate_count IS NOT NULL
          JOIN leasework.rate_shards y ON y.kind = c.kind
         ORDER BY y.last_pid IS DISTINCT FROM pg_backend_pid(), mod(y.shard + pg_backend_pid(), 8)
        OFFSET 0
           FOR UPDATE OF y SKIP LOCKED) z
     WHERE z.carried IS NULL
       AND leasework.rate_used_fast(z.win, z.seconds, leasework.now()) < z.share
     LIMIT 1
), rated AS (
    UPDATE leasework.rate_shards x
       SET win = leasework.rate_recorded_fast(x.win, q.seconds, leasework.now()),
           last_pid = pg_backend_pid()
      FROM slot q
     WHERE x.kind = q.kind AND x.shard = q.shard
    RETURNING x.kind
)

-- name: rated_among
-- Whether a kind among those polled has a rate: a lease.Chain then sends finish_and_claim_rated
-- as its quick statement. Asked when claim_runs took a run the quick statement left.
SELECT EXISTS (SELECT 1 FROM leasework.kind_limits
                WHERE kind = ANY(%(kinds)s::text[]) AND rate_count IS NOT NULL)

-- name: rated_claim
-- finish_and_claim_rated's claim: the candidate, if its kind has no rate or `rated` recorded it.
(SELECT c.id FROM candidate c
  WHERE EXISTS (SELECT 1 FROM rated)
     OR NOT EXISTS (SELECT 1 FROM leasework.kind_limits l
                     WHERE l.kind = c.kind AND l.rate_count IS NOT NULL))

-- name: due_elsewhere
-- finish_and_claim_queued's gate, in its probed form: whether claim_runs could take a run that
-- statement cannot: a run without a tenant due at a better priority than the run being sealed,
-- a tenanted run queued and due, a lease expired and reclaimable (claim_runs' other branches'
-- predicates without the limiter and the locks, so it errs towards yes; a unit test compares
-- them), or a run without a tenant due at the sealed run's priority before it (the quick claim's
-- range starts after it). A fragment of that statement, not a statement.
OR EXISTS (
    SELECT 1 FROM unnest(%(kinds)s::text[]) AS k(kind)
     WHERE leasework.due_priority(k.kind, NULL)
           < (SELECT s.priority FROM leasework.runs s WHERE s.id = %(id)s::bigint)
       AND NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k.kind))
OR EXISTS (
    SELECT 1 FROM leasework.tenants t, unnest(%(kinds)s::text[]) AS k(kind)
     WHERE t.priority IS NOT NULL AND leasework.due_priority(k.kind, t.name) IS NOT NULL)
OR EXISTS (
    SELECT 1 FROM leasework.runs r
     WHERE r.status = 'running' AND r.lease_expires_at < leasework.now()
       AND r.cancel_requested_at IS NULL AND r.attempts < r.max_attempts
       AND r.id IS DISTINCT FROM %(id)s::bigint
       AND r.kind = ANY(%(kinds)s::text[]))
OR EXISTS (
    SELECT 1 FROM unnest(%(kinds)s::text[]) AS k(kind), LATERAL (
        SELECT 1 FROM leasework.runs r
         WHERE r.tenant IS NULL
           AND r.status = 'queued' AND r.queued_at <= leasework.now()
           AND r.kind = k.kind AND r.priority = (
               SELECT s.priority FROM leasework.runs s WHERE s.id = %(id)s::bigint)
           AND (r.queued_at, r.id) < ((SELECT s.queued_at FROM leasework.runs s
                                        WHERE s.id = %(id)s::bigint), %(id)s::bigint)
         LIMIT 1) b
     WHERE NOT EXISTS (SELECT 1 FROM leasework.paused_kinds p WHERE p.kind = k.kind))

-- name: finish_runs
-- A batch's successes in one statement (tasks declared with batch=N): each row is matched by its
-- own id AND owner, so a run in the batch whose lease was lost meanwhile writes nothing, exactly as
-- finish_run would. The same row writes as finish_run with status `succeeded` (no history
-- entry, lease_worker kept). Each run's owner and result are read from the arrays at its id's
-- position (%(results)s NULL: no run returned one), not by a join to unnest(...): that was a
-- nested loop over the function scan, which formed a whole-row copy of each of its rows for
-- every run updated, n x n per batch (2.8 ms of a batch of 100's 3 against 1.1 ms this way:
-- bench/README.md, issue 30, sixth pass). array_position is a walk of the ids per run, cheap
-- beside that at any batch size a task declares.
UPDATE leasework.runs r
   SET status = 'succeeded',
       result = coalesce((%(results)s::jsonb[])[array_position(%(ids)s::bigint[], r.id)],
                         r.result),
       error = NULL,
       finished_at = leasework.now(),
       lease_owner = NULL,
       lease_expires_at = NULL
 WHERE r.id = ANY(%(ids)s::bigint[])
   AND r.lease_owner = (%(owners)s::uuid[])[array_position(%(ids)s::bigint[], r.id)]
   -- `(SELECT 'running')`, not a literal: the planner cannot match it to the partial index of
   -- running runs, whose stale statistics (few running at the last ANALYZE) would otherwise win
   -- and walk every running run per batch; this way the rows come by primary key.
   AND r.status = (SELECT 'running')
RETURNING r.id

-- name: requeue_run
-- Retry in place on the same row, due after %(delay)s seconds. Re-checks the world: a cancel
-- requested meanwhile ends the run `cancelled`; no attempts left ends it `failed`. Queued again,
-- it NOTIFYs its kind at commit: idle workers sleep until the next run they know of is due
-- (workers/idle.py), and this one is new to them, whatever the worker that requeued it does next.
UPDATE leasework.runs
   SET status = CASE
           WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
           WHEN attempts >= max_attempts THEN 'failed'
           ELSE 'queued' END,
       queued_at = CASE
           WHEN cancel_requested_at IS NULL AND attempts < max_attempts
           THEN leasework.now() + make_interval(secs => %(delay)s)
           ELSE queued_at END,
       finished_at = CASE
           WHEN cancel_requested_at IS NOT NULL OR attempts >= max_attempts
           THEN leasework.now() END,
       result = coalesce(%(result)s::jsonb, result),
       error = %(error)s::text,
       lease_owner = NULL,
       lease_expires_at = NULL,
       lease_worker = NULL,
       history = history || jsonb_build_array(leasework.history_entry(
           attempts, lease_owner, lease_worker, started_at, leasework.now(),
           %(outcome)s::text, %(error)s::text))
 WHERE id = %(id)s AND lease_owner = %(owner)s
   -- Queued again, its tenant has a queued run (leasework.tenant_queued_run, schema.sql).
   AND (tenant IS NULL OR cancel_requested_at IS NOT NULL OR attempts >= max_attempts
        OR leasework.tenant_queued_run(tenant, priority))
RETURNING status, queued_at,
          CASE WHEN status = 'queued' THEN pg_notify('leasework', kind) END IS NULL AS quiet

-- name: snooze_run
-- A handler's Snooze: back to `queued`, due after %(after)s seconds, WITHOUT charging the attempt
-- (attempts - 1, as release_run) and without an error (the run's error stays as it was), the
-- snooze counted in `snoozes` (NULL: none yet, so a run that never snoozes stores nothing).
-- Owner-scoped like every write after the claim: a worker that lost its lease writes nothing.
-- Re-checks the world as requeue_run does: a cancel requested meanwhile ends the run
-- `cancelled`; a run that has snoozed %(max_snoozes)s times already ends `failed` instead (the
-- attempt charged; its error, %(too_often)s, says so), so nothing snoozes for ever. The history
-- entry's outcome is `snoozed` (`error`: the Snooze's reason, if any; `due_at`: when it is due
-- again), or `failed` when the cap ended the run. Queued again, it NOTIFYs its kind at commit,
-- as requeue_run does.
UPDATE leasework.runs
   SET status = CASE
           WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
           WHEN coalesce(snoozes, 0) >= %(max_snoozes)s::integer THEN 'failed'
           ELSE 'queued' END,
       queued_at = CASE
           WHEN cancel_requested_at IS NULL AND coalesce(snoozes, 0) < %(max_snoozes)s::integer
           THEN leasework.now() + make_interval(secs => %(after)s)
           ELSE queued_at END,
       finished_at = CASE
           WHEN cancel_requested_at IS NOT NULL OR coalesce(snoozes, 0) >= %(max_snoozes)s::integer
           THEN leasework.now() END,
       attempts = CASE
           WHEN cancel_requested_at IS NULL AND coalesce(snoozes, 0) < %(max_snoozes)s::integer
           THEN attempts - 1 ELSE attempts END,
       snoozes = CASE
           WHEN cancel_requested_at IS NULL AND coalesce(snoozes, 0) < %(max_snoozes)s::integer
           THEN coalesce(snoozes, 0) + 1 ELSE snoozes END,
       result = coalesce(%(result)s::jsonb, result),
       error = CASE
           WHEN cancel_requested_at IS NULL AND coalesce(snoozes, 0) >= %(max_snoozes)s::integer
           THEN %(too_often)s::text ELSE error END,
       lease_owner = NULL,
       lease_expires_at = NULL,
       lease_worker = NULL,
       history = history || jsonb_build_array(CASE
           WHEN cancel_requested_at IS NULL AND coalesce(snoozes, 0) >= %(max_snoozes)s::integer
           THEN leasework.history_entry(
               attempts, lease_owner, lease_worker, started_at, leasework.now(),
               'failed', %(too_often)s::text)
           ELSE leasework.history_entry(
               attempts, lease_owner, lease_worker, started_at, leasework.now(),
               'snoozed', %(reason)s::text)
               || jsonb_build_object('due_at', leasework.now() + make_interval(secs => %(after)s))
           END)
 WHERE id = %(id)s AND lease_owner = %(owner)s
   -- Queued again, its tenant has a queued run (leasework.tenant_queued_run, schema.sql).
   AND (tenant IS NULL OR cancel_requested_at IS NOT NULL
        OR coalesce(snoozes, 0) >= %(max_snoozes)s::integer
        OR leasework.tenant_queued_run(tenant, priority))
RETURNING status, queued_at, coalesce(snoozes, 0) AS snoozes,
          CASE WHEN status = 'queued' THEN pg_notify('leasework', kind) END IS NULL AS quiet

-- name: fail_run
-- A handler's Fail: the run ends `failed` now, whatever attempts are left (no retry), with
-- %(error)s as its error and in its history (outcome `failed`). A cancel requested meanwhile
-- still wins (`cancelled`), as in requeue_run. Owner-scoped: a worker that lost its lease writes
-- nothing.
UPDATE leasework.runs
   SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'failed' END,
       finished_at = leasework.now(),
       result = coalesce(%(result)s::jsonb, result),
       error = %(error)s::text,
       lease_owner = NULL,
       lease_expires_at = NULL,
       lease_worker = NULL,
       history = history || jsonb_build_array(leasework.history_entry(
           attempts, lease_owner, lease_worker, started_at, leasework.now(),
           'failed', %(error)s::text))
 WHERE id = %(id)s AND lease_owner = %(owner)s
RETURNING status

-- name: release_run
-- Shutdown: back to `queued` at once, the attempt not charged, so another worker takes it now.
-- A run whose cancel was requested ends `cancelled` instead. Queued again, it NOTIFYs its kind at
-- commit, as requeue_run does.
UPDATE leasework.runs
   SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END,
       finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN leasework.now() END,
       queued_at = leasework.now(),
       attempts = CASE WHEN cancel_requested_at IS NOT NULL THEN attempts ELSE attempts - 1 END,
       lease_owner = NULL,
       lease_expires_at = NULL,
       lease_worker = NULL,
       history = history || jsonb_build_array(leasework.history_entry(
           attempts, lease_owner, lease_worker, started_at, leasework.now(),
           'released', %(reason)s::text))
 WHERE id = %(id)s AND lease_owner = %(owner)s
   -- Queued again, its tenant has a queued run (leasework.tenant_queued_run, schema.sql).
   AND (tenant IS NULL OR cancel_requested_at IS NOT NULL
        OR leasework.tenant_queued_run(tenant, priority))
RETURNING status,
          CASE WHEN status = 'queued' THEN pg_notify('leasework', kind) END IS NULL AS quiet

-- name: expire_worker_leases
-- The supervisor reaped a dead worker: expire its leases now, so the next poll anywhere reclaims
-- them instead of waiting out the lease. The attempt stays charged and is recorded as a crash.
UPDATE leasework.runs
   SET lease_expires_at = leasework.now() - interval '1 millisecond',
       history = history || jsonb_build_array(leasework.history_entry(
           attempts, lease_owner, lease_worker, started_at, leasework.now(),
           'crashed', %(reason)s::text))
 WHERE lease_worker = %(worker)s AND status = 'running'
RETURNING id

-- name: checkpoint_run
-- Progress (and a renewal). Inside ctx.transaction() this runs on the fenced transaction's
-- connection, so it commits together with the step's effects.
UPDATE leasework.runs
   SET processed_units = %(processed)s,
       total_units = coalesce(%(total)s, total_units),
       lease_expires_at = leasework.now() + make_interval(secs => %(lease)s)
 WHERE id = %(id)s AND lease_owner = %(owner)s AND lease_expires_at > leasework.now()
RETURNING lease_expires_at

-- name: fence_run
-- Opens a fenced transaction: the run must still be ours with a live lease. FOR KEY SHARE is
-- enough to fence: every claim and settle locks with FOR UPDATE ... SKIP LOCKED, which skips this
-- row until we commit, so nobody can take the run while our effects are uncommitted. It does not
-- conflict with the plain UPDATEs of renewal or cancel, so another connection (the keeper's) can
-- still renew while a handler holds a transaction open.
-- That lock is also why the transaction may not sit idle longer than a lease
-- (idle_in_transaction_session_timeout, local to it): a worker cut off with it open (a partition,
-- a process killed while its socket is black-holed) would otherwise keep the run from reclaim
-- until the server noticed the dead peer, by TCP keepalive, hours later. A handler idle that long
-- has stopped renewing and is killed by the watchdog anyway. tests/faults/scenarios.py.
-- plan_cache_mode and enable_seqscan back to the defaults for the handler's own statements, also
-- local: the transaction may run on the main connection, which plans leasework's generically
-- and without sequential scans (workers/connections.py). So are
-- lock_timeout and statement_timeout (%(lock_timeout)s, %(statement_timeout)s: the session's own
-- from before db.bound_waits, or NULL to leave them), set once the row is locked: the fence
-- itself gives up on a row another session holds, as leasework's statements do, but the
-- handler's statements wait and run as they would anywhere else.
WITH fenced AS MATERIALIZED (
    SELECT lease_expires_at
      FROM leasework.runs
     WHERE id = %(id)s AND lease_owner = %(owner)s
       AND lease_expires_at > leasework.now()
       AND set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true) IS NOT NULL
       AND set_config('plan_cache_mode', 'auto', true) IS NOT NULL
       AND set_config('enable_seqscan', 'on', true) IS NOT NULL
       FOR KEY SHARE
)
SELECT lease_expires_at
  FROM fenced
 WHERE set_config('lock_timeout',
                  coalesce(%(lock_timeout)s::text, current_setting('lock_timeout')), true)
       IS NOT NULL
   AND set_config('statement_timeout',
                  coalesce(%(statement_timeout)s::text, current_setting('statement_timeout')),
                  true) IS NOT NULL

-- name: next_due
-- Seconds from now until a run of %(kinds)s may next be claimed or settled without anyone saying
-- so, by what the table holds now: the first queued_at (a delayed run, a retry's backoff; or
-- one due already that the claim did not take, a row another session holds, a tenant held back
-- or a kind at its cap: 0 or less, so the idle worker polls every poll_interval) and the first
-- lease_expires_at still ahead (a run whose worker may be dead: reclaimed, or ended, once it
-- passes). A kind with a rate (leasework.kind_limits) counts its runs due no sooner than its
-- window has room again (leasework.rate_free_at: the kind's, or per tenant the tenant's), so
-- workers idle while every due run is rate-limited sleep until the window frees, rather than
-- poll. NULL: nothing, until something new arrives, which NOTIFYs (enqueue,
-- requeue, release, retry, resume, promotion, the supervisor's fast release, a limit changed).
-- Paused kinds count for nothing (resume NOTIFYs). Read by an idle worker after a claim found
-- nothing, to know how long it may sleep (workers/idle.py). Queued runs per live kind (and per
-- tenant in the turns), through leasework.next_due_at: one look-up per priority present, however
-- many runs are delayed.
WITH live AS MATERIALIZED (
    SELECT ARRAY(SELECT unnest(%(kinds)s::text[]) EXCEPT SELECT kind FROM leasework.paused_kinds) k,
           ARRAY(SELECT l.kind FROM leasework.kind_limits l
                  WHERE l.kind = ANY(%(kinds)s::text[]) AND l.rate_count IS NOT NULL) rated
)
SELECT extract(epoch FROM least(
           (SELECT min(CASE WHEN d.at IS NOT NULL AND k.kind = ANY((SELECT rated FROM live)::text[])
                            THEN greatest(d.at, leasework.rate_free_at(k.kind, NULL))
                            ELSE d.at END)
              FROM unnest((SELECT k FROM live)::text[]) AS k(kind),
                   LATERAL (SELECT leasework.next_due_at(k.kind, NULL) AS at) d),
           (SELECT min(CASE WHEN d.at IS NOT NULL AND k.kind = ANY((SELECT rated FROM live)::text[])
                            THEN greatest(d.at, leasework.rate_free_at(k.kind, t.name))
                            ELSE d.at END)
              FROM leasework.tenants t, unnest((SELECT k FROM live)::text[]) AS k(kind),
                   LATERAL (SELECT leasework.next_due_at(k.kind, t.name) AS at) d
             WHERE t.priority IS NOT NULL),
           (SELECT min(r.lease_expires_at)
              FROM leasework.runs r
             WHERE r.status = 'running' AND r.lease_expires_at > leasework.now()
               AND r.kind = ANY((SELECT k FROM live)::text[]))
       ) - leasework.now())::float8 AS due_in

-- name: db_now
SELECT leasework.now()

-- name: load_steps
-- A handler's durable steps stored so far (ctx.step), read once per attempt at its first step,
-- never at the claim. Not fenced: the values are final (written once, store_step).
SELECT name, value::text FROM leasework.run_steps WHERE run_id = %(id)s

-- name: store_step
-- One durable step's value, written once (the primary key) and only while the run is ours with a
-- live lease. FOR KEY SHARE as fence_run: a claim (FOR UPDATE ... SKIP LOCKED) cannot take the run
-- while this write is uncommitted, and one that took it first leaves this with no row (the owner
-- re-checked on the claimed row), so a later attempt's load_steps sees every step a lost attempt
-- committed. Inside ctx.transaction() it runs on the fenced connection and commits with the
-- step's effects. No row: the run is no longer ours, nothing was written.
WITH owned AS MATERIALIZED (
    SELECT id, attempts
      FROM leasework.runs
     WHERE id = %(id)s AND lease_owner = %(owner)s AND lease_expires_at > leasework.now()
       FOR KEY SHARE
)
INSERT INTO leasework.run_steps (run_id, name, value, attempt, created_at)
SELECT id, %(name)s, %(value)s::jsonb, attempts, leasework.now() FROM owned
RETURNING run_id
