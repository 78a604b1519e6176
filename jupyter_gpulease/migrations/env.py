"""Alembic environment of the lease store. The store runs it with its own connection
(``config.attributes["connection"]``); there is no alembic.ini."""

from alembic import context

from jupyter_gpulease.store import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through jupyter_gpulease.store.LeaseStore.upgrade()")
# render_as_batch: SQLite alters a table by copying it
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
