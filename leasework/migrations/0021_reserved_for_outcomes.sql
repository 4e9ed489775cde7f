-- Migration 0021: a placeholder on branch `windows` only. Issue 31 gave 0021 to the `outcomes`
-- branch (Fail and Snooze) and 0022 to this one, and migrations must be numbered without a gap
-- (db.migrations). At merge: drop this file when 0021 lands from `outcomes`, or, if it does not,
-- drop it and rename 0022_unique_windows_and_debounce.sql to 0021_... . Changes nothing.
SELECT 1;
