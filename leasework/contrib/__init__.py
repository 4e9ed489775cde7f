"""Integrations with other libraries' transactions (optional extras): `leasework.contrib.
sqlalchemy` (SQLAlchemy 2, sync and asyncio, psycopg driver) and `leasework.contrib.django`
(Django's psycopg 3 backend). Each hands the ORM's own psycopg connection to App.enqueue, so the
run commits and rolls back with the ORM's transaction. Imported only by the user's code."""
