"""Reclaim decisions: which idle kernel is warned, which is acted on, when the lease goes back.

:class:`ReclaimTracker` is plain logic with ``now`` passed in. At every sample the extension
tells it how each kernel uses the GPU (:meth:`ReclaimTracker.observe`) and asks what to do
(:meth:`ReclaimTracker.plan`). The idle predicate and the timeout come from
:mod:`jupyter_gpulease.core.idle`, the same rule the simulator replays.

For a kernel that holds GPU memory and stays GPU-idle, its *deadline* is the start of its idle
period plus the timeout; a ``keep`` postpones it, but never by more than ``max_keep_s``. A
warning goes out ``warn_before_s`` ahead (at most half the timeout), then the kernel is acted on. When no kernel holds GPU
memory, the lease itself has a deadline: the last time any kernel used the GPU (or the grant)
plus the unused lease's timeout (the kernels' unless set apart); the lease goes back then — at
once, after the last kernel's GPU was reclaimed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.idle import gpu_idle

MIN_GAP_S = 10.0  # shorter idle periods are noise between samples, not gaps a user takes


@dataclass(frozen=True)
class KernelUse:
    """How one kernel uses the leased GPU at one sample."""

    kernel_id: str
    executing: bool
    holds_gpu: bool  # holds GPU memory on the leased devices (in device-level mode: may hold)
    sm_util_pct: float | None  # None: unknown


@dataclass
class KernelIdle:
    idle_since: float | None = None
    warned_for: float | None = None  # the deadline a warning went out for
    acted_at: float | None = None
    holds_gpu: bool = False
    had_gpu: bool = False  # held GPU memory at some point in this idle period or before


@dataclass(frozen=True)
class Decision:
    """``warn`` / ``act`` on a kernel, or ``warn_lease`` / ``return_lease``."""

    kind: str
    deadline: float
    idle_s: float
    kernel_id: str = ""


@dataclass
class ReclaimTracker:
    """The idle state of each kernel and of the lease, and the decisions it leads to (timeouts passed in)."""

    threshold_pct: float = 5.0
    reclaim_busy: bool = False
    warn_before_s: float = 300.0
    max_keep_s: float = 0.0
    kernels: dict[str, KernelIdle] = field(default_factory=dict)
    gpu_used_at: float | None = None  # last time any kernel used the GPU (or the lease was granted)
    keep_until: float | None = None
    lease_warned_for: float | None = None

    # ------------------------------------------------------------------ inputs
    def lease_granted(self, now: float) -> None:
        """A new lease: its idle clock starts now."""
        self.gpu_used_at = now
        self.lease_warned_for = None

    def observe(self, now: float, uses: list[KernelUse]) -> list[float]:
        """Record one sample; returns the idle gaps that ended now (seconds), for learning."""
        gaps: list[float] = []
        present = set()
        for u in uses:
            present.add(u.kernel_id)
            k = self.kernels.setdefault(u.kernel_id, KernelIdle())
            idle = gpu_idle(u.sm_util_pct, executing=u.executing, threshold_pct=self.threshold_pct, reclaim_busy=self.reclaim_busy)
            took_memory = u.holds_gpu and not k.holds_gpu  # allocating GPU memory is using the GPU: the idle clock starts again
            k.holds_gpu = u.holds_gpu
            if u.holds_gpu:
                k.had_gpu = True
            if took_memory:
                self.gpu_used_at = now
                k.warned_for = k.acted_at = None
                if idle:
                    k.idle_since = now
            if idle:
                if k.idle_since is None:
                    k.idle_since = now
            else:
                if k.idle_since is not None and k.had_gpu and now - k.idle_since >= MIN_GAP_S:
                    gaps.append(now - k.idle_since)
                k.idle_since = None
                k.warned_for = None
                k.acted_at = None
                if u.holds_gpu or u.executing:
                    self.gpu_used_at = now
        for kid in list(self.kernels):
            if kid not in present:
                del self.kernels[kid]
        return gaps

    def keep(self, now: float, for_s: float) -> float:
        """Postpone reclaim by ``for_s`` seconds from now (within max_keep_s); returns the keep's end."""
        self.keep_until = max(self.keep_until or 0.0, now + for_s)
        for k in self.kernels.values():
            k.warned_for = None
        self.lease_warned_for = None
        return self.keep_until

    def end_keep(self) -> None:
        """No keep in force any more: the deadlines are the idle periods' own (warned again before)."""
        self.keep_until = None
        for k in self.kernels.values():
            k.warned_for = None
        self.lease_warned_for = None

    # ------------------------------------------------------------------ decisions
    def _postponed(self, base: float) -> float:
        if self.keep_until is not None and self.keep_until > base:
            return min(self.keep_until, base + self.max_keep_s)
        return base

    def kernel_deadline(self, kernel_id: str, timeout_s: float | None) -> float | None:
        k = self.kernels.get(kernel_id)
        if timeout_s is None or k is None or k.idle_since is None or not k.holds_gpu:
            return None
        return self._postponed(k.idle_since + timeout_s)

    def lease_deadline(self, timeout_s: float | None) -> float | None:
        if timeout_s is None or self.gpu_used_at is None or any(k.holds_gpu for k in self.kernels.values()):
            return None
        return self._postponed(self.gpu_used_at + timeout_s)

    def plan(self, now: float, timeout_s: float | None, *, lease_active: bool, lease_timeout_s: float | None = None) -> list[Decision]:
        """What is due at ``now``: kernels idle for ``timeout_s``, the lease unused for
        ``lease_timeout_s`` (None: ``timeout_s``)."""
        out: list[Decision] = []
        if not lease_active or timeout_s is None:
            return out
        # the warning goes out warn_before_s ahead, but not before half the timeout: a short (learnt)
        # timeout must not warn as soon as a kernel falls idle
        warn_s = min(self.warn_before_s, timeout_s / 2)
        for kid, k in self.kernels.items():
            deadline = self.kernel_deadline(kid, timeout_s)
            if deadline is None or k.acted_at is not None:
                continue
            idle_s = now - (k.idle_since or now)
            if now >= deadline:
                k.acted_at = now
                out.append(Decision("act", deadline, idle_s, kid))
            elif now >= deadline - warn_s and k.warned_for != deadline:
                k.warned_for = deadline
                out.append(Decision("warn", deadline, idle_s, kid))
        lease_timeout_s = timeout_s if lease_timeout_s is None else lease_timeout_s
        warn_s = min(self.warn_before_s, lease_timeout_s / 2)
        deadline = self.lease_deadline(lease_timeout_s)
        if deadline is not None:
            idle_s = now - (self.gpu_used_at or now)
            if now >= deadline:
                out.append(Decision("return_lease", deadline, idle_s))
            elif now >= deadline - warn_s and self.lease_warned_for != deadline:
                self.lease_warned_for = deadline
                out.append(Decision("warn_lease", deadline, idle_s))
        return out
