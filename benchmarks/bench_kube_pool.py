"""Kubernetes pool sync: the broker's pool from 1,000 GPU node documents (time and memory).

    python benchmarks/bench_kube_pool.py [--nodes 1000] [--leases 2000] [--rounds 5]

The node documents (and the DRA node's ResourceSlices) are renamed copies of the 11 recorded
ones in tests/fixtures/kubernetes/ (constructed from NVIDIA GPU operator, GFD, HAMi and
DRA documentation: whole GPUs, MIG mixed and single, time-slicing, MPS, HAMi, cordoned, not
Ready, a CPU node), written as one ``kubectl get nodes -o json`` document, as the API's list
returns them. Measured, each the median of ``--rounds``:

1. read: ``KubernetesBackend.inventory()`` on that document (JSON parse + every node parsed);
   baseline side by side: the ``static`` backend declaring the same GPUs (no JSON, no labels);
2. parse only: the node objects already in memory (the first refresh after a list); then a
   refresh from the watch-fed cache with nothing changed, and with one node changed;
3. sync: ``LeaseManager.set_inventory`` with the new pool while ``--leases`` leases are active
   on it (one node lost, the rest unchanged: its leases end), with a SQLite store;
4. memory: the process RSS and the Python heap (tracemalloc) holding the node objects, and
   the parsed pool.

Figures are printed and saved to benchmarks/results/kube_pool.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "tests" / "fixtures" / "kubernetes" / "gpu-nodes.json"
SLICES = HERE.parent / "tests" / "fixtures" / "kubernetes" / "resource-slices.json"

from jupyter_gpulease.broker.manager import LeaseManager, SystemClock  # noqa: E402
from jupyter_gpulease.core.policy import Policy  # noqa: E402
from jupyter_gpulease.core.request import Ask, parse_request  # noqa: E402
from jupyter_gpulease.core.scheduler import Scheduler  # noqa: E402
from jupyter_gpulease.devices import get_backend  # noqa: E402
from jupyter_gpulease.devices.kubenodes import inventory_from_nodes, items_of  # noqa: E402
from jupyter_gpulease.store import LeaseStore  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def many_nodes(n: int) -> tuple[list[dict], list[dict]]:
    """``n`` node objects and their DRA slices: the recorded ones, copied under new names (the
    not-Ready one made Ready, every real UUID made the copy's own)."""
    base = items_of(json.loads(FIXTURE.read_text()), "Node")
    base_slices = items_of(json.loads(SLICES.read_text()), "ResourceSlice")
    out, slices = [], []
    for i in range(n):
        node = copy.deepcopy(base[i % len(base)])
        name = f"{node['metadata']['name']}-{i:04d}"
        node["metadata"]["name"] = name
        node["metadata"]["labels"]["kubernetes.io/hostname"] = name
        hami = node["metadata"].get("annotations", {}).get("hami.io/node-nvidia-register")
        if hami:  # real UUIDs: make them this copy's own
            devices = json.loads(hami)
            for d in devices:
                d["id"] = f"{d['id'][:-6]}{d['index']:02d}{i:04d}"
            node["metadata"]["annotations"]["hami.io/node-nvidia-register"] = json.dumps(devices)
        for c in node["status"]["conditions"]:
            if c["type"] == "Ready":
                c["status"], c["reason"] = "True", "KubeletReady"
        out.append(node)
        for base_slice in base_slices:
            if base_slice["spec"]["nodeName"] == base[i % len(base)]["metadata"]["name"]:
                sl = copy.deepcopy(base_slice)
                sl["metadata"]["name"] = f"{name}-gpu.nvidia.com"
                sl["spec"]["nodeName"] = sl["spec"]["pool"]["name"] = name
                for d in sl["spec"]["devices"]:
                    for attr in ("uuid", "parentUUID"):
                        if attr in d["attributes"]:
                            d["attributes"][attr]["string"] = f"{d['attributes'][attr]['string'][:-4]}{i:04d}"
                slices.append(sl)
    return out, slices


def timed(fn, rounds: int):
    times, result = [], None
    for _ in range(rounds):
        gc.collect()
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


async def sync_with_leases(gpus, gpus_without_one_node, leases: int, tmp: Path) -> dict:
    """set_inventory on a broker holding ``leases`` active leases, the new pool missing one node."""
    sched = Scheduler(gpus, Policy(confirm_timeout_s=None))
    store = LeaseStore(f"sqlite:///{tmp / 'bench.sqlite'}")
    manager = LeaseManager(sched, store, clock=SystemClock())
    await manager.start()
    now = time.time()
    for i in range(leases):
        lease = sched.new_lease(Ask(user=f"u{i % 500}", request=parse_request({"share": 0.25}), duration_s=3600), now)
        sched.submit(lease, now)
    await manager.tick()
    active = sum(1 for lease in sched.leases.values() if lease.state.value == "active")
    t = time.perf_counter()
    events = await manager.set_inventory(gpus_without_one_node)
    took = time.perf_counter() - t
    t = time.perf_counter()
    await manager.set_inventory(gpus_without_one_node)  # the same pool again (what a refresh avoids by comparing)
    again = time.perf_counter() - t
    await manager.close()
    return {"active_leases": active, "ended_by_lost_node": sum(1 for e in events if e.kind == "ended"),
            "set_inventory_s": took, "set_inventory_unchanged_s": again}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--leases", type=int, default=2000, help="active leases while the pool is replaced")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "kube_pool.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-kube-") as tmp_dir:
        tmp = Path(tmp_dir)
        rss0 = rss_mib()
        tracemalloc.start()
        nodes, slices = many_nodes(args.nodes)
        heap_nodes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rss_nodes = rss_mib() - rss0
        doc, sdoc = tmp / "nodes.json", tmp / "slices.json"
        doc.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
        sdoc.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}))
        size_mib = (doc.stat().st_size + sdoc.stat().st_size) / 2**20
        config = {"nodes_file": str(doc), "resource_slices_file": str(sdoc), "dra": True}

        def read():
            return get_backend("kubernetes", config).inventory()

        read_s, gpus = timed(read, args.rounds)
        parse_s, _ = timed(lambda: inventory_from_nodes(nodes, now=time.time(), slices=slices), args.rounds)
        cache: dict = {}
        inventory_from_nodes(nodes, now=time.time(), slices=slices, cache=cache)
        warm_s, _ = timed(lambda: inventory_from_nodes(nodes, now=time.time(), slices=slices, cache=cache), args.rounds)

        def one_changed():
            nodes[7]["metadata"]["resourceVersion"] = str(int(nodes[7]["metadata"]["resourceVersion"]) + 1)
            return inventory_from_nodes(nodes, now=time.time(), slices=slices, cache=cache)

        changed_s, _ = timed(one_changed, args.rounds)
        declared = {}
        for g in gpus:
            key = (g.node, g.model, g.memory_mib, tuple(m.profile for m in g.mig))
            declared.setdefault(key, 0)
            declared[key] += 1
        entries = [{"node": n, "model": m, "memory_mib": mem, "count": c, **({"mig": list(p)} if p else {})}
                   for (n, m, mem, p), c in declared.items()]
        static_s, static_gpus = timed(lambda: get_backend("static", {"gpus": entries}).inventory(), args.rounds)
        tracemalloc.start()
        pool = inventory_from_nodes(nodes, now=time.time(), slices=slices)
        heap_pool = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        lost = gpus[0].node
        sync = asyncio.run(sync_with_leases(gpus, [g for g in gpus if g.node != lost], args.leases, tmp))

    result = {
        "what": f"broker pool from {args.nodes} GPU node documents (renamed copies of the recorded ones), median of {args.rounds}",
        "command": "python benchmarks/bench_kube_pool.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "nodes": args.nodes,
        "gpus": len(gpus),
        "mig_instances": sum(len(g.mig) for g in gpus),
        "document_mib": round(size_mib, 2),
        "read_document_s": read_s,
        "parse_nodes_in_memory_s": parse_s,
        "refresh_nothing_changed_s": warm_s,
        "refresh_one_node_changed_s": changed_s,
        "baseline_static_same_gpus_s": static_s,
        "baseline_static_gpus": len(static_gpus),
        "node_objects_heap_mib": heap_nodes / 2**20,
        "node_objects_rss_mib": rss_nodes,
        "pool_heap_mib": heap_pool / 2**20,
        "pool_gpus": len(pool),
        **sync,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.nodes} nodes ({size_mib:.1f} MiB of JSON) -> {len(gpus)} GPUs, {result['mig_instances']} MIG instances")
    print(f"read + parse the document:  {read_s * 1000:8.1f} ms   (static backend, same GPUs declared: {static_s * 1000:.1f} ms)")
    print(f"parse nodes already in memory: {parse_s * 1000:5.1f} ms; a refresh (watch cache) with nothing changed: "
          f"{warm_s * 1000:.1f} ms, with one node changed: {changed_s * 1000:.1f} ms")
    print(f"set_inventory, {sync['active_leases']} active leases, one node lost ({sync['ended_by_lost_node']} leases end): "
          f"{sync['set_inventory_s'] * 1000:.1f} ms; unchanged pool: {sync['set_inventory_unchanged_s'] * 1000:.1f} ms")
    print(f"memory: node objects {result['node_objects_heap_mib']:.1f} MiB heap ({rss_nodes:.1f} MiB RSS), "
          f"parsed pool {result['pool_heap_mib']:.1f} MiB heap")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
