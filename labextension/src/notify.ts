/**
 * JupyterLab notifications for the lease: one per topic (each kernel, the lease), updated in place
 * as its state changes and dismissed when what it says is over (see notices.ts for which).
 */
import type { Notification } from '@jupyterlab/apputils';
import type { IStatus } from './api';
import { ACTIONS, ActionName } from './kinds';
import { INotice, noticesFor, NoticeType } from './notices';

/** What the notifier needs of JupyterLab's notifications (its `Notification` namespace; a stand-in in tests). */
export interface INotifications {
  emit(message: string, type: NoticeType, options: Notification.IOptions<any>): string;
  update(args: Notification.IUpdate<any>): boolean;
  dismiss(id: string): void;
}

/** Where the notifier reads the status and the time, and what its buttons do. */
export interface INotifierHost {
  status: IStatus | null;
  now(): number;
  /** run an action of the action table (with its body, or this one) */
  run(name: ActionName, body?: Record<string, unknown>): void;
  /** open the lease's panel: the rest of what a notification's line says */
  openPanel(): void;
}

const MOMENT = 4000; // ms an action's success is shown
const ERROR_SHOWN = 8000; // ms an action's failure is shown (it stays in the notification centre)

function same(a: INotice, b: INotice): boolean {
  return a.state === b.state && a.text === b.text && a.type === b.type;
}

/** Keeps JupyterLab's notifications to what the lease's state calls for (see the module). */
export class LeaseNotifier {
  private _shown = new Map<string, { id: string; notice: INotice }>(); // topic -> its notification
  private _lease: string | null | undefined = undefined; // the lease's state at the last status (undefined: none yet)
  private _over = new Set<string>(); // what reclaim did to a kernel, once said and done with ('<topic>|<state>')
  private _moments: { id: string; until: number }[] = []; // news of a moment: dismissed once its time is over

  constructor(private host: INotifierHost, private notifications: INotifications) {}

  /** The notifications shown now, by topic (for tests and the panel). */
  get shown(): ReadonlyMap<string, INotice> {
    return new Map([...this._shown].map(([topic, s]) => [topic, s.notice]));
  }

  /**
   * How an action went: a success closes after a few seconds and leaves the notification centre at
   * the next status after that (an error stays until closed); the clock is the browser's.
   */
  say(text: string, type: 'success' | 'error', clock: () => number = Date.now): void {
    const id = this.notifications.emit(text, type, { autoClose: type === 'success' ? MOMENT : ERROR_SHOWN, actions: [] });
    if (type === 'success') {
      this._moments.push({ id, until: clock() + MOMENT + 1000 });
    }
  }

  /** Bring the notifications in line with the status. */
  update(status: IStatus | null = this.host.status, clock: () => number = Date.now): void {
    const over = this._moments.filter(m => m.until <= clock());
    over.forEach(m => this.notifications.dismiss(m.id));
    this._moments = this._moments.filter(m => m.until > clock());
    if (!status) {
      return;
    }
    const next = noticesFor(status, this.host.now(), this.shown, this._lease, this._over);
    this._lease = status.lease?.state ?? null;
    for (const [topic, shown] of this._shown) {
      if (shown.notice.state.startsWith('acted:') && next.get(topic)?.state !== shown.notice.state) {
        this._over.add(`${topic}|${shown.notice.state}`); // said; its kernel has moved on
      }
    }
    for (const [topic, notice] of next) {
      const shown = this._shown.get(topic);
      if (shown && same(shown.notice, notice)) {
        continue;
      }
      const options = { autoClose: notice.autoClose, actions: this._actions(notice) };
      // in place when it is still there (a button's click dismisses it): the notification centre keeps one per topic
      if (shown && this.notifications.update({ id: shown.id, message: notice.text, type: notice.type, ...options })) {
        this._shown.set(topic, { id: shown.id, notice });
        continue;
      }
      this._shown.set(topic, { id: this.notifications.emit(notice.text, notice.type, options), notice });
    }
    for (const [topic, shown] of [...this._shown]) {
      if (!next.has(topic)) {
        this.notifications.dismiss(shown.id);
        this._shown.delete(topic);
      }
    }
  }

  private _actions(notice: INotice): Notification.IAction[] {
    const out: Notification.IAction[] = notice.actions.map(name => ({
      label: ACTIONS[name].label,
      caption: `${ACTIONS[name].label} (GPU lease)`,
      displayType: 'accent' as const,
      callback: () => this.host.run(name, name === 'resume' && notice.kernelId ? { kernel_id: notice.kernelId } : undefined)
    }));
    out.push({
      label: 'Details',
      caption: 'The GPU lease: devices, every warning in full, the actions',
      displayType: 'link' as const,
      callback: (event: MouseEvent) => {
        event.preventDefault(); // the notification stays: what it says is still true
        this.host.openPanel();
      }
    });
    return out;
  }
}
