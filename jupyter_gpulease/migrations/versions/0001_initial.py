"""The schema of the first releases: leases and their events.

Databases made before migrations existed have exactly these tables and no version table; the
store stamps them with this revision and upgrades from here.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("server", sa.String(255), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("granted_at", sa.Float, nullable=True),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("ended_at", sa.Float, nullable=True),
        sa.Column("end_reason", sa.Text, nullable=False),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("placement", sa.JSON, nullable=True),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_leases_user", "leases", ["user"])
    op.create_index("ix_leases_state", "leases", ["state"])
    op.create_index("ix_leases_ended_at", "leases", ["ended_at"])
    op.create_table(
        "lease_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=False),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_lease_events_lease_id", "lease_events", ["lease_id"])


def downgrade() -> None:
    op.drop_table("lease_events")
    op.drop_table("leases")
