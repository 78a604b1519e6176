/**
 * JupyterLab notifications for the lease's warnings, each once, with the actions that answer it.
 */
import { Notification } from '@jupyterlab/apputils';
import { IFeedEvent, IStatus, IWarning, LeaseFeed } from './api';
import { currentWarnings, warningTitle } from './format';
import { ACTIONS, WARNING_ACTIONS } from './kinds';
import { runAction } from './panel';

/** One notification per kind of warning (and kernel); a warning with a new deadline replaces it. */
function key(w: IWarning): string {
  return `${w.kind}:${w.kernel_id ?? ''}`;
}

/** Shows each new warning of the feed once, and dismisses it when the server drops it. */
export class WarningNotifier {
  private _shown = new Map<string, { id: string; deadline: number | null; text: string }>(); // warning key -> its notification

  constructor(private feed: LeaseFeed) {
    feed.changed.connect((_, s) => this._update(s), this);
    feed.events.connect((_, e) => this._event(e), this);
  }

  /** Grants, lease ends, reclaims and resumes are news of their own (they are not warnings that stand). */
  private _event(e: IFeedEvent): void {
    if (e.kind === 'warning') {
      this._update({ ...(this.feed.status ?? { lease: null }), warnings: [...(this.feed.status?.warnings ?? []), e as unknown as IWarning] });
      return;
    }
    const message = typeof e.message === 'string' ? e.message : '';
    if (!message) {
      return;
    }
    if (e.kind === 'lease' && ['ended', 'reclaimed'].includes(String(e.event))) {
      Notification.warning(`GPU lease ${e.lease?.state ?? 'ended'}: ${message}`, { autoClose: false });
    } else if (e.kind === 'lease' && e.event === 'granted') {
      Notification.success(message, { autoClose: 6000 });
    } else if (e.kind === 'reclaim') {
      const actions = e.action === 'suspend' && e.outcome === 'done'
        ? [{ label: ACTIONS.resume.label, caption: `${ACTIONS.resume.label} (GPU lease)`, displayType: 'accent' as const,
             callback: () => void runAction(this.feed, 'resume', e.kernel_id ? { kernel_id: e.kernel_id } : undefined) }]
        : [];
      Notification.warning(message, { autoClose: false, actions });
    } else if (e.kind === 'resume' && e.stage === 'done') {
      Notification.success(message, { autoClose: 6000 });
    } else if (e.kind === 'resume' && e.stage === 'failed') {
      Notification.error(message, { autoClose: false });
    }
  }

  private _update(status: IStatus): void {
    if (status.warnings === undefined) {
      return;
    }
    const current = new Set<string>();
    for (const w of currentWarnings(status, this.feed.now())) {
      const k = key(w);
      current.add(k);
      const deadline = typeof w.deadline === 'number' ? w.deadline : null;
      const shown = this._shown.get(k);
      const text = `${warningTitle(w)}: ${w.message}`;
      if (shown && shown.text === text) {
        continue;
      }
      if (shown && (shown.deadline === deadline || (shown.deadline !== null && deadline !== null && Math.abs(shown.deadline - deadline) < 60))) {
        continue;
      }
      if (shown) {
        Notification.dismiss(shown.id);
      }
      // the actions that answer this kind of warning (the server's table, kinds.ts)
      const actions = (WARNING_ACTIONS[w.kind] ?? []).map(a => ({
        label: ACTIONS[a].label,
        caption: `${ACTIONS[a].label} (GPU lease)`,
        displayType: 'accent' as const,
        callback: () => void runAction(this.feed, a)
      }));
      const id = Notification.warning(text, { autoClose: false, actions });
      this._shown.set(k, { id, deadline, text });
    }
    for (const [k, shown] of [...this._shown]) {
      if (!current.has(k)) {
        Notification.dismiss(shown.id);
        this._shown.delete(k);
      }
    }
  }
}
