/**
 * What the lease panel shows, as plain data: a pure function of the server's status and `now`
 * (the panel changes the page only where this changes).
 */
import type { IDevice, IStatus } from './api';
import { about, currentWarnings, deviceLabel, mib, statusLine, timeLeft } from './format';
import type { ActionName } from './kinds';

export interface IPanelView {
  title: string;
  info: string;
  devices: { name: string; label: string; util: number | null; utilText: string; mem: number | null; memText: string }[];
  messages: string[];
  buttons: { name: ActionName; label: string; action: string; body: Record<string, unknown> }[];
}

/**
 * The lease in one line: the server's sentence (`summary`) and what changes by the second, e.g.
 * "Lease 0123abcd · tier standard · 1 h 12 min left", "Waiting: position 2 of 5, ~14 min (…)".
 */
export function panelInfo(s: IStatus | null, now: number): string {
  const lease = s?.lease;
  if (!lease) {
    // the end said once: the server's summary of the last lease is its end sentence
    const last = s?.last_lease;
    return (last?.summary ? `Last lease: ${last.summary} ` : 'No GPU lease. ') + 'Ask for one with %gpu request in a notebook.';
  }
  const summary = lease.summary ?? '';
  if (lease.state === 'queued') {
    const q = lease.queue ?? {};
    return summary + (typeof q.eta === 'number' ? `, ${about(q.eta - now)}` : '') + (q.waiting_for ? ` (${q.waiting_for})` : '');
  }
  if (lease.state === 'active') {
    return `${summary} · ` + (typeof lease.expires_at === 'number' ? `${timeLeft(lease.expires_at - now)} left` : 'no time limit');
  }
  return summary;
}

/** The panel's content for a status at `now`. */
export function panelView(s: IStatus | null, now: number): IPanelView {
  const lease = s?.lease;
  const devices = (s?.devices ?? []).map((d: IDevice) => {
    const extra = [
      typeof d.temperature_c === 'number' ? `${Math.round(d.temperature_c)} °C` : '',
      typeof d.power_w === 'number' ? `${Math.round(d.power_w)} W` : ''
    ].filter(Boolean).join(' · ');
    const u = typeof d.utilization_pct === 'number' ? d.utilization_pct : null;
    const used = d.memory_used_mib;
    const total = d.memory_total_mib;
    const name = deviceLabel(d, lease);
    return {
      name,
      label: `${name}${extra ? ` — ${extra}` : ''}`,
      util: u,
      utilText: u === null ? '–' : `${Math.round(u)}%`,
      mem: typeof used === 'number' && typeof total === 'number' && total > 0 ? (100 * used) / total : null,
      memText: `${mib(used)} / ${mib(total)}`
    };
  });
  // everything in full that a notification's one line leaves out: warnings, what became of each kernel, the notices
  const messages = [
    ...(s?.message ? [s.message] : []),
    ...currentWarnings(s, now).map(w => w.message),
    ...(s?.kernels ?? []).map(k => k.message ?? '').filter(Boolean),
    ...(s?.notices ?? []).map(n => n.message).filter(Boolean)
  ];
  // the actions the server offers now (its one action table)
  const buttons = (s?.actions ?? []).map(a => ({ name: a.name, label: a.label, action: a.path, body: a.body }));
  return { title: statusLine(s, now), info: panelInfo(s, now), devices, messages, buttons };
}
