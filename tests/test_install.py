"""An admin's first day, from the documentation alone: the built wheel installed (not editable) into a
fresh virtual environment, a hub configured with the guides' snippets, a spawn that gets a lease and a server.

The config files are the guides' own code blocks (``# jupyterhub_config.py`` and
``# gpulease_config.py``): the tutorial "Add GPU leases to an existing JupyterHub", then the
how-to guides whose snippets add to the same two files, read when the test runs, so the guides
and this test cannot drift apart. Only what every hub already has of its own is added after them: ports
and paths on 127.0.0.1 in a temporary folder, an authenticator with two users in two groups,
and (as the test runs as root without system users) SimpleLocalProcessSpawner's lease class.

Needs the network to PyPI (pip installs the wheel's dependencies into the fresh venv), as an
admin's ``pip install jupyter-gpulease`` does.
"""

from __future__ import annotations

import http.cookiejar
import importlib.util
import re
import secrets
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from hubharness import ADMIN_SCOPES, HubHarness, free_port, wait_for

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# the pages an admin follows on the first day, in this order: the tutorial, then the how-to guides
# whose snippets add to the same two files (Prometheus' service, alerts, unleased use, prices)
GUIDES = [DOCS / "tutorials" / "existing-hub.md", DOCS / "how-to" / "alerts-and-dashboard.md",
          DOCS / "how-to" / "unleased-use.md", DOCS / "how-to" / "prices-and-groups.md"]
TUTORIAL = GUIDES[0]


def guides_text() -> str:
    return "\n".join(p.read_text() for p in GUIDES)
ARTIFACTS = ROOT / "test-artifacts" / "install"  # the hub's log of the last run


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced code block in a Markdown text."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def readme_file(name: str, text: str | None = None) -> str:
    """The guides' code for the file ``name``: every block whose first line is ``# <name>``, in order."""
    blocks = [code for _, code in readme_blocks(guides_text() if text is None else text)
              if code.splitlines() and code.splitlines()[0].strip() == f"# {name}"]
    assert blocks, f"the guides have no code block that starts with '# {name}'"
    return "\n".join(blocks)


def test_the_guides_snippets_are_found_and_complete():
    """The blocks the admin test uses exist, and say what issue 14 found missing."""
    hub = readme_file("jupyterhub_config.py")
    broker = readme_file("gpulease_config.py")
    for needle in ('"gpulease-spawner"', "custom:gpulease:admin", "read:groups", "oauth_client_allowed_scopes",
                   "jupyterhub-singleuser", "c.Spawner.poll_interval", "server_token_scopes"):
        assert needle in hub, needle
    assert '"static"' in broker and "group_quotas" in broker and "tiers" in broker
    install = [code for lang, code in readme_blocks(TUTORIAL.read_text()) if lang == "bash" and "pip install jupyter-gpulease" in code]
    assert install, "the tutorial tells the admin to pip install jupyter-gpulease"


def test_the_tutorials_roles_agree_with_the_example_config():
    """The tutorial's roles and the annotated example's (config/jupyterhub_config.py) grant the same scopes."""
    def roles(code: str) -> dict[str, set[str]]:
        out = {}
        for m in re.finditer(r'\{"name": "([\w-]+)", "scopes": \[([^\]]*)\]', code):
            out[m.group(1)] = set(re.findall(r'"([^"]+)"', m.group(2)))
        return out

    readme = roles(readme_file("jupyterhub_config.py"))
    example = roles((ROOT / "config" / "jupyterhub_config.py").read_text())
    for name in ("user", "gpulease-spawner", "gpulease-broker"):
        assert readme[name] == example[name], (name, readme[name], example[name])
    assert "oauth_client_allowed_scopes" in (ROOT / "config" / "jupyterhub_config.py").read_text()


class Browser:
    """A logged-in browser session without a browser: cookies, the login form, the spawn form."""

    def __init__(self, url: str, user: str, password: str):
        self.url = url
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.opener.open(f"{url}/hub/login").read()
        data = urllib.parse.urlencode({"username": user, "password": password, "_xsrf": self.xsrf()}).encode()
        self.opener.open(f"{url}/hub/login", data).read()

    def xsrf(self) -> str:
        return [c.value for c in self.jar if c.name == "_xsrf"][-1]

    def get(self, path: str) -> str:
        return self.opener.open(f"{self.url}{path}").read().decode()

    def submit(self, fields: dict) -> str:
        data = urllib.parse.urlencode({**fields, "_xsrf": self.xsrf()}).encode()
        with self.opener.open(f"{self.url}/hub/spawn", data) as r:
            return r.url


class InstalledHub(HubHarness):
    """A hub whose config is the guides' snippets plus the site's own settings, run from another venv."""

    def __init__(self, tmp_path: Path, *, python: Path, readme_config: str):
        super().__init__(tmp_path, users=["alice", "bob"], groups={"students": ["alice"], "staff": ["bob"]})
        self.python = str(python)
        self.readme_config = readme_config

    def config_text(self) -> str:
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        site = [
            "",
            "# ---- the site's own settings (every hub has its own): not from the guides ----",
            *self.site_lines(),
            "c.JupyterHub.authenticator_class = 'dummy'",
            f"c.DummyAuthenticator.password = {self.password!r}",
            "c.Authenticator.allowed_users = {'alice', 'bob'}",
            f"c.JupyterHub.load_groups = {({g: {'users': m} for g, m in self.groups.items()})!r}",
            # the test runs as root and its users are no system users
            "c.JupyterHub.spawner_class = 'gpulease-simple'",
            f"c.SimpleLocalProcessSpawner.home_dir_template = {str(home / '{username}')!r}",
            "c.Spawner.args = ['--allow-root']",
            # the test's own admin token, added to the guides' lists as an admin adds to them
            f"c.JupyterHub.services.append({{'name': 'site-admin', 'api_token': {self.admin_token!r}}})",
            "c.JupyterHub.load_roles.append({'name': 'site-admin', 'services': ['site-admin'], 'scopes': "
            f"{[*ADMIN_SCOPES, 'custom:gpulease:admin', 'access:services!service=gpulease']!r}}})",
        ]
        return self.readme_config + "\n".join(site) + "\n"


def build_wheel(dist: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("jupyter_gpulease-*.whl")
    return wheel


def fresh_venv_with(wheel: Path, venv: Path) -> Path:
    """A new virtual environment with the wheel installed by pip, as the tutorial's install step does."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return py


def test_an_admin_follows_readme_from_pip_install_to_a_leased_server(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    py = fresh_venv_with(wheel, tmp_path / "venv")
    # the installed package, not this checkout, and what the servers need came with it
    probe = subprocess.run([str(py), "-c", "import jupyter_gpulease, jupyterlab, ipykernel; print(jupyter_gpulease.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(tmp_path / "venv")), probe.stdout
    assert (tmp_path / "venv" / "bin" / "jupyterhub-singleuser").exists()
    # the prebuilt JupyterLab extension and the server extension came with the wheel, enabled
    jupyter = str(tmp_path / "venv" / "bin" / "jupyter")
    def listing(*args) -> str:
        r = subprocess.run([jupyter, *args], capture_output=True, text=True, timeout=120, check=False)
        return re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)  # without the colours

    lab = listing("labextension", "list")
    assert re.search(r"jupyter-gpulease v\S+ enabled OK", lab), lab
    server = listing("server", "extension", "list")
    assert re.search(r"jupyter_gpulease\S* enabled", server), server

    # the guides' snippets, in the site's own folders (their /etc/jupyterhub, /srv/jupyterhub) and with a free port
    etc, srv = tmp_path / "etc", tmp_path / "srv"
    etc.mkdir()
    srv.mkdir()
    broker_port = str(free_port())

    def site(code: str) -> str:
        return code.replace("/etc/jupyterhub", str(etc)).replace("/srv/jupyterhub", str(srv)).replace("10101", broker_port)

    (etc / "gpulease_config.py").write_text(site(readme_file("gpulease_config.py")))
    hub = InstalledHub(tmp_path / "hub", python=py, readme_config=site(readme_file("jupyterhub_config.py")))
    # the guides: the spawner's and Prometheus' tokens in the hub's environment; the hub's venv is not on PATH (Spawner.cmd names it)
    hub.env = {"GPULEASE_SPAWNER_TOKEN": secrets.token_hex(32), "GPULEASE_PROMETHEUS_TOKEN": secrets.token_hex(32),
               "PATH": "/usr/local/bin:/usr/bin:/bin"}
    hub.start()
    try:
        broker = f"{hub.url}/services/gpulease/api"
        wait_for(lambda: hub.request("GET", f"{broker}/pool", token=hub.admin_token)[0] == 200, 60,
                 f"the broker did not answer\n{hub.log_tail()}")
        status, pool = hub.request("GET", f"{broker}/pool", token=hub.admin_token)
        assert {m: c["gpus"] for m, c in pool["capacity"].items()} == {"A100-SXM4-80GB": 4, "L40S": 4}

        # alice (a student; the tutorial's quota: 2 GPUs at a time) picks a GPU on the spawn form
        alice = Browser(hub.url, "alice", hub.password)
        form = alice.get("/hub/spawn")
        offered = set(re.findall(r'value="gpu:(\d+):A100-SXM4-80GB"', form))
        assert offered == {"1", "2"}, f"alice's quota is 2 GPUs; the form offers {sorted(offered)} × A100"
        assert "research" not in re.findall(r'<option value="([^"]+)" data-max-s', form), "research is for staff only"
        assert "spawn-pending/alice" in alice.submit({"choice": "gpu:1:L40S"})

        # bob (staff) asks for all four A100s in the research tier through the REST API
        status, body = hub.api("POST", "users/bob/server", {"gpus": 4, "model": "A100*", "tier": "research", "duration_h": 2})
        assert status in (201, 202), body

        def ready(user):
            status, model = hub.api("GET", f"users/{user}")
            return status == 200 and (model["servers"].get("") or {}).get("ready")

        for user in ("alice", "bob"):
            wait_for(lambda u=user: ready(u), 300, f"{user}'s server did not become ready\n{_about(hub, user)}")

        status, leases = hub.request("GET", f"{broker}/leases?state=active", token=hub.admin_token)
        by_user = {lease["user"]: lease for lease in leases["leases"]}
        assert by_user["alice"]["tier"] == "course"
        assert [s["node"] for s in by_user["alice"]["placement"]["slices"]] == ["gpu-02"]
        assert by_user["bob"]["tier"] == "research"
        assert sorted(s["node"] for s in by_user["bob"]["placement"]["slices"]) == ["gpu-01"] * 4

        # the servers are usable: JupyterLab answers and a Python kernel is there
        for user in ("alice", "bob"):
            status, _ = hub.request("GET", f"{hub.url}/user/{user}/lab", token=hub.admin_token)
            assert status == 200, f"{user}'s /lab answered {status}"
            status, specs = hub.request("GET", f"{hub.url}/user/{user}/api/kernelspecs", token=hub.admin_token)
            assert status == 200 and "python3" in specs["kernelspecs"], specs
            # the server extension runs in the installed server and knows the server's lease
            status, gl = hub.request("GET", f"{hub.url}/user/{user}/gpulease/api/status", token=hub.admin_token)
            assert status == 200, gl
            assert (gl.get("lease") or {}).get("id") == by_user[user]["id"], gl

        # stopping the servers ends their leases
        for user in ("alice", "bob"):
            hub.api("DELETE", f"users/{user}/server")
        wait_for(lambda: not _live(hub, broker), 60, "the leases did not end when the servers stopped")
    finally:
        hub.stop()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(hub.log_file, ARTIFACTS / "jupyterhub.log")


def _about(hub, user: str) -> str:
    """The hub log's lines about ``user`` and its errors, for a failure message."""
    lines = hub.log_file.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if user in line or "Error" in line or "Traceback" in line)[-6000:]


def _live(hub, broker) -> list:
    status, leases = hub.request("GET", f"{broker}/leases?state=live", token=hub.admin_token)
    assert status == 200, leases
    return leases["leases"]
