/**
 * The status-bar item and the panel it opens: per-device figures and the lease's actions.
 */
import { Notification } from '@jupyterlab/apputils';
import { Popup, showPopup } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';
import { act, IDevice, ILease, IStatus, LeaseFeed } from './api';
import { about, clock, currentWarnings, deviceLabel, mib, statusLine, suspended } from './format';

const DONE: Record<string, string> = {
  'lease/extend': 'GPU lease extended',
  keep: 'Idle reclaim postponed',
  resume: 'Resuming: the kernels get a GPU back',
  'lease/release': 'GPU lease released'
};

/** What each action is called when it fails ("Extending the GPU lease failed: …"), in words, not the API's path. */
const DOING: Record<string, string> = {
  'lease/extend': 'Extending the GPU lease',
  keep: 'Keeping the idle GPU',
  resume: 'Resuming the kernels',
  'lease/release': 'Releasing the GPU lease'
};

/** Run one action and tell the user how it went. */
export async function runAction(feed: LeaseFeed, action: string, body: Record<string, unknown> = {}): Promise<void> {
  try {
    await act(action, body);
    const message = DONE[action] ?? 'GPU lease: done';
    Notification.success(message, { autoClose: 4000 });
  } catch (e: any) {
    Notification.error(`${DOING[action] ?? 'The GPU lease action'} failed: ${e?.message ?? e}`, { autoClose: 8000 });
  }
  await feed.refresh();
}

/** The one line in JupyterLab's status bar; a click opens the panel, a click on it again or elsewhere closes it. */
export class LeaseStatusItem extends Widget {
  constructor(private feed: LeaseFeed) {
    super();
    this.addClass('jp-gpulease-status');
    this.node.title = 'GPU lease: click for details and actions';
    this.node.setAttribute('role', 'button');
    this.node.textContent = statusLine(null, feed.now());
    feed.changed.connect(this._render, this);
    this.node.addEventListener('click', () => this.toggle());
    // the countdown moves between feed messages too
    this._timer = window.setInterval(() => this._render(), 1000);
  }

  /** Open the panel above the item, or close it. JupyterLab's popup closes it on a click elsewhere or Escape. */
  toggle(): void {
    if (this._popup && !this._popup.isDisposed) {
      this._popup.dispose();
      this._popup = null;
      return;
    }
    this._popup = showPopup({ body: new LeasePanel(this.feed), anchor: this, align: 'left', hasDynamicSize: true });
    void this.feed.refresh();
  }

  dispose(): void {
    window.clearInterval(this._timer);
    this._popup?.dispose();
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
  private _popup: Popup | null = null;
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

/** What the panel shows, as plain data: the panel changes the page only where this changes. */
export interface IPanelView {
  title: string;
  info: string;
  devices: { name: string; label: string; util: number | null; utilText: string; mem: number | null; memText: string }[];
  messages: string[];
  buttons: { label: string; action: string; body: Record<string, unknown> }[];
}

/** The panel's content for a status at ``now`` (a pure function: the countdown is in ``title`` and ``info``). */
export function panelView(s: IStatus | null, now: number): IPanelView {
  const lease = s?.lease;
  let info: string;
  if (!lease) {
    // the broker's end_message names the state itself ("Released from the notebook."): said once
    const last = s?.last_lease as (ILease & { end_message?: string }) | null | undefined;
    const ended = last?.end_message ? `Last lease: ${last.end_message} ` :
      last ? `Last lease ${last.state}${last.end_reason ? `: ${last.end_reason}` : ''}. ` : 'No GPU lease. ';
    info = ended + 'Ask for one with %gpu request in a notebook.';
  } else if (lease.state === 'queued') {
    const q = lease.queue ?? {};
    info = `Waiting: position ${q.position ?? '?'} of ${q.length ?? '?'}` +
      (typeof q.eta === 'number' ? `, ${about(q.eta - now)}` : '') + (q.waiting_for ? ` (${q.waiting_for})` : '');
  } else {
    info = `Lease ${lease.id.slice(0, 8)} · tier ${lease.tier ?? '–'} · ` +
      (typeof lease.expires_at === 'number' ? `${clock(lease.expires_at - now)} left` : 'no time limit');
  }
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
  const messages = [...(s?.message ? [s.message] : []), ...currentWarnings(s, now).map(w => w.message)];
  const buttons: IPanelView['buttons'] = [];
  if (lease?.state === 'active') {
    buttons.push({ label: 'Extend 30 min', action: 'lease/extend', body: { by_s: 1800 } });
    buttons.push({ label: 'Keep 1 h', action: 'keep', body: { for_s: 3600 } });
  }
  if (s && suspended(s)) {
    buttons.push({ label: 'Resume', action: 'resume', body: {} });
  }
  if (lease && (lease.state === 'active' || lease.state === 'queued')) {
    buttons.push({ label: lease.state === 'queued' ? 'Withdraw' : 'Release', action: 'lease/release', body: { reason: 'released from JupyterLab', force: true } });
  }
  return { title: statusLine(s, now), info, devices, messages, buttons };
}

function setText(el: HTMLElement, text: string): void {
  if (el.textContent !== text) {
    el.textContent = text;
  }
}

function setBar(row: HTMLElement, pct: number | null, text: string): void {
  const width = `${pct === null ? 0 : Math.max(0, Math.min(100, pct))}%`;
  const fill = row.querySelector('.jp-gpulease-bar-fill') as HTMLElement;
  if (fill.style.width !== width) {
    fill.style.width = width;
  }
  setText(row.querySelector('.jp-gpulease-bar-value') as HTMLElement, text);
}

/**
 * The details panel (the body of the status item's popup): lease, devices, warnings and the
 * action buttons. The feed changes several times a second and the countdown every second; the
 * panel changes only the text and bars that differ, and makes its buttons anew only when the
 * set of actions changes, so a button never moves or detaches under the pointer.
 */
export class LeasePanel extends Widget {
  constructor(private feed: LeaseFeed) {
    super();
    this.id = 'jp-gpulease-panel';
    this.addClass('jp-gpulease-panel');
    const part = (cls: string) => {
      const el = document.createElement('div');
      el.className = cls;
      this.node.appendChild(el);
      return el;
    };
    this._title = part('jp-gpulease-panel-title');
    this._info = part('jp-gpulease-panel-info');
    this._devices = part('jp-gpulease-panel-devices');
    this._messages = part('jp-gpulease-panel-messages');
    this._buttons = part('jp-gpulease-panel-actions');
    feed.changed.connect(() => this.render(), this);
    this._timer = window.setInterval(() => this.render(), 1000); // the countdown
    this.render();
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  render(): void {
    const v = panelView(this.feed.status, this.feed.now());
    setText(this._title, v.title);
    setText(this._info, v.info);
    const labels = JSON.stringify(v.devices.map(d => d.name));
    if (labels !== this._deviceKey) {
      this._deviceKey = labels;
      this._devices.textContent = '';
      v.devices.forEach(() => this._devices.appendChild(deviceBlock()));
    }
    v.devices.forEach((d, i) => {
      const block = this._devices.children[i] as HTMLElement;
      setText(block.children[0] as HTMLElement, d.label);
      setBar(block.children[1] as HTMLElement, d.util, d.utilText);
      setBar(block.children[2] as HTMLElement, d.mem, d.memText);
    });
    const messages = JSON.stringify(v.messages);
    if (messages !== this._messageKey) {
      this._messageKey = messages;
      this._messages.textContent = '';
      for (const m of v.messages) {
        const el = document.createElement('div');
        el.className = 'jp-gpulease-panel-warning';
        el.textContent = m;
        this._messages.appendChild(el);
      }
    }
    const buttons = JSON.stringify(v.buttons);
    if (buttons !== this._buttonKey) {
      this._buttonKey = buttons;
      this._buttons.textContent = '';
      for (const b of v.buttons) {
        const el = document.createElement('button');
        el.className = 'jp-mod-styled jp-gpulease-action';
        el.dataset.action = b.action;
        el.textContent = b.label;
        el.addEventListener('click', () => void runAction(this.feed, b.action, b.body));
        this._buttons.appendChild(el);
      }
    }
  }

  private _title: HTMLElement;
  private _info: HTMLElement;
  private _devices: HTMLElement;
  private _messages: HTMLElement;
  private _buttons: HTMLElement;
  private _deviceKey = '';
  private _messageKey = '';
  private _buttonKey = '';
  private _timer: number;
}

function deviceBlock(): HTMLElement {
  const el = document.createElement('div');
  el.className = 'jp-gpulease-device';
  const head = document.createElement('div');
  head.className = 'jp-gpulease-device-head';
  el.append(head, bar('util', null, ''), bar('mem', null, ''));
  return el;
}
