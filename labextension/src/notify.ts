/**
 * JupyterLab notifications for the lease's warnings, each once, with the actions that answer it.
 */
import { Notification } from '@jupyterlab/apputils';
import { IFeedEvent, IStatus, IWarning, LeaseFeed } from './api';
import { currentWarnings, warningTitle } from './format';
import { runAction } from './panel';

const ACTIONS: Record<string, { label: string; path: string; body: Record<string, unknown> }> = {
  extend: { label: 'Extend 30 min', path: 'lease/extend', body: { by_s: 1800 } },
  keep: { label: 'Keep 1 h', path: 'keep', body: { for_s: 3600 } },
  resume: { label: 'Resume', path: 'resume', body: {} },
  release: { label: 'Release', path: 'lease/release', body: { reason: 'released from a JupyterLab notification', force: true } }
};

/** Which actions answer a warning, when the server does not say. */
function defaultActions(w: IWarning): string[] {
  switch (w.kind) {
    case 'expiring':
      return ['extend', 'release'];
    case 'reclaim':
    case 'lease_reclaim':
      return ['keep', 'release'];
    case 'preemption':
      return ['release'];
    default:
      return [];
  }
}

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
        ? [{ label: 'Resume', caption: 'Resume (GPU lease)', displayType: 'accent' as const,
             callback: () => void runAction(this.feed, 'resume', e.kernel_id ? { kernel_id: e.kernel_id } : {}) }]
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
      const actions = defaultActions(w)
        .filter(a => a in ACTIONS)
        .map(a => ({
          label: ACTIONS[a].label,
          caption: `${ACTIONS[a].label} (GPU lease)`,
          displayType: 'accent' as const,
          callback: () => void runAction(this.feed, ACTIONS[a].path, ACTIONS[a].body)
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
