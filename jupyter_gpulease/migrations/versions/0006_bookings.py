"""Bookings: GPUs reserved ahead for a user, a group or a list of users (who, from–to, the
request, the GPUs it was placed on, its state and why it ended, what is wrong with it, when it
was first used, who booked it and when, what it is for).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bookings",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("users", sa.JSON, nullable=False),  # user names
        sa.Column("groups", sa.JSON, nullable=False),  # group names
        sa.Column("start", sa.Float, nullable=False),
        sa.Column("end", sa.Float, nullable=False, index=True),
        sa.Column("request", sa.JSON, nullable=False),  # as a lease's request
        sa.Column("slices", sa.JSON, nullable=False),  # where it was placed
        sa.Column("state", sa.String(16), nullable=False, index=True),  # accepted | active | ended
        sa.Column("reason", sa.Text, nullable=False),  # why it ended
        sa.Column("problem", sa.Text, nullable=False),  # what is wrong with it while it lasts
        sa.Column("used_at", sa.Float, nullable=True),
        sa.Column("grace_s", sa.Float, nullable=False),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("title", sa.Text, nullable=False),
    )
    op.create_index("ix_bookings_start", "bookings", ["start"])


def downgrade() -> None:
    op.drop_index("ix_bookings_start", table_name="bookings")
    op.drop_table("bookings")
