-- Migration 0019: labels (key, tenant, group) refuse C1 controls, bidi controls and the line and
-- paragraph separators besides C0 controls and DEL, as project names and ZIP member names do
-- (one rule: leasework/text.py), and the refusal names the character. Rows already holding
-- such a label are left as they are: every reader shows them escaped. CREATE OR REPLACE keeps
-- the function's owner and grants. Idempotent.

CREATE OR REPLACE FUNCTION leasework.label_problem(value text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN value IS NULL THEN NULL
        WHEN length(value) NOT BETWEEN 1 AND 200 THEN 'must be 1-200 characters long'
        WHEN value ~ '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]'
        THEN 'contains control characters (U+' || lpad(upper(to_hex(ascii(substring(value FROM
            '[\x01-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]')))), 4, '0')
            || '; no C0/C1 control, DEL, bidi control or line separator is allowed)'
    END;
$$;
