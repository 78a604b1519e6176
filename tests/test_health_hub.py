"""The admin page's health section through a REAL JupyterHub: cordon and uncordon a node and set a
maintenance window with the form, each after a confirmation page; others get 403."""

import asyncio
import re
import urllib.error
import urllib.parse

import pytest

from brokerhub import hub_for_broker, wait_for_broker
from jupyter_gpulease.client import BrokerClient

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = hub_for_broker(tmp_path_factory.mktemp("hub"))
    h.start()
    try:
        h.tokens = {name: h.create_token(name) for name in ("alice", "bob", "carol")}
        wait_for_broker(h, h.tokens["alice"])
        yield h
    finally:
        h.stop()


def health(hub):
    return asyncio.run(BrokerClient(hub.service_url("gpulease"), hub.tokens["alice"]).health())


def xsrf_of(page: str) -> str:
    m = re.search(r'name="_xsrf" value="([^"]+)"', page)
    assert m, "the page has no xsrf token in its forms"
    return m.group(1)


def test_cordon_uncordon_and_a_window_from_the_admin_page_each_confirmed_first(hub):
    node = asyncio.run(BrokerClient(hub.service_url("gpulease"), hub.tokens["alice"]).pool())["devices"][0]["node"]
    carol = hub.login("carol")
    base = hub.service_url("gpulease")
    page = carol.open(base + "admin", timeout=60).read().decode()
    assert "GPU health and maintenance" in page and "every GPU takes leases" in page
    xsrf = xsrf_of(page)

    def post(browser, action, **fields):
        return browser.open(f"{base}admin/health/{action}", data=urllib.parse.urlencode({"_xsrf": xsrf, **fields}).encode(), timeout=60).read().decode()

    asked = post(carol, "cordon", target=f"node:{node}", reason="fan swap at noon")
    assert 'id="health-confirm"' in asked and f"Cordon node {node}" in asked and "fan swap at noon" in asked
    assert health(hub)["cordons"] == []  # nothing happens before the confirmation
    done = post(carol, "cordon", target=f"node:{node}", reason="fan swap at noon", confirm="1")
    assert f"Cordoned node {node}: fan swap at noon." in done and f'data-target="node:{node}"' in done
    assert [(c["name"], c["reason"]) for c in health(hub)["cordons"]] == [(node, "fan swap at noon")]
    with pytest.raises(urllib.error.HTTPError) as info:
        post(carol, "cordon", target=f"node:{node}", reason=" ", confirm="1")
    assert info.value.code == 400 and "say why" in info.value.read().decode()
    # bob, with a form token of his own page (he holds a lease, so it has forms), may not
    bobs = BrokerClient(base, hub.tokens["bob"])
    lease = asyncio.run(bobs.request_lease({"gpus": 1}))
    try:
        bob = hub.login("bob")
        bob_xsrf = xsrf_of(bob.open(base, timeout=60).read().decode())
        with pytest.raises(urllib.error.HTTPError) as info:
            bob.open(f"{base}admin/health/uncordon", data=urllib.parse.urlencode({"_xsrf": bob_xsrf, "target": f"node:{node}", "confirm": "1"}).encode(),
                     timeout=60)
        assert info.value.code == 403 and "custom:gpulease:admin" in info.value.read().decode()
    finally:
        asyncio.run(bobs.release(lease["id"]))
    assert health(hub)["cordons"]
    done = post(carol, "uncordon", target=f"node:{node}", confirm="1")
    assert f"Node {node} is back in the pool." in done and health(hub)["cordons"] == []
    done = post(carol, "window", target=f"node:{node}", reason="BIOS update", start="2099-01-01T12:00", end="2099-01-01T14:00", confirm="1")
    assert "Maintenance window set" in done and "BIOS update" in done
    [w] = health(hub)["maintenance"]
    done = post(carol, "unwindow", window=w["id"], confirm="1")
    assert "Maintenance window removed (BIOS update)." in done and health(hub)["maintenance"] == []
