/**
 * The status bar's and the panel's words: the countdown and ETAs formatted here, the lease's
 * sentences read from the server's JSON as it serves them (LeaseView.status_json).
 */
import type { IStatus } from '../src/api';
import { about, currentWarnings, deviceLabel, hhmm, hhmmBy, mib, statusLine, suspended, timeLeft, warningTitle } from '../src/format';
import { ACTIONS, KERNEL_STATES, WARNING_ACTIONS, WARNING_KINDS } from '../src/kinds';
import { panelInfo, panelView } from '../src/view';

const NOW = 1_800_000_000;

/** A status as the server sends it for an active lease of two L4s. */
function active(extra: Partial<IStatus> = {}): IStatus {
  return {
    now: NOW,
    lease: {
      id: '0123456789abcdef',
      state: 'active',
      tier: 'standard',
      expires_at: NOW + 4320,
      placement: {
        slices: [
          { gpu_uuid: 'GPU-l0', model: 'L4', index: 0, memory_mib: 23034 },
          { gpu_uuid: 'GPU-l1', model: 'L4', index: 1, memory_mib: 23034 }
        ]
      },
      summary: 'Lease 01234567 · tier standard',
      queue_words: '',
      holding: 'L4 ×2'
    },
    devices: [
      { uuid: 'GPU-l0', utilization_pct: 60, memory_used_mib: 2048, memory_total_mib: 23034, temperature_c: 41.4, power_w: 70.2 },
      { uuid: 'GPU-l1', utilization_pct: 66, memory_used_mib: 512, memory_total_mib: 23034 }
    ],
    kernels: [{ id: 'k1', state: 'ok' }],
    actions: [
      { name: 'extend', label: 'Extend 30 min', path: 'lease/extend', body: { by_s: 1800 } },
      { name: 'release', label: 'Release', path: 'lease/release', body: { reason: 'released from JupyterLab', force: true } }
    ],
    ...extra
  };
}

const QUEUED: IStatus = {
  now: NOW,
  lease: {
    id: 'fedcba9876543210',
    state: 'queued',
    queue: { position: 2, length: 5, eta: NOW + 14 * 60, waiting_for: 'an L4 held by alice' },
    summary: 'Waiting: position 2 of 5',
    queue_words: 'position 2 of 5',
    holding: ''
  },
  actions: [{ name: 'release', label: 'Withdraw', path: 'lease/release', body: { force: true } }]
};

describe('the countdown and waits', () => {
  it('says what is left in hours and minutes, rounded down, never as a clock that reads as minutes', () => {
    expect(timeLeft(4320)).toBe('1 h 12 min');
    expect(timeLeft(2 * 3600 - 10)).toBe('1 h 59 min');
    expect(timeLeft(3600)).toBe('1 h');
    expect(timeLeft(14 * 60 + 50)).toBe('14 min');
    expect(timeLeft(40.6)).toBe('40 s');
    expect(timeLeft(-5)).toBe('0 s');
    expect(timeLeft(3 * 86400 + 4 * 3600 + 59)).toBe('3 d 4 h');
  });

  it('says a wait roughly', () => {
    expect(about(30)).toBe('any moment');
    expect(about(14 * 60)).toBe('~14 min');
    expect(about(65 * 60)).toBe('~1 h 5 min');
    expect(about(2 * 3600)).toBe('~2 h');
  });

  it('says a time of day as hours and minutes', () => {
    expect(hhmm(NOW)).toMatch(/^\d\d:\d\d$/);
    // a time something happens by: the next minute, never earlier than it comes
    const at = Math.floor(NOW / 60) * 60 + 56;
    expect(hhmmBy(at)).toBe(hhmm(at + 4));
    expect(hhmmBy(at - 56)).toBe(hhmm(at - 56));
  });

  it('says memory in MiB or GiB', () => {
    expect(mib(512)).toBe('512 MiB');
    expect(mib(2048)).toBe('2.0 GiB');
    expect(mib(null)).toBe('–');
  });
});

describe('the status line', () => {
  it('shows what the server says the lease holds, the mean utilization and the time left', () => {
    expect(statusLine(active(), NOW)).toBe('GPU L4 ×2 · 63% · 1 h 12 min left');
    expect(statusLine(active(), NOW + 4320 - 600)).toBe('GPU L4 ×2 · 63% · 10 min left');
  });

  it('shows the place in the queue and the ETA, and a sooner start', () => {
    expect(statusLine(QUEUED, NOW)).toBe('GPU queue #2 · ~14 min');
    const sooner = { ...QUEUED, lease: { ...QUEUED.lease!, queue: { ...QUEUED.lease!.queue, may_start_sooner_at: NOW + 300 } } };
    expect(statusLine(sooner, NOW)).toMatch(/^GPU queue #2 · ~14 min \(or by \d\d:\d\d if idle GPUs go back\)$/);
  });

  it('shows a suspended and a resuming kernel before the lease', () => {
    const s = active({ kernels: [{ id: 'k1', state: 'suspended' }] });
    expect(suspended(s)).toBe(true);
    expect(statusLine(s, NOW)).toBe('GPU suspended · resumes on next cell');
    const r = active({ kernels: [{ id: 'k1', state: 'resuming', resume: { stage: 'waiting', position: 1, eta: NOW + 20 * 60 } }] });
    expect(statusLine(r, NOW)).toBe('GPU resuming · queue #1 · ~20 min');
    const restoring = active({ kernels: [{ id: 'k1', state: 'resuming', resume: { stage: 'restoring' } }] });
    expect(statusLine(restoring, NOW)).toBe('GPU resuming · restoring');
  });

  it('shows no lease and an unknown status', () => {
    expect(statusLine({ lease: null }, NOW)).toBe('GPU none');
    expect(statusLine(null, NOW)).toBe('GPU …');
  });
});

describe('the panel', () => {
  it('reads the lease sentence from the server and adds the countdown', () => {
    expect(panelInfo(active(), NOW)).toBe('Lease 01234567 · tier standard · 1 h 12 min left');
    expect(panelInfo(active(), NOW + 60)).toBe('Lease 01234567 · tier standard · 1 h 11 min left');
  });

  it('reads the queue sentence from the server and adds the ETA and what it waits for', () => {
    expect(panelInfo(QUEUED, NOW)).toBe('Waiting: position 2 of 5, ~14 min (an L4 held by alice)');
  });

  it('says the last lease\'s end once, as the server words it', () => {
    const s: IStatus = { lease: null, last_lease: { id: 'x', state: 'released', summary: 'Released from the notebook.' } };
    expect(panelInfo(s, NOW)).toBe('Last lease: Released from the notebook. Ask for one with %gpu request in a notebook.');
    expect(panelInfo({ lease: null }, NOW)).toBe('No GPU lease. Ask for one with %gpu request in a notebook.');
  });

  it('names devices by the placement and offers the actions the server offers', () => {
    const v = panelView(active(), NOW);
    expect(v.title).toBe('GPU L4 ×2 · 63% · 1 h 12 min left');
    expect(v.devices.map(d => d.label)).toEqual(['L4 #0 — 41 °C · 70 W', 'L4 #1']);
    expect(v.devices[0].memText).toBe('2.0 GiB / 22.5 GiB');
    expect(v.buttons.map(b => [b.label, b.action])).toEqual([['Extend 30 min', 'lease/extend'], ['Release', 'lease/release']]);
    expect(panelView(QUEUED, NOW).buttons.map(b => b.label)).toEqual(['Withdraw']);
    expect(deviceLabel({ uuid: 'GPU-0123456789abcdef0123' }, null)).toBe('GPU-0123456789…');
  });
});

describe('warnings', () => {
  it('keeps the latest of each kind per kernel until its deadline', () => {
    const s = active({
      warnings: [
        { kind: 'reclaim', kernel_id: 'k1', deadline: NOW + 10, message: 'a' },
        { kind: 'reclaim', kernel_id: 'k1', deadline: NOW + 100, message: 'b' },
        { kind: 'expiring', deadline: NOW - 1, message: 'c' },
        { kind: 'share_memory', kernel_id: 'k2', message: 'd' }
      ]
    });
    expect(currentWarnings(s, NOW).map(w => w.message)).toEqual(['b', 'd']);
    expect(panelView(s, NOW).messages).toEqual(['b', 'd']);
  });

  it('titles a warning and answers it from the one table', () => {
    expect(warningTitle({ kind: 'expiring', message: '' })).toBe('GPU lease ends soon');
    expect(warningTitle({ kind: 'lease_reclaim', message: '' })).toBe('Idle GPU will be reclaimed');
    expect(WARNING_ACTIONS.expiring?.map(a => ACTIONS[a].label)).toEqual(['Extend 30 min', 'Release']);
    expect(WARNING_ACTIONS.share_memory).toBeUndefined();
    expect(WARNING_KINDS).toContain('unleased_use');
    expect(KERNEL_STATES).toEqual(['ok', 'acting', 'suspended', 'resuming', 'reclaimed']);
  });
});
