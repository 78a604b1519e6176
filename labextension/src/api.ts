/**
 * The gpulease server extension's REST API and live feed, as JupyterLab reaches them
 * (the server's own cookie and XSRF token through ServerConnection).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

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
  state: string;
  tier?: string;
  expires_at?: number | null;
  granted_at?: number | null;
  placement?: { slices: ISlice[] } | null;
  queue?: { position?: number | null; length?: number | null; eta?: number | null; waiting_for?: string };
  end_reason?: string;
  request?: Record<string, unknown>;
}

export interface IDevice {
  uuid: string;
  model?: string;
  index?: number;
  mig_profile?: string;
  utilization_pct?: number | null;
  memory_used_mib?: number | null;
  memory_total_mib?: number | null;
  temperature_c?: number | null;
  power_w?: number | null;
}

export interface IKernel {
  id: string;
  name?: string;
  state?: string;
  memory_mib?: number | null;
}

export interface IWarning {
  id?: string;
  kind: string;
  message: string;
  deadline?: number | null;
  actions?: string[];
}

export interface IStatus {
  now?: number;
  lease: ILease | null;
  devices?: IDevice[];
  kernels?: IKernel[];
  warnings?: IWarning[];
  suspended?: boolean;
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
  return call<IStatus>('status');
}

/** One of the lease actions: request, extend, keep, resume, release. */
export function act(action: string, body: Record<string, unknown> = {}): Promise<any> {
  return call(action, { method: 'POST', body: JSON.stringify(body) });
}

/**
 * The live feed: one status after another, pushed by the server over a websocket; when
 * the socket cannot be opened or drops, the feed asks for the status every few seconds
 * and tries the socket again.
 */
export class LeaseFeed {
  private _changed = new Signal<this, IStatus>(this);
  private _status: IStatus | null = null;
  private _socket: WebSocket | null = null;
  private _timer: number | null = null;
  private _disposed = false;
  private _offset = 0; // server clock minus browser clock, in seconds

  get changed(): ISignal<this, IStatus> {
    return this._changed;
  }

  get status(): IStatus | null {
    return this._status;
  }

  /** Now on the server's clock (POSIX seconds). */
  now(): number {
    return Date.now() / 1000 + this._offset;
  }

  start(): void {
    this._connect();
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
    this._socket?.close();
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
    }
  }

  private _update(status: IStatus): void {
    if (typeof status.now === 'number') {
      this._offset = status.now - Date.now() / 1000;
    }
    this._status = status;
    this._changed.emit(status);
  }

  private _connect(): void {
    if (this._disposed) {
      return;
    }
    const wsUrl = URLExt.join(settings.wsUrl, 'gpulease', 'api', 'feed');
    let opened = false;
    let socket: WebSocket;
    try {
      socket = new settings.WebSocket(wsUrl);
    } catch {
      this._poll();
      return;
    }
    this._socket = socket;
    socket.onopen = () => {
      opened = true;
    };
    socket.onmessage = (ev: MessageEvent) => {
      try {
        const msg = JSON.parse(ev.data);
        this._update((msg.status ?? msg) as IStatus);
      } catch (e) {
        console.warn('gpulease: feed message', e);
      }
    };
    socket.onclose = () => {
      this._socket = null;
      if (this._disposed) {
        return;
      }
      // the socket failed or dropped: keep the figures coming by asking, retry the socket later
      this._poll(opened ? 1 : 10);
    };
  }

  private _poll(rounds = 10): void {
    const tick = async () => {
      if (this._disposed) {
        return;
      }
      await this.refresh();
      rounds -= 1;
      if (rounds <= 0) {
        this._connect();
      } else {
        this._timer = window.setTimeout(tick, 2000);
      }
    };
    void tick();
  }
}
