"""Events: an index on time (pruning by age) and the idempotency key of the call behind each
event (a client that retries a call after losing the answer gets the first call's result).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("lease_events") as batch:
        batch.add_column(sa.Column("request_key", sa.String(80), nullable=True))
    op.create_index("ix_lease_events_time", "lease_events", ["time"])
    op.create_index("ix_lease_events_request_key", "lease_events", ["request_key"])


def downgrade() -> None:
    op.drop_index("ix_lease_events_request_key", "lease_events")
    op.drop_index("ix_lease_events_time", "lease_events")
    with op.batch_alter_table("lease_events") as batch:
        batch.drop_column("request_key")
