/**
 * Words and numbers for the status bar and the panel: pure functions of the server's status JSON.
 *
 * The lease's sentences come from the server (`summary`, `queue_words`, `holding`: the one lease
 * view's words); what is formatted here is what changes every second: the countdown, an ETA.
 */
import type { IDevice, ILease, IStatus, IWarning } from './api';
import { WARNING_TITLE_DEFAULT, WARNING_TITLES } from './kinds';

/**
 * What is left, rounded down to the unit shown, as the server words it (format_time_left):
 * "1 h 12 min", "2 h", "14 min", "40 s", "3 d 4 h" (never "1:12", which reads as minutes).
 */
export function timeLeft(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s >= 48 * 3600) {
    const h = Math.floor(s / 3600);
    return h % 24 ? `${Math.floor(h / 24)} d ${h % 24} h` : `${h / 24} d`;
  }
  if (s >= 3600) {
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    return m ? `${h} h ${m} min` : `${h} h`;
  }
  if (s >= 60) {
    return `${Math.floor(s / 60)} min`;
  }
  return `${s} s`;
}

/** Seconds -> "~14 min", "~1 h 5 min" for waits. */
export function about(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return 'any moment';
  }
  const m = Math.round(s / 60);
  if (m < 60) {
    return `~${m} min`;
  }
  const h = Math.floor(m / 60);
  const rest = m % 60;
  return rest ? `~${h} h ${rest} min` : `~${h} h`;
}

/** Epoch seconds -> "14:05" (local time): the minute in which `t` falls ("at 14:05"). */
export function hhmm(t: number): string {
  const d = new Date(t * 1000);
  return `${d.getHours().toString().padStart(2, '0')}:${d.getMinutes().toString().padStart(2, '0')}`;
}

/** Epoch seconds -> the first minute at which `t` has passed (14:05:56 -> "14:06"): "by 14:06" never reads earlier than it comes. */
export function hhmmBy(t: number): string {
  return hhmm(Math.ceil(t / 60) * 60);
}

/** ' (or by 14:06 if idle GPUs go back)': the GPUs a wait is for sit idle and go back by then; '' otherwise. */
function sooner(at: number | null | undefined, now: number): string {
  return typeof at === 'number' && at > now ? ` (or by ${hhmmBy(at)} if idle GPUs go back)` : '';
}

/** Mean utilization over the lease's devices, or null when none reports it. */
export function utilization(devices: IDevice[]): number | null {
  const vals = devices.map(d => d.utilization_pct).filter((v): v is number => typeof v === 'number');
  if (!vals.length) {
    return null;
  }
  return vals.reduce((a, b) => a + b, 0) / vals.length;
}

/** True when a kernel of this server is suspended (its GPU memory put aside while idle). */
export function suspended(status: IStatus): boolean {
  return (status.kernels ?? []).some(k => k.state === 'suspended' || k.state === 'resuming'); // put aside
}

/**
 * The status bar's one line:
 *   "GPU A100 ×1 · 63% · 1 h 12 min left", "GPU queue #3 · ~14 min", "GPU suspended · resumes on next cell",
 *   "GPU resuming · queue #1 · ~20 min".
 */
export function statusLine(status: IStatus | null, now: number): string {
  if (!status) {
    return 'GPU …';
  }
  const lease = status.lease;
  const resuming = (status.kernels ?? []).find(k => k.state === 'resuming');
  if (resuming) {
    const r = resuming.resume ?? {};
    if (r.stage === 'restoring') {
      return 'GPU resuming · restoring';
    }
    const pos = typeof r.position === 'number' ? ` · queue #${r.position}` : ' · asking for a GPU';
    const eta = typeof r.eta === 'number' ? ` · ${about(r.eta - now)}` : '';
    return `GPU resuming${pos}${eta}${sooner(r.may_start_sooner_at, now)}`;
  }
  if (suspended(status)) {
    return 'GPU suspended · resumes on next cell';
  }
  if (!lease) {
    return 'GPU none';
  }
  if (lease.state === 'queued') {
    const q = lease.queue ?? {};
    const pos = q.position !== undefined && q.position !== null ? `#${q.position}` : '';
    const eta = typeof q.eta === 'number' ? ` · ${about(q.eta - now)}` : '';
    return `GPU queue ${pos}${eta}${sooner(q.may_start_sooner_at, now)}`.replace(/\s+$/, '');
  }
  if (lease.state === 'active') {
    const parts = [`GPU ${lease.holding ?? ''}`.trim()];
    const u = utilization(status.devices ?? []);
    if (u !== null) {
      parts.push(`${Math.round(u)}%`);
    }
    if (typeof lease.expires_at === 'number') {
      parts.push(`${timeLeft(lease.expires_at - now)} left`);
    }
    return parts.join(' · ');
  }
  return `GPU ${lease.state}`;
}

/** The warning's kind in a few words, for a notification's title line (the server's table, kinds.ts). */
export function warningTitle(w: IWarning): string {
  return WARNING_TITLES[w.kind] ?? WARNING_TITLE_DEFAULT;
}

/** MiB -> "12.0 GiB" / "512 MiB". */
export function mib(v: number | null | undefined): string {
  if (typeof v !== 'number') {
    return '–';
  }
  return v >= 1024 ? `${(v / 1024).toFixed(1)} GiB` : `${Math.round(v)} MiB`;
}

/** 'A100-SXM4-80GB #0' or 'MIG 3g.40gb of A100-SXM4-80GB #0': a device named by the lease's placement. */
export function deviceLabel(d: IDevice, lease: ILease | null | undefined): string {
  const slices = lease?.placement?.slices ?? [];
  const mig = slices.find(s => s.mig_uuid && s.mig_uuid === d.uuid);
  if (mig) {
    return `MIG ${mig.mig_profile} of ${mig.model} #${mig.index}`;
  }
  const gpu = slices.find(s => s.gpu_uuid === d.uuid);
  if (gpu) {
    return `${gpu.model} #${gpu.index}`;
  }
  return d.uuid.length > 16 ? `${d.uuid.slice(0, 14)}…` : d.uuid;
}

/** The warnings that still stand: the latest of each kind (per kernel), deadlines not yet passed. */
export function currentWarnings(status: IStatus | null, now: number): IWarning[] {
  const latest = new Map<string, IWarning>();
  for (const w of status?.warnings ?? []) {
    if (typeof w.deadline === 'number' && w.deadline < now) {
      continue;
    }
    const k = `${w.kind}:${w.kernel_id ?? ''}`;
    latest.delete(k);
    latest.set(k, w);
  }
  return [...latest.values()];
}
