"""Every IPython kernel of a gpulease server starts with `%gpu` loaded, without touching the
user's IPython configuration: a real Jupyter server (pytest-jupyter) starts real kernels."""

from __future__ import annotations

import asyncio

import pytest
from jupyter_client.provisioning.factory import KernelProvisionerFactory

from jupyter_gpulease.kernel.launch import PROVISIONER_NAME, is_ipykernel, use_in_server, with_extension


def test_the_extension_goes_on_ipython_kernels_command_lines_only():
    ipy = ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "/tmp/k.json"]
    assert with_extension(ipy) == [*ipy, "--ext=jupyter_gpulease"]
    assert with_extension(with_extension(ipy)) == with_extension(ipy)  # never twice
    other = ["/usr/bin/R", "--slave", "-e", "IRkernel::main()", "--args", "/tmp/k.json"]
    assert with_extension(other) == other
    assert is_ipykernel(["python", "-m", "ipykernel", "-f", "x"])


@pytest.fixture
def jp_server_config(tmp_path):
    return {"ServerApp": {"jpserver_extensions": {}}}


@pytest.fixture
def user_profile(tmp_path, monkeypatch):
    """A user's own IPython kernel config that loads an extension of theirs (a module they wrote)."""
    ipdir = tmp_path / "ipython"
    (ipdir / "profile_default").mkdir(parents=True)
    (ipdir / "profile_default" / "ipython_kernel_config.py").write_text(
        "c.InteractiveShellApp.extensions = ['users_own_ext']\n")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "users_own_ext.py").write_text("def load_ipython_extension(ip):\n    ip.user_ns['USERS_OWN_EXT_LOADED'] = True\n")
    monkeypatch.setenv("IPYTHONDIR", str(ipdir))
    monkeypatch.setenv("PYTHONPATH", str(libdir))
    return ipdir


async def _run_in_kernel(km, code: str) -> str:
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        out: list[str] = []
        await kc.execute_interactive(code, timeout=60, output_hook=lambda m: out.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
        return "".join(out)
    finally:
        kc.stop_channels()


async def test_kernels_of_a_gpulease_server_have_the_magics_and_keep_the_users_own_extensions(jp_serverapp, user_profile):
    factory = KernelProvisionerFactory.instance()
    old = factory.default_provisioner_name
    try:
        assert use_in_server(jp_serverapp)
        mkm = jp_serverapp.kernel_manager
        kid = await mkm.start_kernel(kernel_name="python3")
        try:
            km = mkm.get_kernel(kid)
            assert type(km.provisioner).__name__ == "GPULeaseKernelProvisioner"
            out = await _run_in_kernel(km, "import os\n"
                                           "print('magic', get_ipython().find_line_magic('gpu') is not None)\n"
                                           "print('own', USERS_OWN_EXT_LOADED)\n"
                                           "print('url', os.environ.get('GPULEASE_SERVER_URL'))\n")
            assert "magic True" in out
            assert "own True" in out  # the user's `extensions` list was not replaced
            assert f"url {jp_serverapp.connection_url}" in out
        finally:
            await mkm.shutdown_kernel(kid, now=True)
    finally:
        factory.default_provisioner_name = old


async def test_a_provisioner_chosen_on_purpose_is_kept(jp_serverapp):
    factory = KernelProvisionerFactory.instance()
    old = factory.default_provisioner_name
    try:
        factory.default_provisioner_name = "some-site-provisioner"
        assert not use_in_server(jp_serverapp)
        assert factory.default_provisioner_name == "some-site-provisioner"
    finally:
        factory.default_provisioner_name = old
    assert PROVISIONER_NAME in factory.provisioners  # installed as an entry point
    await asyncio.sleep(0)
