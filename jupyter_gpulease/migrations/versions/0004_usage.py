"""Usage records: one accounting row per granted lease, raw usage samples (per lease and per
kernel, with the notebook's path) pruned after a retention, and roll-ups that are kept: hourly
per lease and kernel, daily per user, group, model and tier.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_leases",
        sa.Column("lease_id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("team", sa.String(255), nullable=False),
        sa.Column("groups", sa.JSON, nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("slice_kind", sa.String(16), nullable=False),
        sa.Column("slice", sa.String(64), nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("fraction", sa.Float, nullable=False),
        sa.Column("mem_mib", sa.Integer, nullable=False),
        sa.Column("asked_s", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("granted_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=True),
        sa.Column("end_state", sa.String(16), nullable=False),
        sa.Column("queue_wait_s", sa.Float, nullable=False),
        sa.Column("held_s", sa.Float, nullable=False),
        sa.Column("held_gpu_s", sa.Float, nullable=False),
        sa.Column("busy_gpu_s", sa.Float, nullable=False),
        sa.Column("mem_peak_mib", sa.Integer, nullable=False),
        sa.Column("reclaims", sa.Integer, nullable=False),
        sa.Column("suspends", sa.Integer, nullable=False),
        sa.Column("preemptions", sa.Integer, nullable=False),
        sa.Column("devices", sa.JSON, nullable=False),
        sa.Column("state", sa.JSON, nullable=False),
    )
    op.create_index("ix_usage_leases_granted_at", "usage_leases", ["granted_at"])
    op.create_index("ix_usage_leases_user", "usage_leases", ["user"])
    op.create_index("ix_usage_leases_ended_at", "usage_leases", ["ended_at"])
    op.create_table(
        "usage_samples",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("kernel", sa.String(64), nullable=False),
        sa.Column("notebook", sa.Text, nullable=False),
        sa.Column("t0", sa.Float, nullable=False),
        sa.Column("t1", sa.Float, nullable=False),
        sa.Column("held_gpu_s", sa.Float, nullable=False),
        sa.Column("busy_gpu_s", sa.Float, nullable=False),
        sa.Column("mem_mib", sa.Integer, nullable=False),
    )
    op.create_index("ix_usage_samples_t1", "usage_samples", ["t1"])
    op.create_index("ix_usage_samples_lease_id", "usage_samples", ["lease_id"])
    op.create_table(
        "usage_hourly",
        sa.Column("hour", sa.Integer, primary_key=True),
        sa.Column("lease_id", sa.String(64), primary_key=True),
        sa.Column("kernel", sa.String(64), primary_key=True),
        sa.Column("notebook", sa.Text, nullable=False),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("team", sa.String(255), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("held_gpu_s", sa.Float, nullable=False),
        sa.Column("busy_gpu_s", sa.Float, nullable=False),
        sa.Column("mem_peak_mib", sa.Integer, nullable=False),
        sqlite_with_rowid=False,  # SQLite keeps the rows in key order: a period's hours are read in one sweep
    )
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("user", sa.String(255), primary_key=True),
        sa.Column("team", sa.String(255), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        sa.Column("tier", sa.String(64), primary_key=True),
        sa.Column("held_gpu_s", sa.Float, nullable=False),
        sa.Column("busy_gpu_s", sa.Float, nullable=False),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("usage_daily")
    op.drop_table("usage_hourly")
    op.drop_index("ix_usage_samples_lease_id", "usage_samples")
    op.drop_index("ix_usage_samples_t1", "usage_samples")
    op.drop_table("usage_samples")
    op.drop_index("ix_usage_leases_ended_at", "usage_leases")
    op.drop_index("ix_usage_leases_user", "usage_leases")
    op.drop_index("ix_usage_leases_granted_at", "usage_leases")
    op.drop_table("usage_leases")
