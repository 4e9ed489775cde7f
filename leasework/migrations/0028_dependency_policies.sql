-- Migration 0028: a policy per dependency (README "Workflows"). leasework.set_dependency_policy
-- sets what a parent's failure or cancel means for one child ('cancel' or 'run'), in the
-- transaction that enqueued the child (leasework.written_by_this_transaction says which edges
-- that is); the child's other edges keep the policy of its enqueue (`on_parent_failure`).
-- leasework.enqueue is unchanged. Whoever may add a run to a batch (leasework.join_batch, the
-- enqueue role) may call it. Idempotent: CREATE OR REPLACE, REVOKE and GRANT again.

-- Whether `x`, the xmin of a row this statement sees, is the id of this transaction or of one of
-- its subtransactions (a savepoint's): a row another transaction wrote is seen only once that
-- transaction committed, so a row whose writer is still in progress was written here. The 32-bit
-- id is widened by this transaction's own (`pg_current_xact_id()`): a subtransaction's id is never
-- older, and an id older than it (or a special one, below 3) is another transaction's.
CREATE OR REPLACE FUNCTION leasework.written_by_this_transaction(x xid) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN x::text::bigint >= 3 AND s.ahead < 2147483648
                THEN pg_xact_status((s.top + s.ahead)::text::xid8) = 'in progress'
                ELSE false END
      FROM (SELECT t.top, (x::text::bigint - t.top % 4294967296 + 4294967296) % 4294967296
                       AS ahead
              FROM (SELECT pg_current_xact_id()::text::bigint AS top) t) s
$$;

-- A policy per dependency (README "Workflows"): what the end `failed` or `cancelled` of run
-- `parent` means for run `child`, which waits for it: 'cancel' (the child is cancelled) or 'run'
-- (it runs anyway). The child's other parents keep the policy of its enqueue
-- (`on_parent_failure`). Only in the transaction that enqueued the child, before it commits (the
-- edge must have been written by this transaction): no other session sees the child or its edges
-- until then, so the deps stage, which decides a child from committed edges only, decides it by
-- the policies as set; on a committed child a deps step could be deciding it at that moment by
-- the policy it had read. A child its enqueue decided at once (every parent had ended) is
-- decided again by its edges as they now are: `queued` (its kind notified), or `cancelled` with
-- the error a parent's end gives it; a run cancelled by a cancel request stays so. Refused: an
-- edge of a batch member (a batch's callback counts every member), a run other runs already wait
-- for (they were enqueued by its status: set the policies first). Returns the child's status.
-- SECURITY DEFINER: the enqueue role's way to set it, on runs of its own transaction only.
CREATE OR REPLACE FUNCTION leasework.set_dependency_policy(child bigint, parent bigint,
                                                           policy text)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    edge record;
    run record;
    bad record;
BEGIN
    IF set_dependency_policy.policy IS NULL
       OR set_dependency_policy.policy NOT IN ('cancel', 'run') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'policy must be ''cancel'' or ''run'', got %s',
            coalesce(quote_literal(left(set_dependency_policy.policy, 80)), 'NULL'));
    END IF;
    SELECT d.member, d.xmin AS made INTO edge
      FROM leasework.run_deps d
     WHERE d.child = set_dependency_policy.child AND d.parent = set_dependency_policy.parent;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s does not wait for run %s: a policy is set on a dependency its enqueue made '
            '(after)', set_dependency_policy.child, set_dependency_policy.parent);
    ELSIF edge.member THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s is a member of batch %s, whose callback runs whatever its members'' ends: '
            'a member has no policy', set_dependency_policy.parent, set_dependency_policy.child);
    ELSIF NOT leasework.written_by_this_transaction(edge.made) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'run %s was enqueued by another transaction: a dependency''s policy is set in the '
            'transaction that enqueues its run, before it commits', set_dependency_policy.child);
    END IF;
    SELECT r.id, r.kind, r.status, r.tenant, r.priority, r.cancel_requested_at INTO run
      FROM leasework.runs r WHERE r.id = set_dependency_policy.child FOR UPDATE;
    IF EXISTS (SELECT 1 FROM leasework.run_deps d WHERE d.parent = set_dependency_policy.child) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = format(
            'runs already wait for run %s: set its dependencies'' policies before enqueuing runs '
            'after it', set_dependency_policy.child);
    END IF;
    UPDATE leasework.run_deps d SET anyway = set_dependency_policy.policy = 'run'
     WHERE d.child = set_dependency_policy.child AND d.parent = set_dependency_policy.parent;
    IF run.status IN ('queued', 'cancelled') AND run.cancel_requested_at IS NULL THEN
        SELECT d.parent AS id, p.status INTO bad
          FROM leasework.run_deps d
          JOIN leasework.runs p ON p.id = d.parent
         WHERE d.child = set_dependency_policy.child AND NOT d.anyway
           AND p.status IN ('failed', 'cancelled')
         ORDER BY d.parent LIMIT 1;
        IF bad.id IS NULL AND run.status = 'cancelled' THEN
            UPDATE leasework.runs r SET status = 'queued', finished_at = NULL, error = NULL
             WHERE r.id = run.id;
            IF run.tenant IS NOT NULL THEN
                PERFORM leasework.tenant_queued_run(run.tenant, run.priority);
            END IF;
            PERFORM pg_notify('leasework', run.kind);
            RETURN 'queued';
        ELSIF bad.id IS NOT NULL AND run.status = 'queued' THEN
            UPDATE leasework.runs r
               SET status = 'cancelled', finished_at = leasework.now(),
                   error = format('run %s, which it waited for, ended %s', bad.id, bad.status)
             WHERE r.id = run.id;
            RETURN 'cancelled';
        END IF;
    END IF;
    RETURN run.status;
END
$$;

REVOKE EXECUTE ON FUNCTION leasework.written_by_this_transaction(xid) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION leasework.set_dependency_policy(bigint, bigint, text) FROM PUBLIC;

-- The roles that may join a batch (deploy/roles.sql's enqueue role) may set a policy too.
DO $$
DECLARE
    grantees text;
BEGIN
    SELECT string_agg(DISTINCT quote_ident(r.rolname), ',') INTO grantees
      FROM pg_proc p, aclexplode(p.proacl) a
      JOIN pg_roles r ON r.oid = a.grantee
     WHERE p.oid = to_regprocedure('leasework.join_batch(bigint, bigint)')
       AND a.privilege_type = 'EXECUTE' AND r.oid <> p.proowner;
    IF grantees IS NOT NULL THEN
        EXECUTE 'GRANT EXECUTE ON FUNCTION leasework.set_dependency_policy(bigint, bigint, text) TO '
                || grantees;
    END IF;
END
$$;
