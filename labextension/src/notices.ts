/**
 * Which notifications the lease's state calls for: a pure function of the server's status, `now`
 * and the notifications shown before (a kernel that was suspended and runs again "has its GPU
 * back"). One notification per topic (each kernel, the lease), whose line says the state the topic
 * is in: a new state updates it in place, a state that is over takes it away. The line is short
 * enough for JupyterLab (it cuts a notification after 140 characters); the rest is in the panel.
 */
import type { IKernel, IStatus, IWarning } from './api';
import { currentWarnings, hhmm } from './format';
import { ActionName, NOTIFICATION_LINES, RECLAIM_PARTICIPLES, WARNING_ACTIONS } from './kinds';

/** JupyterLab cuts a notification's message after this many characters. */
export const MAX_CHARS = 140;

export type NoticeType = 'info' | 'success' | 'warning' | 'error';

/** One notification as the state calls for it. */
export interface INotice {
  topic: string; // 'kernel:<id>', 'lease' or 'warning:<kind>' (the GPU's health, maintenance, unleased use)
  state: string; // the state it says: a new state is a new line (e.g. 'suspended', 'waiting:2', 'warning:reclaim:<deadline>')
  type: NoticeType;
  text: string;
  actions: ActionName[]; // from the action table; every notification also has "Details" (the panel)
  kernelId?: string; // whose resume the Resume action asks for
  autoClose: number | false;
}

const FOR_A_WHILE = 8000; // ms a piece of good news stays on screen (it stays in the notification centre)
const LEFT_IDLE = ['suspended', 'asking', 'restoring']; // a kernel in these states (or waiting) has no GPU yet
const LEASE_ENDS: string[] = ['expiring', 'preemption', 'lease_reclaim']; // warnings of how the lease ends

/**
 * A line of NOTIFICATION_LINES filled in. A {reason} that would make it too long is cut after the
 * last clause that fits ("…, before this lease ends: …" -> "…; see the details."), or said to be in
 * the details: the line is never cut by JupyterLab.
 */
export function line(key: string, fill: Record<string, string>): string {
  const template = NOTIFICATION_LINES[key] ?? NOTIFICATION_LINES.warning;
  const make = (f: Record<string, string>) => template.replace(/\{(\w+)\}/g, (_, name: string) => f[name] ?? '');
  const text = make(fill);
  if (text.length <= MAX_CHARS || !('reason' in fill)) {
    return text;
  }
  const reason = fill.reason;
  const cuts: number[] = [];
  for (let i = reason.length - 2; i > 0; i--) {
    if (',:;'.includes(reason[i]) && reason[i + 1] === ' ') {
      cuts.push(i); // clause ends, last first
    }
  }
  for (const at of cuts) {
    const shorter = make({ ...fill, reason: `${reason.slice(0, at)}; see the details.` });
    if (shorter.length <= MAX_CHARS) {
      return shorter;
    }
  }
  return make({ ...fill, reason: 'see the details.' });
}

/** A message's first sentence (up to the first '.', '!' or '?' followed by a space or the end). */
export function firstSentence(message: string | undefined): string {
  const m = /^(.*?[.!?])(\s|$)/.exec((message ?? '').trim());
  return m ? m[1] : (message ?? '').trim();
}

function at(deadline: number | null | undefined): string {
  return typeof deadline === 'number' ? hhmm(deadline) : 'soon';
}

/** The warning that comes first (the earliest deadline), of those given. */
function firstDue(warnings: IWarning[]): IWarning | undefined {
  return [...warnings].sort((a, b) => (a.deadline ?? Infinity) - (b.deadline ?? Infinity))[0];
}

function warningNotice(topic: string, w: IWarning, kernel: string): INotice {
  const key = w.kind === 'unleased_use' && typeof w.deadline !== 'number' ? 'unleased_use_not_stopped' : w.kind;
  const text = line(key, {
    kernel,
    at: at(w.deadline ?? w.at), // (the broker's own warnings say when as `at`)
    action: RECLAIM_PARTICIPLES[w.reclaim_action ?? ''] ?? RECLAIM_PARTICIPLES.suspend,
    pid: String(w.pid ?? ''),
    reason: firstSentence(w.message)
  });
  return { topic, state: `warning:${w.kind}:${w.deadline ?? w.at ?? ''}`, type: 'warning', text, actions: WARNING_ACTIONS[w.kind] ?? [], autoClose: false };
}

/**
 * A kernel's notification: its idle warning, its suspend, its wait for a GPU, its GPU back, or what
 * reclaim did to it (restarted, shut down, …) until its next cell. `over`: states already said and done.
 */
function kernelNotice(k: IKernel, warnings: IWarning[], before: INotice | undefined, leaseActive: boolean,
                      over: ReadonlySet<string>): INotice | null {
  const topic = `kernel:${k.id}`;
  const kernel = k.id.slice(0, 8);
  const notice = (state: string, type: NoticeType, text: string, actions: ActionName[] = [], autoClose: number | false = false): INotice =>
    ({ topic, state, type, text, actions, kernelId: k.id, autoClose });
  if (k.state === 'suspended' && !k.suspended?.parked) {
    return notice('suspended', 'warning', line('suspended', { kernel }), ['resume']);
  }
  if (k.state === 'resuming') {
    const r = k.resume ?? {};
    if (r.stage === 'restoring') {
      return notice('restoring', 'info', line('restoring', { kernel }));
    }
    return typeof r.position === 'number'
      ? notice(`waiting:${r.position}`, 'info', line('waiting', { kernel, position: String(r.position) }))
      : notice('asking', 'info', line('asking', { kernel }));
  }
  const w = firstDue(warnings);
  if (w) {
    return { ...warningNotice(topic, w, kernel), kernelId: k.id };
  }
  const was = before?.state ?? '';
  if (LEFT_IDLE.includes(was) || was.startsWith('waiting')) {
    return k.message // a resume that did not work: the kernel runs on, and says why
      ? notice('not_back', 'error', line('not_back', { kernel, reason: firstSentence(k.message.replace(/^Kernel \S+( \([^)]*\))? /, '')) }))
      : notice('back', 'success', line('back', { kernel }), [], FOR_A_WHILE);
  }
  // still true, it stays (the next change updates it): the GPU back while the lease holds, or a GPU it could not get
  if ((was === 'back' && leaseActive) || (was === 'not_back' && !leaseActive)) {
    return before!;
  }
  // what reclaim did to it (a parked kernel's lease's notification says the rest): said until its next cell
  const acted = `acted:${k.message ?? ''}`;
  if (!k.message || over.has(`${topic}|${acted}`) || (was === acted && k.execution_state === 'busy')) {
    return null;
  }
  const said = firstSentence(k.message);
  return notice(acted, 'warning', said.length <= MAX_CHARS ? said : line('not_back', { kernel, reason: 'see the details.' }));
}

/**
 * The lease's notification: a warning of how it ends, then its end (unless a kernel's says it), a
 * grant (unless a kernel's resume got it). `was`: the lease's state at the status before (undefined: none seen yet).
 */
function leaseNotice(s: IStatus, warnings: IWarning[], before: INotice | undefined, wasLease: string | null | undefined,
                     kernelsSay: INotice[]): INotice | null {
  const topic = 'lease';
  const w = firstDue(warnings);
  if (w) {
    return warningNotice(topic, w, ''); // how the lease will end: the end itself takes its place
  }
  const kernels = s.kernels ?? [];
  const busy = kernels.some(k => k.state === 'resuming' || (k.state === 'suspended' && !k.suspended?.parked))
    || kernelsSay.some(n => n.state === 'back' || n.state.startsWith('acted:'));
  const lease = s.lease;
  const last = s.last_lease;
  if (!lease && last && ['expired', 'preempted', 'revoked', 'failed', 'reclaimed'].includes(last.state)) {
    if (busy) {
      return null; // the kernels' notifications say what became of them
    }
    if (last.state === 'reclaimed') {
      return { topic, state: 'given_back', type: 'info', text: line('given_back', {}), actions: [], autoClose: false };
    }
    const text = line('lease_ended', { state: last.state, reason: firstSentence(last.summary ?? last.end_message ?? '') || 'see the details.' });
    return { topic, state: `ended:${last.state}`, type: 'warning', text, actions: [], autoClose: false };
  }
  const was = before?.state ?? '';
  if (lease?.state !== 'active' || busy) {
    return null; // (a kernel's resume gets the lease: its notification says so)
  }
  if (was === 'granted') {
    return before!; // still true: it stays until the next change
  }
  if (wasLease !== undefined && wasLease !== 'active') {
    return { topic, state: 'granted', type: 'success', text: line('granted', { holding: lease.holding || 'a GPU' }), actions: [], autoClose: FOR_A_WHILE };
  }
  return null;
}

/**
 * The notifications the status calls for, by topic (see the module). `before`: those shown;
 * `wasLease`: the lease's state in the status before (null: none; undefined: this is the first);
 * `over`: what a topic said that is done with ('<topic>|<state>'), not to be said again.
 */
export function noticesFor(s: IStatus | null, now: number, before: ReadonlyMap<string, INotice> = new Map(),
                           wasLease?: string | null, over: ReadonlySet<string> = new Set()): Map<string, INotice> {
  const out = new Map<string, INotice>();
  if (!s) {
    return new Map(before);
  }
  const warnings = currentWarnings(s, now);
  const kernels = s.kernels ?? [];
  for (const k of kernels) {
    const n = kernelNotice(k, warnings.filter(w => w.kernel_id === k.id), before.get(`kernel:${k.id}`), s.lease?.state === 'active', over);
    if (n) {
      out.set(n.topic, n);
    }
  }
  // warnings of how the lease ends go with the lease's notification; the others (its GPU's health, a
  // maintenance window, unleased use, a kernel this server does not list) have one each, by kind
  // (the broker's `ended` warning: the lease's notification says the end, from the last lease)
  const leaseWide = warnings.filter(w => w.kind !== 'ended' && (!w.kernel_id || !kernels.some(k => k.id === w.kernel_id)));
  for (const w of leaseWide.filter(w => !LEASE_ENDS.includes(w.kind))) {
    const topic = `warning:${w.kind}`;
    if (!out.has(topic)) {
      out.set(topic, warningNotice(topic, w, ''));
    }
  }
  const n = leaseNotice(s, leaseWide.filter(w => LEASE_ENDS.includes(w.kind)), before.get('lease'), wasLease, [...out.values()]);
  if (n) {
    out.set(n.topic, n);
  }
  return out;
}
