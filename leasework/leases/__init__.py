"""The lease data layer: the owner-scoped statements and the claim types (`lease.py`,
`lease.sql`), the only writer of lease columns, and the libpq fast path they send the
one-at-a-time hot statement through (`wire.py`). Imports no worker, stage or family."""
