-- Migration 0033: runs without a tenant are one more participant in the turns (issue 29, a fair
-- share: docs/concepts.md, "Turns"). They met the tenants' picks by (priority, queued_at), so a
-- backlog of runs without a tenant, older than a tenant's new run, was drained before it.
-- claim_runs (leases/lease.sql) now gives them a turn of their own, kept here, and orders its
-- candidates by (priority, turn, queued_at, id). Self-contained and idempotent: CREATE ... IF NOT
-- EXISTS, ON CONFLICT DO NOTHING, CREATE OR REPLACE.

-- Runs without a tenant take turns with the tenants as one more participant (migration 0033;
-- docs/concepts.md, "Turns"): their weight and their turn, one row. claim_runs reads and locks it
-- only while tenants' picks compete with runs without a tenant in one statement (SKIP LOCKED: a
-- claim never waits for it), and leasework.untenanted_served advances it by the runs it took.
CREATE TABLE IF NOT EXISTS leasework.untenanted_turn (
    one    boolean PRIMARY KEY DEFAULT true CONSTRAINT untenanted_turn_one CHECK (one),
    weight double precision NOT NULL DEFAULT 1
           CONSTRAINT untenanted_turn_weight_valid CHECK (weight >= 0.001 AND weight <= 1000),
    turn   double precision NOT NULL DEFAULT 0
);
INSERT INTO leasework.untenanted_turn DEFAULT VALUES ON CONFLICT DO NOTHING;

-- Called by claim_runs when it took `taken` runs without a tenant while tenants competed, holding
-- the row's lock (its `contest`): their turn moves on from `base` (their turn, never behind the
-- first tenant's pick) by taken / weight.
CREATE OR REPLACE FUNCTION leasework.untenanted_served(base double precision, taken bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE leasework.untenanted_turn u
       SET turn = untenanted_served.base + untenanted_served.taken / u.weight;
    RETURN true;
END
$$;
