#!/usr/bin/env bash
# End-to-end check of jupyter-gpulease on Kubernetes: a real API server, scheduler and kubelet,
# the Zero to JupyterHub chart with deploy/z2jh-values.yaml, the broker reading the cluster's nodes.
#
#   deploy/e2e-check.sh                        # a throw-away kind cluster (needs docker and kind)
#   KUBE_CONTEXT=my-k3s GPU_NODE=node-1 \
#   IMAGE_PREFIX=registry.example.org/ deploy/e2e-check.sh   # an existing cluster (k3s, a real one)
#
# Needs: kubectl, helm, docker, python3, curl (and kind without KUBE_CONTEXT). With an existing
# cluster the images are pushed to IMAGE_PREFIX and GPU_NODE must be a node with GPUs (NVIDIA
# device plugin and GPU feature discovery running); on kind the script gives a worker four
# pretend GPUs: GPU feature discovery's labels and nvidia.com/gpu advertised as an extended
# resource in the node's status, so pods are scheduled and started exactly as on a GPU node,
# though their containers see no GPU.
#
# It checks, and exits non-zero at the first failure:
#   1. the broker's pool is the GPU node's GPUs (model from nvidia.com/gpu.product);
#   2. a spawn through the hub's REST API gets a lease and a pod on the leased node asking for
#      nvidia.com/gpu, tolerating the GPU taint, with the lease in its environment;
#   3. a second user asking for more than is left waits in the queue (no pod), and gets the GPUs
#      when the first server stops (its lease released);
#   4. cordoning the node marks its GPUs unhealthy in the broker within a minute;
#   5. when every server is stopped no lease is left.
# KEEP=1 keeps the cluster / release afterwards.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
NS=${NAMESPACE:-gpulease-e2e}
RELEASE=${RELEASE:-gpulease-e2e}
CHART_VERSION=${CHART_VERSION:-4.3.2}
CLUSTER=${KIND_CLUSTER:-gpulease-e2e}
PREFIX=${IMAGE_PREFIX:-}
TAG=e2e-$(date +%s)
ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
PF_PORT=${PORT:-18080}
HUB="http://127.0.0.1:${PF_PORT}"
step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || fail "$1 is needed"; }
for c in kubectl helm docker python3 curl; do need "$c"; done

if [ -z "${KUBE_CONTEXT:-}" ]; then
    need kind
    step "kind cluster $CLUSTER (one control plane, one worker)"
    if ! kind get clusters | grep -qx "$CLUSTER"; then
        printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n- role: control-plane\n- role: worker\n' \
            | kind create cluster --name "$CLUSTER" --config=- --wait 120s
    fi
    KUBE_CONTEXT="kind-$CLUSTER"
    GPU_NODE=${GPU_NODE:-$CLUSTER-worker}
    FAKE_GPUS=1
else
    [ -n "${GPU_NODE:-}" ] || fail "set GPU_NODE to a node with GPUs when using KUBE_CONTEXT"
    FAKE_GPUS=0
fi
K() { kubectl --context "$KUBE_CONTEXT" "$@"; }

cleanup() {
    if [ -n "${PF_PID:-}" ]; then kill "$PF_PID" 2>/dev/null || true; fi
    if [ "${KEEP:-0}" != 1 ]; then
        if [ "$FAKE_GPUS" = 1 ]; then kind delete cluster --name "$CLUSTER" || true
        else helm --kube-context "$KUBE_CONTEXT" uninstall "$RELEASE" -n "$NS" || true; K delete clusterrolebinding gpulease-node-reader || true; fi
    fi
}
trap cleanup EXIT

step "images ($TAG)"
docker build -f deploy/Dockerfile -t "${PREFIX}gpulease-hub:$TAG" .
docker build -f deploy/Dockerfile.singleuser --build-arg BASE_IMAGE="quay.io/jupyterhub/k8s-singleuser-sample:$CHART_VERSION" \
    -t "${PREFIX}gpulease-singleuser:$TAG" .
if [ "$FAKE_GPUS" = 1 ]; then
    kind load docker-image --name "$CLUSTER" "gpulease-hub:$TAG" "gpulease-singleuser:$TAG"
else
    docker push "${PREFIX}gpulease-hub:$TAG"; docker push "${PREFIX}gpulease-singleuser:$TAG"
fi

if [ "$FAKE_GPUS" = 1 ]; then
    step "pretend GPUs on $GPU_NODE: GFD labels, nvidia.com/gpu=4 in the node status, the GPU taint"
    K label node "$GPU_NODE" --overwrite nvidia.com/gpu.present=true nvidia.com/gpu.product=NVIDIA-L4 \
        nvidia.com/gpu.count=4 nvidia.com/gpu.memory=23034 nvidia.com/gpu.replicas=1 nvidia.com/gpu.sharing-strategy=none
    K patch node "$GPU_NODE" --subresource=status --type=json \
        -p '[{"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"4"}]'
    K taint node "$GPU_NODE" nvidia.com/gpu=present:NoSchedule --overwrite
fi

step "RBAC and the chart (release $RELEASE in namespace $NS)"
K create namespace "$NS" --dry-run=client -o yaml | K apply -f -
sed "s/namespace: jhub/namespace: $NS/" deploy/rbac.yaml | K apply -n "$NS" -f -
OVERLAY=$(mktemp)
cat > "$OVERLAY" <<YAML
hub:
  image: {name: "${PREFIX}gpulease-hub", tag: "$TAG", pullPolicy: IfNotPresent}
  services:
    e2e-admin: {apiToken: "$ADMIN_TOKEN"}
  loadRoles:
    e2e-admin:
      scopes: ["admin:users", "admin:servers", "list:users", "read:users", "custom:gpulease:admin", "access:services!service=gpulease"]
      services: [e2e-admin]
  config:
    JupyterHub: {authenticator_class: dummy}
    Authenticator: {allow_all: true}
  extraFiles:
    gpulease-config:
      stringData: |
        c = get_config()  # noqa
        c.GPULeaseBroker.db_url = "sqlite:////srv/jupyterhub/gpulease.sqlite"
        c.GPULeaseBroker.device_backend = "kubernetes"
        c.GPULeaseBroker.devices = {"label_selector": "nvidia.com/gpu.present=true", "refresh_s": 5}
        c.GPULeaseBroker.stop_servers_on_end = True
singleuser:
  image: {name: "${PREFIX}gpulease-singleuser", tag: "$TAG", pullPolicy: IfNotPresent}
  storage: {type: none}
proxy:
  service: {type: ClusterIP}
cull: {enabled: false}
prePuller: {hook: {enabled: false}, continuous: {enabled: false}}
scheduling: {userScheduler: {enabled: false}}
YAML
helm --kube-context "$KUBE_CONTEXT" upgrade --install "$RELEASE" jupyterhub --repo https://hub.jupyter.org/helm-chart/ \
    --version "$CHART_VERSION" -n "$NS" -f deploy/z2jh-values.yaml -f "$OVERLAY" --wait --timeout 10m
sed "s/namespace: jhub/namespace: $NS/" deploy/rbac.yaml | K apply -n "$NS" -f -   # the hub's SA exists now

step "port-forward to the proxy"
K -n "$NS" port-forward svc/proxy-public "$PF_PORT:80" >/dev/null 2>&1 &
PF_PID=$!
for _ in $(seq 60); do curl -fs "$HUB/hub/api" >/dev/null && break; sleep 1; done
curl -fs "$HUB/hub/api" >/dev/null || fail "the hub does not answer through the proxy"

api() {  # METHOD PATH [JSON] -> body; fails on HTTP errors
    curl -fsS -X "$1" -H "Authorization: token $ADMIN_TOKEN" -H "Content-Type: application/json" ${3:+-d "$3"} "$HUB$2"
}
jget() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {'d': d}))" "$1"; }
wait_until() {  # SECONDS DESCRIPTION COMMAND...
    local t=$1 what=$2; shift 2
    for _ in $(seq "$t"); do if "$@" >/dev/null 2>&1; then return 0; fi; sleep 1; done
    fail "$what (waited $t s)"
}

step "1. the broker's pool is $GPU_NODE's GPUs"
wait_until 120 "the broker did not answer" api GET /services/gpulease/api/pool
POOL=$(api GET /services/gpulease/api/pool)
N=$(echo "$POOL" | jget "len([x for x in d['devices'] if x['node'] == '$GPU_NODE'])")
MODEL=$(echo "$POOL" | jget "sorted({x['model'] for x in d['devices'] if x['node'] == '$GPU_NODE'})[0]")
echo "pool: $N GPU(s) of model $MODEL on $GPU_NODE"
[ "$N" -ge 1 ] || fail "no GPU of $GPU_NODE in the broker's pool: $POOL"

step "2. alice spawns with one GPU: a lease, and a pod pinned to the leased node"
api POST /hub/api/users/alice >/dev/null 2>&1 || true
api POST /hub/api/users/bob >/dev/null 2>&1 || true
api POST /hub/api/users/alice/server "{\"gpus\": 1, \"model\": \"$MODEL\"}" >/dev/null
ready() { api GET "/hub/api/users/$1" | jget "d['servers'][''].get('ready')" | grep -qx True; }
wait_until 300 "alice's server did not become ready" ready alice
LEASE=$(api GET "/services/gpulease/api/leases?user=alice" | jget "[x for x in d['leases'] if x['state'] == 'active'][0]")
LEASE_ID=$(echo "$LEASE" | python3 -c "import ast,sys; print(ast.literal_eval(sys.stdin.read())['id'])")
LEASE_NODE=$(echo "$LEASE" | python3 -c "import ast,sys; print(ast.literal_eval(sys.stdin.read())['placement']['node'])")
POD=$(K -n "$NS" get pods -l hub.jupyter.org/username=alice -o jsonpath='{.items[0].metadata.name}')
POD_JSON=$(K -n "$NS" get pod "$POD" -o json)
[ "$(echo "$POD_JSON" | jget "d['spec']['nodeName']")" = "$LEASE_NODE" ] || fail "alice's pod is not on the leased node $LEASE_NODE"
[ "$(echo "$POD_JSON" | jget "d['spec']['containers'][0]['resources']['limits'].get('nvidia.com/gpu')")" = 1 ] || fail "alice's pod does not ask for nvidia.com/gpu: 1"
echo "$POD_JSON" | jget "[e['value'] for e in d['spec']['containers'][0]['env'] if e['name'] == 'GPULEASE_LEASE_ID'][0]" | grep -qx "$LEASE_ID" \
    || fail "alice's pod does not carry its lease id"
echo "alice: lease $LEASE_ID on $LEASE_NODE, pod $POD"

step "3. bob asks for every GPU of the node: he waits; alice stops; bob gets them"
api POST /hub/api/users/bob/server "{\"gpus\": $N, \"model\": \"$MODEL\"}" >/dev/null || true
queued() { api GET "/services/gpulease/api/leases?user=bob" | jget "[x['state'] for x in d['leases']]" | grep -q queued; }
wait_until 60 "bob's lease is not queued" queued
[ -z "$(K -n "$NS" get pods -l hub.jupyter.org/username=bob -o name)" ] || fail "bob got a pod while his lease waits"
api DELETE /hub/api/users/alice/server >/dev/null
released() { api GET "/services/gpulease/api/leases/$LEASE_ID" | jget "d['state']" | grep -qx released; }
wait_until 120 "alice's lease was not released when her server stopped" released
wait_until 300 "bob's server did not start on the freed GPUs" ready bob

step "4. cordoning $GPU_NODE marks its GPUs unhealthy in the broker"
K cordon "$GPU_NODE"
unhealthy() { api GET /services/gpulease/api/pool | jget "all(not x.get('healthy', True) for x in d['devices'] if x['node'] == '$GPU_NODE')" | grep -qx True; }
wait_until 60 "the broker still counts $GPU_NODE's GPUs as healthy" unhealthy
K uncordon "$GPU_NODE"

step "5. stopping every server leaves no lease"
api DELETE /hub/api/users/bob/server >/dev/null
none_live() { api GET "/services/gpulease/api/leases?state=live" | jget "len(d['leases'])" | grep -qx 0; }
wait_until 120 "leases are left after every server stopped" none_live

printf '\nALL CHECKS PASSED\n'
