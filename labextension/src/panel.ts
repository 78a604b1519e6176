/**
 * The status-bar item and the panel it opens: per-device figures and the lease's actions.
 */
import { Popup, showPopup } from '@jupyterlab/statusbar';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';
import { act, LeaseFeed } from './api';
import { currentWarnings, statusLine, suspended } from './format';
import { ACTIONS, ActionName } from './kinds';
import { panelView } from './view';

/** Runs an action of the action table (its name; `body` replaces the table's). */
export type RunAction = (name: ActionName, body?: Record<string, unknown>) => void;

/** Says how an action went: a success is news of a moment (the lease's own notification says what holds). */
export type SayOutcome = (text: string, type: 'success' | 'error') => void;

/**
 * Run one action of the action table (its REST path and body; `body` replaces the table's) and
 * tell the user how it went, in words ("Extending the GPU lease failed: …"), not the API's path.
 */
export async function runAction(feed: LeaseFeed, name: ActionName, body: Record<string, unknown> | undefined,
                                say: SayOutcome): Promise<void> {
  const a = ACTIONS[name];
  try {
    await act(a.path, body ?? a.body);
    say(a.done, 'success');
  } catch (e: any) {
    say(`${a.doing} failed: ${e?.message ?? e}`, 'error');
  }
  await feed.refresh();
}

/** A tick every second while the page is shown: the countdown moves between feed messages too. */
function everySecond(name: string, render: () => void): Poll {
  return new Poll({ name, factory: async () => render(), frequency: { interval: 1000, backoff: false, max: 1000 }, standby: 'when-hidden' });
}

/** The one line in JupyterLab's status bar; a click opens the panel, a click on it again or elsewhere closes it. */
export class LeaseStatusItem extends Widget {
  constructor(private feed: LeaseFeed, private run: RunAction) {
    super();
    this.addClass('jp-gpulease-status');
    this.node.title = 'GPU lease: click for details and actions';
    this.node.setAttribute('role', 'button');
    this.node.textContent = statusLine(null, feed.now());
    feed.changed.connect(this._render, this);
    this.node.addEventListener('click', () => this.toggle());
    this._ticks = everySecond('gpulease:status-item', () => this._render());
  }

  /** Open the panel above the item, or close it. JupyterLab's popup closes it on a click elsewhere or Escape. */
  toggle(): void {
    if (this._popup && !this._popup.isDisposed) {
      this._popup.dispose();
      this._popup = null;
      return;
    }
    this.open();
  }

  /** Open the panel (a notification's "Details"); an open one stays. */
  open(): void {
    if (this._popup && !this._popup.isDisposed) {
      return;
    }
    this._popup = showPopup({ body: new LeasePanel(this.feed, this.run), anchor: this, align: 'left', hasDynamicSize: true });
    void this.feed.refresh();
  }

  dispose(): void {
    this._ticks.dispose();
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

  private _ticks: Poll;
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
  constructor(private feed: LeaseFeed, private run: RunAction) {
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
    this._ticks = everySecond('gpulease:panel', () => this.render());
    this.render();
  }

  dispose(): void {
    this._ticks.dispose();
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
        el.addEventListener('click', () => this.run(b.name, b.body));
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
  private _ticks: Poll;
}

function deviceBlock(): HTMLElement {
  const el = document.createElement('div');
  el.className = 'jp-gpulease-device';
  const head = document.createElement('div');
  head.className = 'jp-gpulease-device-head';
  el.append(head, bar('util', null, ''), bar('mem', null, ''));
  return el;
}
