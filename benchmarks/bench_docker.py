"""Docker: spawn-to-ready with the image on the host vs pulled from a registry, and how fast the lock moves.

A real JupyterHub with GPULeaseDockerSpawner, the broker on two simulated L4s whose GPUs are real
character devices, a private dockerd and Debian's docker-registry on 127.0.0.1 (tests/dockerhost.py,
tests/test_docker_e2e.py's hub). Three figures, side by side in one run:

* **spawn-to-ready**, from the spawn's POST to the hub's "ready", alternating rounds of the same
  image (the single-user test image flattened into one layer, so nothing of it is on the host
  after ``docker rmi``): *present* on the host, and *pulled* from the local registry during the
  spawn (before the lease is asked for, its progress on the spawn page);
* **lease end → EPERM inside the container**: a thread in alice's kernel opens her GPU's node
  every 2 ms; the broker revokes the lease; the time from the revoke's answer to the first EPERM
  (and, for a lease the server takes itself, from the broker's answer to the first open that
  reaches the node);
* **the image's size**: on the host (``docker image inspect``) and to download (the registry's
  manifest).

    .venv/bin/python benchmarks/bench_docker.py [--rounds 3] [--lock-rounds 5]

Needs root, Docker (docker.io), docker-registry and debootstrap, and cgroup v1 (as ``.ci/run``
sets up). Saved to benchmarks/results/bench_docker.json.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import dockerhost  # noqa: E402
from hubharness import wait_for  # noqa: E402
from jupyter_gpulease.hub.environments import registry_download_size  # noqa: E402
from test_docker_e2e import close, docker_hub  # noqa: E402

IMAGE_PATH = "/opt/gpulease/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# in alice's kernel: open the node every 2 ms in a thread, note when what it sees changes
WATCH = """
import errno, os, threading, time
_seen = []
def _watch(path):
    last = None
    while True:
        try:
            os.close(os.open(path, os.O_RDONLY)); now = "opened"
        except OSError as x:
            now = errno.errorcode.get(x.errno, str(x.errno))
        if now != last:
            _seen.append((time.time(), path, now)); last = now
            with open({out!r} + ".tmp", "w") as f:
                f.write(repr(_seen))
            os.replace({out!r} + ".tmp", {out!r})
        time.sleep(0.002)
for _p in {paths!r}:
    threading.Thread(target=_watch, args=(_p,), daemon=True).start()
"""


def flat_image() -> tuple[str, str]:
    """(local test image, its one-layer copy in the registry): nothing of the copy stays on the
    host after ``docker rmi``, so its pull downloads all of it."""
    test = dockerhost.ensure_test_image()
    registry = dockerhost.ensure_registry()
    ref = f"{registry}/bench/notebook-flat:{test.rsplit(':', 1)[-1]}"
    if not dockerhost.image_exists(ref):
        cid = dockerhost.docker("create", test).stdout.decode().strip()
        try:
            exported = dockerhost.docker("export", cid, timeout=600).stdout
        finally:
            dockerhost.docker("rm", cid)
        dockerhost.docker("import", "--change", f"ENV PATH={IMAGE_PATH}", "--change", 'CMD ["jupyterhub-singleuser"]',
                          "-", ref, input=exported, timeout=600)
    dockerhost.docker("push", ref, timeout=900)
    return test, ref


def spawn_to_ready(hub, options: dict) -> float:
    t0 = time.monotonic()
    code, _ = hub.spawn("alice", options)
    assert code in (201, 202), code
    wait_for(lambda: hub.ready_server("alice"), 600, "alice's server did not start", interval=0.05)
    took = time.monotonic() - t0
    hub.stop_server("alice", timeout=120)
    return took


def read_seen(path: Path) -> list[tuple[float, str]]:
    try:
        return ast.literal_eval(path.read_text())
    except (FileNotFoundError, SyntaxError, ValueError):
        return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lock-rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "bench_docker.json"))
    args = ap.parse_args()
    reason = dockerhost.skip_reason()
    if reason:
        print(f"cannot run here: {reason}")
        return 2
    dockerhost.ensure_dockerd()
    test_image, flat = flat_image()
    sizes = {
        "test_image_on_host_mb": round(int(dockerhost.docker("image", "inspect", "-f", "{{.Size}}", test_image).stdout) / 1e6, 1),
        "flat_image_on_host_mb": round(int(dockerhost.docker("image", "inspect", "-f", "{{.Size}}", flat).stdout) / 1e6, 1),
        "flat_image_download_mb": round((asyncio.run(registry_download_size(flat)) or 0) / 1e6, 1),
    }
    envs = [{"name": "flat", "display_name": "Notebook (one layer)", "image": flat, "default": True}]
    present, pulled, ends, grants = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-docker-") as tmp:
        hub, sim, nodes, _ = docker_hub(Path(tmp), users=("alice",), hub_config=[
            f"c.GPULeaseDockerSpawner.environments = {envs!r}",
            "c.GPULeaseDockerSpawner.warm_images = False",
            "c.GPULeaseSpawner.on_lease_end = 'keep'",
        ])
        node_of = dict(zip(sim.uuids, nodes, strict=True))
        try:
            options = {"gpus": 1, "environment": "flat"}
            for i in range(args.rounds):
                dockerhost.remove_image(flat)
                pulled.append(spawn_to_ready(hub, options))
                present.append(spawn_to_ready(hub, options))
                print(f"round {i + 1}: pulled {pulled[-1]:.2f} s, present {present[-1]:.2f} s", flush=True)

            # the lock: a CPU-only server takes leases itself and the broker revokes them
            token = hub.create_token("alice")
            assert hub.spawn("alice", {"kind": "cpu", "environment": "flat"})[0] in (201, 202)
            hub.wait_ready("alice", timeout=300)
            kid = hub.start_kernel("alice", token)
            seen_file = Path(tmp) / "seen.txt"
            hub.run_cell("alice", token, kid, WATCH.format(out=str(seen_file), paths=list(nodes)))
            wait_for(lambda: len(read_seen(seen_file)) >= len(nodes), 30, "the watch started")

            def first(path: str, what: str, after: float) -> float | None:
                return next((t for t, p, w in read_seen(seen_file) if p == path and w == what and t > after), None)

            for _ in range(args.lock_rounds):
                t_ask = time.time()
                code, body = hub.gpu_api("alice", token, "lease", "POST", {"gpus": 1})
                t_answer = time.time()
                assert code == 201, body
                [lease] = hub.leases("alice", "active")
                node = node_of[lease["placement"]["slices"][0]["gpu_uuid"]]
                opened = wait_for(lambda n=node, t=t_ask: first(n, "ENXIO", t), 10, "the leased GPU opened")
                grants.append(opened - t_answer)
                hub.broker_call("release", lease["id"], "revoked by the benchmark", state="revoked")
                ended_at = float(hub.lease(lease["id"])["ended_at"])  # the broker's clock is this host's
                denied = wait_for(lambda n=node, o=opened: first(n, "EPERM", o), 10, "the GPU closed")
                ends.append(denied - ended_at)
                wait_for(lambda: hub.gpu_api("alice", token, "status")[1].get("lease") is None, 30, "her server saw the end")
                time.sleep(0.5)
        finally:
            close(hub)

    def summary(xs):
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3), "n": len(xs)}

    result = {
        "command": "benchmarks/bench_docker.py " + " ".join(sys.argv[1:]),
        "spawn_to_ready_s": {"image_present": summary(present), "image_pulled_from_local_registry": summary(pulled)},
        "lease_end_to_eperm_in_container_s": summary(ends),
        "lease_answer_to_open_in_container_s": summary(grants),
        "sizes": sizes,
    }
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
