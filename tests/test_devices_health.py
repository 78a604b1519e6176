"""Health sensing with NVML (the fake NVML raises the real error classes): XIDs per code, memory
repairs pending or failed, throttle reasons, the card's slowdown temperature, a reset seen; the
simulated backend's injected XIDs and resets."""

from fake_pynvml import A100_UUID, L4_UUID, two_gpu_machine
from jupyter_gpulease.core.health import Action, assess, strongest
from jupyter_gpulease.devices.nvml import NvmlBackend
from jupyter_gpulease.devices.simulated import SimulatedBackend


def backend(fake):
    return NvmlBackend({"node": "n"}, nvml=fake)


def test_xids_are_counted_per_code_and_an_application_xid_leaves_the_gpu_ok():
    fake = two_gpu_machine()
    b = backend(fake)
    b.sample()
    for code in (13, 13, 79):
        fake.raise_xid(fake.gpus[1], code)
    h = b.sample()[L4_UUID].health
    assert h.xid_counts() == {13: 2, 79: 1} and not h.ok
    fake2 = two_gpu_machine()
    b2 = backend(fake2)
    b2.sample()
    fake2.raise_xid(fake2.gpus[1], 13)
    assert b2.sample()[L4_UUID].health.ok  # the application's own error


def test_memory_repairs_throttling_and_the_slowdown_threshold():
    fake = two_gpu_machine()
    g = fake.gpus[1]
    g.remapped_rows = (0, 1, 1, 0)
    g.throttle_reasons = 0x40 | 0x1  # hardware thermal slowdown, and idle (not a problem)
    g.temperature, g.slowdown_c = 93, 92
    s = backend(fake).sample()[L4_UUID]
    h = s.health
    assert h.row_remap_pending and not h.row_remap_failed and h.throttle == ("hw_thermal",) and not h.ok
    assert s.temperature_slowdown_c == 92
    found = assess(h.to_dict(), temperature_c=s.temperature_c, slowdown_c=s.temperature_slowdown_c)
    assert strongest(found) is Action.DRAIN_WHEN_IDLE
    assert {f.code for f in found} == {"row_remap_pending", "hot", "throttle:hw_thermal"}
    g.remapped_rows, g.retired_pages_pending = (0, 2, 0, 1), None  # failed; page retirement not supported
    h = backend(fake).sample()[L4_UUID].health
    assert h.row_remap_failed and not h.retired_pages_pending
    assert strongest(assess(h.to_dict())) is Action.DRAIN_NOW
    assert backend(fake).sample()[A100_UUID].health.ok


def test_a_lost_gpu_that_answers_again_counts_a_reset():
    fake = two_gpu_machine()
    b = backend(fake)
    b.inventory()
    fake.gpus[1].lost = True
    assert b.sample()[L4_UUID].health.lost
    fake.gpus[1].lost = False
    h = b.sample()[L4_UUID].health
    assert not h.lost and h.resets == 1


def test_the_simulated_backend_injects_xids_and_resets_across_processes(tmp_path):
    state = str(tmp_path / "sim.json")
    driver, broker = SimulatedBackend({"state_file": state}), SimulatedBackend({"state_file": state})
    u = driver.inventory()[1].uuid
    driver.inject_xid(u, 48)
    driver.inject_xid(u, 63)
    h = broker.sample()[u].health
    assert h.xid_counts() == {48: 1, 63: 1} and h.ecc_uncorrected == 1 and h.row_remap_pending and not h.ok
    driver.reset_device(u)
    h = broker.sample()[u].health
    assert (h.resets, h.ecc_uncorrected, h.row_remap_pending, h.lost) == (1, 0, False, False)
    assert h.xid_counts() == {48: 1, 63: 1}  # counted since the monitor started
    assert h.ok and h.xids_since_reset() == {} and h.message() == ""  # what the reset repaired
    assert type(h).from_dict(h.to_dict()) == h  # as the simulated state file and the API carry it
    try:
        driver.inject_xid(u, 0)
    except ValueError as e:
        assert "positive whole number" in str(e)
    else:
        raise AssertionError("an XID of 0 was taken")


def test_a_volatile_ecc_count_back_to_zero_or_a_repair_that_took_effect_counts_a_reset():
    fake = two_gpu_machine()
    b = backend(fake)
    g = fake.gpus[1]
    g.ecc_uncorrected = 1
    assert b.sample()[L4_UUID].health.resets == 0
    g.ecc_uncorrected = 0  # the driver was reloaded / the GPU reset
    assert b.sample()[L4_UUID].health.resets == 1
    g.remapped_rows = (0, 1, 1, 0)
    assert b.sample()[L4_UUID].health.resets == 1
    g.remapped_rows = (0, 1, 0, 0)  # the remap took effect at the reset
    h = b.sample()[L4_UUID].health
    assert h.resets == 2 and h.ok
