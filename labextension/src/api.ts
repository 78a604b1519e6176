/**
 * The gpulease server extension's REST API and live feed, as JupyterLab reaches them
 * (the server's own cookie and XSRF token: through ServerConnection for the REST calls, in the
 * event stream's query for the feed).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import type { ActionName, KernelState, LeaseState, NoticeKind, WarningKind } from './kinds';

export interface ISlice {
  gpu_uuid: string;
  model: string;
  index: number;
  memory_mib: number;
  share?: number;
  mig_uuid?: string;
  mig_profile?: string;
}

export interface ILease {
  id: string;
  state: LeaseState;
  tier?: string;
  expires_at?: number | null;
  granted_at?: number | null;
  placement?: { slices: ISlice[] } | null;
  queue?: {
    position?: number | null;
    length?: number | null;
    eta?: number | null;
    may_start_sooner_at?: number | null; // every holder it waits for is idle: their lease goes back by then
    waiting_for?: string;
  };
  end_reason?: string;
  end_message?: string;
  request?: Record<string, unknown>;
  // the lease in words, from the server (the one lease view's words): what does not change by the second
  summary?: string; // 'Lease 0123abcd · tier standard', 'Waiting: position 2 of 5', an ended lease's end
  queue_words?: string; // 'position 2 of 5' while queued
  holding?: string; // 'L4 ×2', 'A100 3g.40gb'
}

export interface IDevice {
  uuid: string;
  parent_uuid?: string | null;
  utilization_pct?: number | null;
  memory_used_mib?: number | null;
  memory_total_mib?: number | null;
  temperature_c?: number | null;
  power_w?: number | null;
}

export interface IKernel {
  id: string;
  name?: string;
  state?: KernelState;
  execution_state?: string;
  message?: string; // what happened to it last (a reclaim, a resume that failed), in the server's words
  gpu?: { memory_mib?: number | null; sm_util_pct?: number | null };
  memory_mib?: number | null; // in feed samples
  // while resuming: where it waits (and when it may start sooner: the GPUs it waits for sit idle)
  resume?: { stage?: string; position?: number | null; eta?: number | null; may_start_sooner_at?: number | null; message?: string } | null;
  suspended?: { memory_mib?: number | null; parked?: boolean } | null; // parked: its lease went back unused, nothing put aside
}

export interface IWarning {
  id?: number;
  kind: WarningKind;
  message: string;
  deadline?: number | null;
  at?: number | null;
  kernel_id?: string;
  reclaim_action?: string; // what happens to the idle kernel (suspend, restart, …)
  pid?: number; // unleased use: the process
}

/** One event of the live feed (besides `status` and `sample`): `type` is the event's kind, `data` its JSON. */
export interface IFeedEvent {
  type: string; // lease | warning | reclaim | resume | notice
  data: Record<string, any>; // a warning's or notice's own `kind` stays in it
}

export interface IStatus {
  now?: number;
  message?: string;
  lease: ILease | null;
  last_lease?: ILease | null;
  devices?: IDevice[];
  kernels?: IKernel[];
  warnings?: IWarning[];
  notices?: { kind: NoticeKind; message: string }[];
  actions?: IOfferedAction[]; // what the user can do now, from the server's action table
}

/** An action the server offers now: a row of the action table (kinds.ts) with its label for this lease. */
export interface IOfferedAction {
  name: ActionName;
  label: string;
  path: string;
  body: Record<string, unknown>;
}

/** An answer of the server extension that was not 2xx: its JSON message, for a person. */
export class ApiError extends Error {
  constructor(readonly status: number, message: string) {
    super(message);
  }
}

const settings = ServerConnection.makeSettings();

function url(...parts: string[]): string {
  return URLExt.join(settings.baseUrl, 'gpulease', 'api', ...parts);
}

/** Call the server extension: JSON in, JSON out; ApiError with its message otherwise. */
export async function call<T>(path: string, init: RequestInit = {}): Promise<T> {
  const response = await ServerConnection.makeRequest(url(path), init, settings);
  const text = await response.text();
  let data: any = {};
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    data = { message: text };
  }
  if (!response.ok) {
    throw new ApiError(response.status, data.message || response.statusText);
  }
  return data as T;
}

export function getStatus(): Promise<IStatus> {
  return call<IStatus>('status?history=0');
}

/** One of the lease actions: request, extend, keep, resume, release. */
export function act(action: string, body: Record<string, unknown> = {}): Promise<any> {
  return call(action, { method: 'POST', body: JSON.stringify(body) });
}

/**
 * The `_xsrf` cookie, as ServerConnection reads it (the last one when several paths set it):
 * the token a cookie-authenticated request that is not a page load must carry. JupyterHub's
 * single-user servers check it on every such request, GETs included.
 */
export function xsrfToken(): string | undefined {
  let cookie = '';
  try {
    cookie = document.cookie;
  } catch {
    return undefined;
  }
  let value: string | undefined;
  for (const part of cookie.split(';')) {
    const trimmed = part.trim();
    if (trimmed.startsWith('_xsrf=')) {
      value = trimmed.substring('_xsrf='.length);
    }
  }
  return value;
}

/**
 * The feed's URL: EventSource cannot send headers, so the XSRF token ServerConnection sends in
 * `X-XSRFToken` goes in the `_xsrf` query argument instead (the login cookie goes along as
 * for every request); `since` asks for the kept events after that id.
 */
export function feedUrl(since?: number): string {
  const query: Record<string, string> = {};
  const xsrf = xsrfToken();
  if (xsrf) {
    query._xsrf = xsrf;
  }
  if (since !== undefined && since > 0) {
    query.since = String(since);
  }
  return url('feed') + URLExt.objectToQueryString(query);
}

/**
 * The live feed: the server's server-sent events (docs/server-api.md). The first event is the
 * whole status; `sample` events refresh the devices' and kernels' figures; any other event
 * (lease, warning, reclaim, resume, notice) is passed on and the status read again.
 *
 * EventSource reconnects by itself (with `Last-Event-ID`) after a dropped connection. When it
 * gives up (the server refused the stream, or is down), two `Poll`s take over: one asks for the
 * status every 2 s, the other opens the stream again after 2 s, then after growing waits up to
 * 60 s, with `since` set to the last event it saw so that nothing in between is lost; both stand
 * by while the stream is open.
 */
export class LeaseFeed {
  private _changed = new Signal<this, IStatus>(this);
  private _events = new Signal<this, IFeedEvent>(this);
  private _status: IStatus | null = null;
  private _source: EventSource | null = null;
  private _disposed = false;
  private _offset = 0; // server clock minus browser clock, in seconds
  private _lastId = 0; // the newest event id seen on the stream
  private _open = false;
  // the status, asked for while the stream is not open
  private _statusPoll = new Poll({
    name: 'gpulease:status',
    auto: false,
    factory: async () => this._update(await getStatus()),
    frequency: { interval: 2000, backoff: false, max: 2000 },
    standby: () => this._open
  });
  // the stream, opened again when it was given up on: a rejected attempt waits longer before the next
  private _streamPoll = new Poll({
    name: 'gpulease:stream',
    auto: false,
    factory: () => this._connect(),
    frequency: { interval: 2000, backoff: 2, max: 60000 },
    standby: () => this._open || this._source !== null
  });

  get changed(): ISignal<this, IStatus> {
    return this._changed;
  }

  /** Lease, warning, reclaim, resume and notice events as they come. */
  get events(): ISignal<this, IFeedEvent> {
    return this._events;
  }

  get status(): IStatus | null {
    return this._status;
  }

  /** Whether the event stream is open now (false while the feed polls instead). */
  get live(): boolean {
    return this._open;
  }

  /** Now on the server's clock (POSIX seconds). */
  now(): number {
    return Date.now() / 1000 + this._offset;
  }

  start(): void {
    void this._streamPoll.start();
    void this._statusPoll.start();
  }

  /** Ask for the status now (after an action), without waiting for the feed. */
  async refresh(): Promise<void> {
    try {
      this._update(await getStatus());
    } catch (e) {
      console.warn('gpulease: status', e);
    }
  }

  dispose(): void {
    this._disposed = true;
    this._source?.close();
    this._source = null;
    this._statusPoll.dispose();
    this._streamPoll.dispose();
  }

  private _update(status: IStatus): void {
    if (typeof status.now === 'number') {
      this._offset = status.now - Date.now() / 1000;
    }
    this._status = status;
    this._changed.emit(status);
  }

  private _sample(data: any): void {
    if (!this._status) {
      return;
    }
    if (typeof data.t === 'number') {
      this._offset = data.t - Date.now() / 1000;
    }
    const kernels = new Map<string, any>((data.kernels ?? []).map((k: any) => [k.id, k]));
    const merged: IStatus = {
      ...this._status,
      devices: data.devices ?? this._status.devices,
      kernels: (this._status.kernels ?? []).map(k => {
        const s = kernels.get(k.id);
        return s ? { ...k, state: s.state ?? k.state, execution_state: s.execution_state ?? k.execution_state,
                     gpu: { ...(k.gpu ?? {}), memory_mib: s.memory_mib, sm_util_pct: s.sm_util_pct } } : k;
      })
    };
    this._update(merged);
  }

  /** Remember the newest event id (for `since` when the stream is opened again). */
  private _seen(ev: MessageEvent): void {
    const id = Number(ev.lastEventId);
    if (Number.isFinite(id) && id > this._lastId) {
      this._lastId = id;
    }
  }

  /** Open the stream: resolves once it is open, rejects when EventSource gives up on it. */
  private _connect(): Promise<void> {
    if (this._disposed) {
      return Promise.resolve();
    }
    return new Promise<void>((resolve, reject) => {
      let source: EventSource;
      try {
        source = new EventSource(feedUrl(this._lastId), { withCredentials: true });
      } catch (e) {
        reject(e);
        return;
      }
      this._source = source;
      source.onopen = () => {
        this._open = true;
        resolve();
      };
      const parse = (ev: MessageEvent): any => {
        this._seen(ev);
        try {
          return JSON.parse(ev.data);
        } catch {
          return null;
        }
      };
      source.addEventListener('status', (ev: MessageEvent) => {
        const data = parse(ev);
        if (data) {
          this._update(data as IStatus);
        }
      });
      source.addEventListener('sample', (ev: MessageEvent) => {
        const data = parse(ev);
        if (data) {
          this._sample(data);
        }
      });
      for (const type of ['lease', 'warning', 'reclaim', 'resume', 'notice']) {
        source.addEventListener(type, (ev: MessageEvent) => {
          const data = parse(ev);
          if (data) {
            this._events.emit({ type, data }); // (a warning's data has a `kind` of its own: kept apart from the event's)
          }
          void this.refresh();
        });
      }
      source.onerror = () => {
        // a dropped connection: EventSource tries again by itself (with Last-Event-ID) while it
        // is CONNECTING; CLOSED means it gave up (a refusal such as 403, or the server is gone):
        // the polls ask for the status meanwhile and open the stream again
        this._open = false;
        if (source.readyState === EventSource.CLOSED && this._source === source) {
          this._source = null;
          void this._statusPoll.refresh();
          reject(new Error('the event stream was closed'));
        }
      };
    });
  }
}
