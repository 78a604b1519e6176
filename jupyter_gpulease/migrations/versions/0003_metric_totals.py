"""Metric totals: the running totals of the broker's Prometheus counters, written in the same
transaction as the events they count, so that the broker that takes over (a restart, the
standby) continues every counter instead of starting it from zero.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "metric_totals",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("labels", sa.String(512), primary_key=True),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("metric_totals")
