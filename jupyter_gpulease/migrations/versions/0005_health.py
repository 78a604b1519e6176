"""GPU health and maintenance: cordons (a device or a node kept out of new grants, drained or
not, with the reason users read, who and since when, whether an admin holds it out) and
maintenance windows (devices or nodes, from–to, reason).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_cordons",
        sa.Column("target", sa.String(300), primary_key=True),  # "device:<GPU uuid>" or "node:<name>"
        sa.Column("mode", sa.String(32), nullable=False),  # cordon | drain | drain_when_idle
        sa.Column("source", sa.String(16), nullable=False),  # admin | health
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("since", sa.Float, nullable=False),
        sa.Column("hold", sa.Boolean, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),  # findings, resets seen at the cordon, healthy since
    )
    op.create_table(
        "maintenance_windows",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("start", sa.Float, nullable=False, index=True),
        sa.Column("end", sa.Float, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("devices", sa.JSON, nullable=False),
        sa.Column("nodes", sa.JSON, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("maintenance_windows")
    op.drop_table("device_cordons")
