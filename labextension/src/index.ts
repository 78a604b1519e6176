/**
 * jupyter-gpulease for JupyterLab 4: a status-bar item with the GPU lease at a glance
 * ("GPU A100 ×1 · 63% · 1 h 12 min left", "GPU queue #3 · ~14 min"), a panel with per-device
 * figures and the lease's actions, and notifications for its warnings.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LeaseFeed } from './api';
import { LeaseNotifier } from './notify';
import { LeaseStatusItem, RunAction, runAction } from './panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpulease:status',
  description: 'GPU lease in the status bar, with a details panel and notifications.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, statusBar: IStatusBar | null) => {
    const feed = new LeaseFeed();
    const run: RunAction = (name, body) => void runAction(feed, name, body, (text, type) => notifier.say(text, type));
    const item = statusBar ? new LeaseStatusItem(feed, run) : null;
    const notifier: LeaseNotifier = new LeaseNotifier({
      get status() {
        return feed.status;
      },
      now: () => feed.now(),
      run,
      // after the click that asked for it: the popup closes on a click that began outside it
      openPanel: () => setTimeout(() => item?.open(), 0)
    }, {
      emit: (message, type, options) => Notification.emit(message, type, options),
      update: args => Notification.update(args),
      dismiss: id => Notification.dismiss(id)
    });
    feed.changed.connect(() => notifier.update());
    if (statusBar && item) {
      statusBar.registerStatusItem('jupyter-gpulease:status', { item, align: 'left', rank: 100 });
    }
    app.restored.then(() => feed.start());
  }
};

export default plugin;
