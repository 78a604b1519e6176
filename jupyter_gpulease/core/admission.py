"""Admission: what a request may ask for, and how far a lease may be extended, under the policy.

Checked once, before anything is queued or moved, each failure with a message a person can act
on and the field at fault: BadRequest (out of range), Forbidden (a tier the user may not use),
Refused (can never be granted here, over a hard quota, or past a tier's limits), Conflict (the
lease's state, or a lease waiting for its GPU, forbids it now; no field is at fault),
TooManyQueued (the user has ``max_queued_per_user`` requests waiting already; no field is at fault).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .model import BadRequest, Conflict, Forbidden, Lease, Refused, TooManyQueued
from .policy import Policy, Tier
from .pool import Pool
from .quota import Quotas
from .request import Ask
from .text import format_duration


def check_ask(ask: Ask, now: float, *, policy: Policy, pool: Pool, quotas: Quotas, leases: Mapping[str, Lease], queued: int = 0) -> tuple[Tier, float]:
    """The tier and duration ``ask`` gets, or the error that says what to change. ``queued``:
    how many requests ``ask.user`` has waiting now."""
    tname = ask.tier or policy.default_tier
    # only the tiers this user may use are named: the others are none of their business
    allowed = sorted(n for n, x in policy.tiers.items() if x.allows(ask.user, ask.groups))
    if tname not in policy.tiers:
        raise BadRequest(f"unknown tier {tname!r}; tiers open to {ask.user}: {', '.join(allowed) or 'none'}", field="tier")
    t = policy.tiers[tname]
    if not t.allows(ask.user, ask.groups):
        raise Forbidden(f"{ask.user} may not use tier {tname!r}; tiers open to {ask.user}: {', '.join(allowed) or 'none'}", field="tier")
    duration_s = t.default_duration_s if ask.duration_s is None else ask.duration_s
    fld = ask.duration_field
    if duration_s > t.max_duration_s:
        raise BadRequest(
            f"a duration of {format_duration(duration_s)} is over the {format_duration(t.max_duration_s)} limit of tier {tname!r}; "
            f"ask for at most {format_duration(t.max_duration_s)}",
            field=fld,
        )
    if duration_s < policy.min_duration_s:
        raise BadRequest(
            f"a duration of {format_duration(duration_s)} is under the minimum lease length of {format_duration(policy.min_duration_s)}; "
            f"ask for at least {format_duration(policy.min_duration_s)}",
            field=fld,
        )
    never = pool.why_never(ask.request)
    if never is None and ask.require_gpus:
        never = pool.why_never_on(ask.request, frozenset(ask.require_gpus))
    if never:
        raise Refused(f"this request can never be granted: {never[1]}", field=never[0])
    quotas.check_hard(ask.user, ask.groups, pool.gpu_milli_of(ask.request), duration_s, now, leases, field=fld)
    cap = policy.max_queued_per_user
    if cap is not None and queued >= cap:
        raise TooManyQueued(
            f"{ask.user} has {queued} request{'s' if queued != 1 else ''} waiting in the queue, the most max_queued_per_user ({cap}) allows; "
            "withdraw one, or wait until one starts, before asking for more"
        )
    return t, float(duration_s)


def lease_for(ask: Ask, tier: Tier, duration_s: float, now: float, lease_id: str) -> Lease:
    """The lease an admitted ask becomes, queued but not yet submitted."""
    return Lease(
        id=lease_id, user=ask.user, request=ask.request, tier=tier.name, duration_s=duration_s, created_at=now, server=ask.server,
        groups=ask.groups, max_wait_s=ask.max_wait_s, prefer_gpus=ask.prefer_gpus, require_gpus=ask.require_gpus, meta=dict(ask.meta),
    )  # fmt: skip


def check_extension(lease: Lease, new: float, now: float, fld: str, *, policy: Policy, quotas: Quotas, waiters: list[Lease], aged_cutoff: Callable[[], float | None]) -> None:
    """May ``lease`` run until ``new``? ``waiters``: the waiting leases promised its devices."""
    if new <= lease.expires_at:
        raise BadRequest(f"the new expiry must be later than the current one ({format_duration(lease.expires_at - now)} from now)", field=fld)
    if lease.preempt_at is not None:
        raise Conflict(f"lease {lease.id} is being preempted (ends in {format_duration(lease.preempt_at - now)}); it cannot be extended")
    t = policy.tier(lease.tier)
    if new - now > t.max_duration_s + 1e-6:
        raise Refused(
            f"tier {t.name!r} allows at most {format_duration(t.max_duration_s)} ahead; you can extend until {format_duration(t.max_duration_s)} from now",
            field=fld,
        )
    if t.max_lifetime_s is not None and new - lease.granted_at > t.max_lifetime_s + 1e-6:
        raise Refused(
            f"tier {t.name!r} caps a lease at {format_duration(t.max_lifetime_s)} in all; this one may run until {format_duration(lease.granted_at + t.max_lifetime_s - now)} from now",
            field=fld,
        )
    if not policy.extend_when_contended:
        for waiter in waiters:
            if outranks(waiter, t, policy, aged_cutoff):
                # the request is fine; the pool's state refuses it now (409, no field at fault)
                raise Conflict(
                    f"lease {lease.id} cannot be extended now: {'someone' if waiter.user != lease.user else 'your other lease'} is waiting for this GPU "
                    f"(queued {format_duration(now - waiter.created_at)} ago, tier {waiter.tier}); it ends as planned, release it when you are done"
                )
    quotas.check_extension(lease, new, now, fld)


def outranks(waiter: Lease, holder_tier: Tier, policy: Policy, aged_cutoff: Callable[[], float | None]) -> bool:
    """May ``waiter`` stand in the way of extending a lease of ``holder_tier``?

    A waiter of the same or a higher tier may; one of a lower tier only once it has aged, so
    that a stream of best-effort requests cannot cut production work short, yet nothing waits
    forever behind leases that keep extending.
    """
    wt = policy.tiers.get(waiter.tier)
    if wt is None or wt.priority >= holder_tier.priority:
        return True
    cutoff = aged_cutoff()
    return cutoff is not None and waiter.created_at <= cutoff
