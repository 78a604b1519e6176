"""The broker client: where it finds the broker, and how it reports failures."""

import asyncio

import pytest

from hubharness import free_port
from jupyter_gpulease.client import BrokerClient, BrokerError, default_broker_url

pytestmark = pytest.mark.timeout(30)


def test_the_broker_url_comes_from_the_environment():
    assert default_broker_url({"GPULEASE_BROKER_URL": "http://x/services/gpulease/"}) == "http://x/services/gpulease/"
    inside = {"JUPYTERHUB_SERVICE_NAME": "gpulease", "JUPYTERHUB_SERVICE_URL": "http://127.0.0.1:10101", "JUPYTERHUB_SERVICE_PREFIX": "/services/gpulease/"}
    assert default_broker_url(inside) == "http://127.0.0.1:10101/services/gpulease/"
    assert default_broker_url({"JUPYTERHUB_PUBLIC_HUB_URL": "https://hub.example.org/hub/"}) == "https://hub.example.org/services/gpulease/"
    assert default_broker_url({"JUPYTERHUB_API_URL": "http://127.0.0.1:8081/jh/hub/api", "JUPYTERHUB_BASE_URL": "/jh/"}) == "http://127.0.0.1:8081/jh/services/gpulease/"
    assert default_broker_url({}) == ""


def test_from_env_prefers_the_gpulease_token(monkeypatch):
    monkeypatch.setenv("GPULEASE_BROKER_URL", "http://127.0.0.1:1/services/gpulease")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "hub-token")
    monkeypatch.setenv("GPULEASE_TOKEN", "lease-token")
    c = BrokerClient.from_env()
    assert c.url == "http://127.0.0.1:1/services/gpulease/" and c.token == "lease-token"


def test_an_unreachable_broker_is_a_broker_error_with_status_0():
    c = BrokerClient(f"http://127.0.0.1:{free_port()}/services/gpulease/", "t", timeout=5)
    with pytest.raises(BrokerError) as info:
        asyncio.run(c.pool())
    assert info.value.status == 0 and "cannot reach the lease broker" in info.value.message


def test_no_url_is_a_clear_error():
    with pytest.raises(BrokerError, match="GPULEASE_BROKER_URL"):
        BrokerClient("", "t")
