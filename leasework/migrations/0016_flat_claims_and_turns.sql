-- Migration 0016: the flat claims and tenants' turns, on the branch that makes them (issue 29,
-- items 1 and 2); this file only holds its number here and is replaced by that one.
SELECT 1;
