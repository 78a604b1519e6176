/**
 * The status-bar item and the panel it opens: per-device figures and the lease's actions.
 */
import { Notification } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import { act, IDevice, ILease, IStatus, LeaseFeed } from './api';
import { about, clock, currentWarnings, deviceLabel, mib, statusLine, suspended } from './format';

const DONE: Record<string, string> = {
  'lease/extend': 'GPU lease extended',
  keep: 'Idle reclaim postponed',
  resume: 'Resuming: the kernels get a GPU back',
  'lease/release': 'GPU lease released'
};

/** Run one action and tell the user how it went. */
export async function runAction(feed: LeaseFeed, action: string, body: Record<string, unknown> = {}): Promise<void> {
  try {
    await act(action, body);
    const message = DONE[action] ?? `GPU lease: ${action} done`;
    Notification.success(message, { autoClose: 4000 });
  } catch (e: any) {
    Notification.error(`GPU lease: ${action} failed: ${e?.message ?? e}`, { autoClose: 8000 });
  }
  await feed.refresh();
}

/** The one line in JupyterLab's status bar; a click toggles the panel. */
export class LeaseStatusItem extends Widget {
  constructor(private feed: LeaseFeed, private panel: LeasePanel) {
    super();
    this.addClass('jp-gpulease-status');
    this.node.title = 'GPU lease: click for details and actions';
    this.node.setAttribute('role', 'button');
    this.node.textContent = statusLine(null, feed.now());
    feed.changed.connect(this._render, this);
    this.node.addEventListener('click', () => this.panel.toggle(this.node));
    // the countdown moves between feed messages too
    this._timer = window.setInterval(() => this._render(), 1000);
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  private _render(): void {
    const s = this.feed.status;
    this.node.textContent = statusLine(s, this.feed.now());
    const state = !s ? 'unknown' : suspended(s) ? 'suspended' : s.lease?.state ?? 'none';
    this.node.dataset.state = state;
    this.node.dataset.feed = this.feed.live ? 'live' : 'polling'; // the event stream is open, or the status is asked for
    this.node.classList.toggle('jp-gpulease-warn', currentWarnings(s, this.feed.now()).length > 0);
  }

  private _timer: number;
}

function bar(label: string, pct: number | null, text: string): HTMLElement {
  const row = document.createElement('div');
  row.className = 'jp-gpulease-bar';
  const name = document.createElement('span');
  name.className = 'jp-gpulease-bar-label';
  name.textContent = label;
  const track = document.createElement('span');
  track.className = 'jp-gpulease-bar-track';
  const fill = document.createElement('span');
  fill.className = 'jp-gpulease-bar-fill';
  fill.style.width = `${pct === null ? 0 : Math.max(0, Math.min(100, pct))}%`;
  track.appendChild(fill);
  const value = document.createElement('span');
  value.className = 'jp-gpulease-bar-value';
  value.textContent = text;
  row.append(name, track, value);
  return row;
}

function deviceBlock(d: IDevice, lease: ILease | null | undefined): HTMLElement {
  const el = document.createElement('div');
  el.className = 'jp-gpulease-device';
  const head = document.createElement('div');
  head.className = 'jp-gpulease-device-head';
  const extra = [
    typeof d.temperature_c === 'number' ? `${Math.round(d.temperature_c)} °C` : '',
    typeof d.power_w === 'number' ? `${Math.round(d.power_w)} W` : ''
  ].filter(Boolean).join(' · ');
  head.textContent = `${deviceLabel(d, lease)}${extra ? ` — ${extra}` : ''}`;
  el.appendChild(head);
  const u = typeof d.utilization_pct === 'number' ? d.utilization_pct : null;
  el.appendChild(bar('util', u, u === null ? '–' : `${Math.round(u)}%`));
  const used = d.memory_used_mib;
  const total = d.memory_total_mib;
  const memPct = typeof used === 'number' && typeof total === 'number' && total > 0 ? (100 * used) / total : null;
  el.appendChild(bar('mem', memPct, `${mib(used)} / ${mib(total)}`));
  return el;
}

/** The details panel: lease, devices, warnings and the action buttons. */
export class LeasePanel extends Widget {
  constructor(private feed: LeaseFeed) {
    super();
    this.id = 'jp-gpulease-panel';
    this.addClass('jp-gpulease-panel');
    this.hide();
    feed.changed.connect(() => this.isVisible && this.render(), this);
  }

  toggle(anchor: HTMLElement): void {
    if (this.isVisible) {
      this.hide();
      return;
    }
    if (!this.isAttached) {
      Widget.attach(this, document.body);
    }
    this.show();
    this.render();
    // above the status-bar item, kept inside the window
    const r = anchor.getBoundingClientRect();
    const width = this.node.offsetWidth || 360;
    this.node.style.left = `${Math.max(8, Math.min(r.left, window.innerWidth - width - 8))}px`;
    this.node.style.bottom = `${window.innerHeight - r.top + 4}px`;
    void this.feed.refresh();
  }

  render(): void {
    const s: IStatus | null = this.feed.status;
    const now = this.feed.now();
    const node = this.node;
    node.textContent = '';
    const title = document.createElement('div');
    title.className = 'jp-gpulease-panel-title';
    title.textContent = statusLine(s, now);
    node.appendChild(title);
    const lease = s?.lease;
    const info = document.createElement('div');
    info.className = 'jp-gpulease-panel-info';
    if (!lease) {
      const last = s?.last_lease;
      info.textContent = (last ? `Last lease ${last.state}${last.end_reason ? `: ${last.end_reason}` : ''}. ` : 'No GPU lease. ') +
        'Ask for one with %gpu request in a notebook.';
    } else if (lease.state === 'queued') {
      const q = lease.queue ?? {};
      info.textContent = `Waiting: position ${q.position ?? '?'} of ${q.length ?? '?'}` +
        (typeof q.eta === 'number' ? `, ${about(q.eta - now)}` : '') + (q.waiting_for ? ` (${q.waiting_for})` : '');
    } else {
      info.textContent = `Lease ${lease.id.slice(0, 12)} · tier ${lease.tier ?? '–'} · ` +
        (typeof lease.expires_at === 'number' ? `${clock(lease.expires_at - now)} left` : 'no time limit');
    }
    node.appendChild(info);
    for (const d of s?.devices ?? []) {
      node.appendChild(deviceBlock(d, lease));
    }
    if (s?.message) {
      const el = document.createElement('div');
      el.className = 'jp-gpulease-panel-warning';
      el.textContent = s.message;
      node.appendChild(el);
    }
    for (const w of currentWarnings(s, now)) {
      const el = document.createElement('div');
      el.className = 'jp-gpulease-panel-warning';
      el.textContent = w.message;
      node.appendChild(el);
    }
    const buttons = document.createElement('div');
    buttons.className = 'jp-gpulease-panel-actions';
    const add = (label: string, action: string, body: Record<string, unknown> = {}) => {
      const b = document.createElement('button');
      b.className = 'jp-mod-styled jp-gpulease-action';
      b.dataset.action = action;
      b.textContent = label;
      b.addEventListener('click', () => void runAction(this.feed, action, body));
      buttons.appendChild(b);
    };
    if (lease?.state === 'active') {
      add('Extend 30 min', 'lease/extend', { by_s: 1800 });
      add('Keep 1 h', 'keep', { for_s: 3600 });
    }
    if (s && suspended(s)) {
      add('Resume', 'resume');
    }
    if (lease && (lease.state === 'active' || lease.state === 'queued')) {
      add(lease.state === 'queued' ? 'Withdraw' : 'Release', 'lease/release', { reason: 'released from JupyterLab', force: true });
    }
    node.appendChild(buttons);
  }
}
