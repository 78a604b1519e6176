/**
 * JupyterLab notifications for the lease's warnings, each once, with the actions that answer it.
 */
import { Notification } from '@jupyterlab/apputils';
import { IStatus, IWarning, LeaseFeed } from './api';
import { warningTitle } from './format';
import { runAction } from './panel';

const ACTIONS: Record<string, { label: string; body: Record<string, unknown> }> = {
  extend: { label: 'Extend 30 min', body: { by_s: 1800 } },
  keep: { label: 'Keep 1 h', body: { for_s: 3600 } },
  resume: { label: 'Resume', body: {} },
  release: { label: 'Release', body: {} },
  request: { label: 'Request again', body: {} }
};

/** Which actions answer a warning, when the server does not say. */
function defaultActions(w: IWarning): string[] {
  switch (w.kind) {
    case 'expiring':
      return ['extend', 'release'];
    case 'idle_reclaim':
      return ['keep', 'release'];
    case 'suspended':
    case 'reclaimed':
      return ['resume'];
    default:
      return [];
  }
}

function key(w: IWarning): string {
  return w.id ?? `${w.kind}:${w.deadline ?? ''}`;
}

/** Shows each new warning of the feed once, and dismisses it when the server drops it. */
export class WarningNotifier {
  private _shown = new Map<string, string>(); // warning key -> notification id

  constructor(private feed: LeaseFeed) {
    feed.changed.connect((_, s) => this._update(s), this);
  }

  private _update(status: IStatus): void {
    const current = new Set<string>();
    for (const w of status.warnings ?? []) {
      const k = key(w);
      current.add(k);
      if (this._shown.has(k)) {
        continue;
      }
      const actions = (w.actions ?? defaultActions(w))
        .filter(a => a in ACTIONS)
        .map(a => ({
          label: ACTIONS[a].label,
          caption: `${ACTIONS[a].label} (GPU lease)`,
          displayType: 'accent' as const,
          callback: () => void runAction(this.feed, a, ACTIONS[a].body)
        }));
      const id = Notification.warning(`${warningTitle(w)}: ${w.message}`, { autoClose: false, actions });
      this._shown.set(k, id);
    }
    for (const [k, id] of [...this._shown]) {
      if (!current.has(k)) {
        Notification.dismiss(id);
        this._shown.delete(k);
      }
    }
  }
}
