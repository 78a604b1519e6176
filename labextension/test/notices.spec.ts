/**
 * The lease's notifications through a whole cycle: one per topic, updated in place at each change
 * of state, dismissed when over, each line short enough for JupyterLab (no cut).
 */
import type { IKernel, IStatus } from '../src/api';
import { firstSentence, line, MAX_CHARS, noticesFor } from '../src/notices';
import { INotifications, LeaseNotifier } from '../src/notify';

const NOW = 1_800_000_000;
const ACTIVE = {
  id: '0123456789abcdef', state: 'active' as const, tier: 'standard', expires_at: NOW + 7200, summary: 'Lease 01234567 · tier standard',
  holding: 'L4 ×2', placement: { slices: [{ gpu_uuid: 'GPU-l0', model: 'L4', index: 0, memory_mib: 23034 }] }
};
const RECLAIMED = { id: '0123456789abcdef', state: 'reclaimed' as const, summary: 'Its GPU was reclaimed: idle: no kernel used the GPU for 5 min.' };
const QUEUED = { id: 'fedcba9876543210', state: 'queued' as const, queue: { position: 1, length: 1, eta: NOW + 7000 }, summary: 'Waiting: position 1 of 1' };
const K = 'k1aaaaaaaa-0000';

function status(lease: any, kernels: IKernel[], extra: Partial<IStatus> = {}): IStatus {
  return { now: NOW, lease, last_lease: lease ? null : RECLAIMED, kernels, warnings: [], ...extra };
}

/** JupyterLab's notification manager, as far as the notifier uses it: what is in the notification centre. */
class Centre implements INotifications {
  live = new Map<string, { message: string; type: string; actions: string[] }>();
  emitted = 0;
  updated = 0;
  dismissed = 0;
  private next = 1;

  emit(message: string, type: string, options: any): string {
    const id = `n${this.next++}`;
    this.live.set(id, { message, type, actions: options.actions.map((a: any) => a.label) });
    this.emitted++;
    return id;
  }

  update(args: any): boolean {
    if (!this.live.has(args.id)) {
      return false;
    }
    this.live.set(args.id, { message: args.message, type: args.type, actions: args.actions.map((a: any) => a.label) });
    this.updated++;
    return true;
  }

  dismiss(id: string): void {
    this.dismissed += this.live.delete(id) ? 1 : 0;
  }

  get changes(): number {
    return this.emitted + this.updated + this.dismissed;
  }
}

function rig() {
  const centre = new Centre();
  const host = { status: null as IStatus | null, now: () => NOW, run: jest.fn(), openPanel: jest.fn() };
  const notifier = new LeaseNotifier(host, centre);
  /** one state, seen over several samples: what changed in the centre */
  const see = (s: IStatus) => {
    const before = centre.changes;
    for (let i = 0; i < 3; i++) {
      notifier.update(s);
    }
    return centre.changes - before;
  };
  return { centre, host, notifier, see };
}

function messages(centre: Centre): string[] {
  return [...centre.live.values()].map(n => n.message);
}

describe('one cycle: warned, suspended, waiting, restored', () => {
  it('keeps one notification for the kernel, changed in place at each state, and ends with its GPU back', () => {
    const { centre, see, host } = rig();
    const ok: IKernel = { id: K, state: 'ok' };
    expect(see(status(ACTIVE, [ok]))).toBe(0);
    const warning = { kind: 'reclaim' as const, kernel_id: K, deadline: NOW + 60, reclaim_action: 'suspend',
                      message: 'Kernel k1aaaaaa (python3) has not used its GPU for 1 min: its GPU memory will be moved to host memory (nothing is lost; the next cell waits for a GPU) in 1 min unless it computes again (or you keep the GPU).' };
    expect(see(status(ACTIVE, [ok], { warnings: [warning] }))).toBe(1);
    expect(messages(centre)).toEqual([expect.stringMatching(/^Idle GPU: kernel k1aaaaaa is suspended at \d\d:\d\d unless it computes again\.$/)]);
    expect([...centre.live.values()][0].actions).toEqual(['Keep 1 h', 'Release', 'Details']);
    const suspended: IKernel = { id: K, state: 'suspended', suspended: { memory_mib: 6144, parked: false },
                                 message: 'Kernel k1aaaaaa (python3) was suspended (its GPU sat idle for 2 min): its GPU memory (6144 MiB) is kept in host memory and nothing is lost. Its next cell waits for a GPU, then goes on.' };
    expect(see(status(null, [suspended]))).toBe(1);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa is suspended: its next cell gets a GPU back, its variables kept.']);
    expect([...centre.live.values()][0].actions).toEqual(['Resume', 'Details']);
    const waiting: IKernel = { id: K, state: 'resuming', resume: { stage: 'waiting', position: 1, eta: NOW + 7000 } };
    expect(see(status(QUEUED, [waiting]))).toBe(1);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa waits for a GPU: number 1 in the queue.']);
    expect(see(status(ACTIVE, [{ id: K, state: 'resuming', resume: { stage: 'restoring' } }]))).toBe(1);
    expect(see(status(ACTIVE, [{ id: K, state: 'ok' }]))).toBe(1);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa has its GPU back.']);
    expect([...centre.live.values()][0].type).toBe('success');
    // one notification in the centre, changed five times; nothing cut; nothing else
    expect(centre.emitted).toBe(1);
    expect(centre.live.size).toBe(1);
    expect(see(status(ACTIVE, [{ id: K, state: 'ok' }]))).toBe(0); // still true: it stays until the next change
    expect(host.run).not.toHaveBeenCalled();
  });

  it('says an unused lease went back once, then the kernel that waits for a GPU again', () => {
    const { centre, see } = rig();
    const ok: IKernel = { id: K, state: 'ok' };
    expect(see(status(ACTIVE, [ok], { warnings: [{ kind: 'lease_reclaim', deadline: NOW + 60, message: 'No kernel has used the GPU for 4 min: …' }] }))).toBe(1);
    expect(messages(centre)).toEqual([expect.stringMatching(/^Unused GPU: the lease goes back at \d\d:\d\d unless a kernel uses it\.$/)]);
    const parked: IKernel = { id: K, state: 'suspended', suspended: { memory_mib: null, parked: true } };
    expect(see(status(null, [parked]))).toBe(1);
    expect(messages(centre)).toEqual(['The unused GPU went back to the pool; the next cell you run asks for one again.']);
    // its next cell: the kernel waits (the lease's notification is over); then has its GPU
    expect(see(status(QUEUED, [{ id: K, state: 'resuming', resume: { stage: 'waiting', position: 2 } }]))).toBe(2);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa waits for a GPU: number 2 in the queue.']);
    expect(see(status(ACTIVE, [{ id: K, state: 'ok' }]))).toBe(1);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa has its GPU back.']);
  });

  it('takes a warning away when it stops being true, and shows anew what a click dismissed', () => {
    const { centre, see } = rig();
    const w = { kind: 'reclaim' as const, kernel_id: K, deadline: NOW + 30, message: 'x' };
    see(status(ACTIVE, [{ id: K, state: 'ok' }], { warnings: [w] }));
    expect(centre.live.size).toBe(1);
    see(status(ACTIVE, [{ id: K, state: 'ok' }])); // the kernel computed again
    expect(centre.live.size).toBe(0);
    see(status(ACTIVE, [{ id: K, state: 'ok' }], { warnings: [w] }));
    centre.live.clear(); // a click on one of its buttons dismissed it in JupyterLab
    see(status(ACTIVE, [{ id: K, state: 'ok' }], { warnings: [{ ...w, deadline: NOW + 3600 }] }));
    expect(centre.live.size).toBe(1);
  });
});

describe('what reclaim did to a kernel', () => {
  it('is said once, until its next cell', () => {
    const { centre, see } = rig();
    see(status(ACTIVE, [{ id: K, state: 'ok' }]));
    const msg = 'Kernel k1aaaaaa (python3) was restarted to free its GPU: its GPU sat idle for 2 min. Its variables are gone; run your notebook again.';
    expect(see(status(null, [{ id: K, state: 'ok', execution_state: 'idle', message: msg }]))).toBe(1);
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa (python3) was restarted to free its GPU: its GPU sat idle for 2 min.']);
    // parked afterwards (its lease went back unused): still said
    expect(see(status(null, [{ id: K, state: 'suspended', suspended: { parked: true }, execution_state: 'idle', message: msg }]))).toBe(0);
    expect(see(status(null, [{ id: K, state: 'resuming', resume: { stage: 'waiting', position: 1 }, execution_state: 'busy', message: msg }]))).toBe(1);
    see(status(ACTIVE, [{ id: K, state: 'ok', execution_state: 'idle', message: '' }]));
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa has its GPU back.']);
    // a kernel that runs its next cell on the CPU: the news is over, and not said again
    const other = rig();
    other.see(status(ACTIVE, [{ id: K, state: 'ok', execution_state: 'idle', message: msg }]));
    expect(other.centre.live.size).toBe(1);
    other.see(status(ACTIVE, [{ id: K, state: 'ok', execution_state: 'busy', message: msg }]));
    expect(other.centre.live.size).toBe(0);
    other.see(status(ACTIVE, [{ id: K, state: 'ok', execution_state: 'idle', message: msg }]));
    expect(other.centre.live.size).toBe(0);
  });
});

describe('the lease', () => {
  it('says a grant that came after none or a wait, not one the page found', () => {
    const { centre, see } = rig();
    expect(see(status(ACTIVE, []))).toBe(0); // JupyterLab opened on a lease: nothing new
    const fresh = rig();
    fresh.see({ now: NOW, lease: null, kernels: [] });
    fresh.see(status(QUEUED, []));
    expect(fresh.see(status(ACTIVE, []))).toBe(1);
    expect(messages(fresh.centre)).toEqual(['GPU lease granted: L4 ×2.']);
    expect([...fresh.centre.live.values()][0].type).toBe('success');
    expect(centre.live.size).toBe(0);
  });

  it('says how it ended once, though the broker\'s answer warns of the end too', () => {
    const { centre, see } = rig();
    see(status(ACTIVE, []));
    const revoked = { id: 'L1', state: 'revoked' as const, summary: 'Revoked by admin (admin): GPU maintenance on sim-node-1 at noon.' };
    see({ now: NOW, lease: null, last_lease: revoked, kernels: [], warnings: [{ kind: 'ended', at: NOW, message: revoked.summary }] });
    expect(messages(centre)).toEqual(['GPU lease revoked: Revoked by admin (admin): GPU maintenance on sim-node-1 at noon.']);
  });

  it('says how it ended, unless a kernel of its says so', () => {
    const { centre, see } = rig();
    see(status(ACTIVE, [{ id: K, state: 'ok' }]));
    const revoked = { id: 'L1', state: 'revoked' as const, summary: 'Revoked by admin: GPU maintenance on sim-node-1 at noon.' };
    expect(see({ now: NOW, lease: null, last_lease: revoked, kernels: [{ id: K, state: 'ok' }] })).toBe(1);
    expect(messages(centre)).toEqual(['GPU lease revoked: Revoked by admin: GPU maintenance on sim-node-1 at noon.']);
  });

  it('takes a kernel\'s "GPU back" away when the lease it came back on ends', () => {
    const { centre, see } = rig();
    see(status(QUEUED, [{ id: K, state: 'resuming', resume: { stage: 'waiting', position: 1 } }]));
    see(status(ACTIVE, [{ id: K, state: 'ok' }]));
    expect(messages(centre)).toEqual(['Kernel k1aaaaaa has its GPU back.']);
    see({ now: NOW, lease: null, last_lease: { id: 'L1', state: 'expired', summary: 'It reached the end of its time.' }, kernels: [{ id: K, state: 'ok' }] });
    expect(messages(centre)).toEqual(['GPU lease expired: It reached the end of its time.']);
  });
});

describe('an action\'s outcome', () => {
  it('is news of a moment: a success leaves the centre once its time is over, an error stays', () => {
    const { centre, notifier } = rig();
    let t = 1000;
    notifier.say('Idle reclaim postponed', 'success', () => t);
    notifier.say('Keeping the idle GPU failed: no', 'error', () => t);
    expect(centre.live.size).toBe(2);
    t += 3000;
    notifier.update(status(ACTIVE, []), () => t);
    expect(centre.live.size).toBe(2);
    t += 3000;
    notifier.update(status(ACTIVE, []), () => t);
    expect(messages(centre)).toEqual(['Keeping the idle GPU failed: no']);
  });
});

describe('the broker\'s own warnings', () => {
  it('say their time as `at`, and the status\'s copy of the feed\'s warning is the same state', () => {
    const w = { kind: 'expiring' as const, at: NOW + 3600, message: 'this lease expires in 1 h' };
    const n = noticesFor(status(ACTIVE, [], { warnings: [w] }), NOW).get('lease');
    expect(n?.text).toMatch(/^GPU lease ends at \d\d:\d\d\.$/);
    expect(n?.state).toBe(noticesFor(status(ACTIVE, [], { warnings: [{ ...w, at: undefined, deadline: NOW + 3600 }] }), NOW).get('lease')?.state);
  });
});

describe('the lines', () => {
  it('fit in a notification: a long reason gives way to the panel', () => {
    const long = 'A process 4242 of user bob uses GPU-l0 (L4 #0), which bob does not lease, with 6144 MiB: it is stopped in 10 min unless bob asks for a lease.';
    expect(line('unleased_use_not_stopped', { reason: firstSentence(long) }))
      .toBe('GPU used without a lease: A process 4242 of user bob uses GPU-l0 (L4 #0), which bob does not lease, with 6144 MiB; see the details.');
    expect(line('unleased_use_not_stopped', { reason: long.replace(/[,:]/g, '') + long.replace(/[,:]/g, '') }))
      .toBe('GPU used without a lease: see the details.'); // no clause to cut at
    expect(line('lease_ended', { state: 'preempted', reason: firstSentence("It was preempted for carol's 'production' request. (x)") }))
      .toBe("GPU lease preempted: It was preempted for carol's 'production' request.");
    const all = noticesFor(status(ACTIVE, [{ id: K, state: 'ok' }], {
      warnings: ['expiring', 'preemption', 'share_memory', 'unleased_use', 'gpu_unhealthy', 'maintenance'].map((kind, i) =>
        ({ kind: kind as any, deadline: NOW + 600 + i, kernel_id: kind === 'share_memory' ? K : undefined, message: `${long} ${long}` }))
    }), NOW);
    for (const n of all.values()) {
      expect(n.text.length).toBeLessThanOrEqual(MAX_CHARS);
      expect(n.text).not.toContain('…');
    }
    expect(all.get('lease')?.text).toMatch(/^GPU lease ends at \d\d:\d\d\.$/); // the first due of how the lease ends
    expect(all.get('warning:unleased_use')?.text).toMatch(/^GPU used without a lease: process  is stopped at \d\d:\d\d unless it lets go of the GPU\.$/);
  });

  it('cut a long reason after the last clause that fits, never in the middle', () => {
    const maintenance = 'a maintenance window on your GPU begins in 1 h (BIOS update of the node), before this lease ends: save your work; the lease cannot be extended past it';
    expect(line('maintenance', { reason: firstSentence(maintenance) }))
      .toBe('GPU maintenance ahead: a maintenance window on your GPU begins in 1 h (BIOS update of the node), before this lease ends; see the details.');
    const unhealthy = 'your GPU (0 on sim-node-1) is being drained: GPU has fallen off the bus';
    expect(line('gpu_unhealthy', { reason: firstSentence(unhealthy) })).toBe(`Your GPU is failing or taken out: ${unhealthy}`);
  });
});
