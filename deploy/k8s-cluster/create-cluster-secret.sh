#!/usr/bin/env bash
# Create the Secret aenv-cluster-secret (key AENV_CLUSTER_SECRET) that every node and
# gateway reads: a fresh random secret of 48 hex digits (aenv wants 32+ characters). An
# existing Secret is kept: nodes and gateways must all hold the same one.
#   deploy/k8s-cluster/create-cluster-secret.sh [NAMESPACE]           create it
#   deploy/k8s-cluster/create-cluster-secret.sh --print [NAMESPACE]   print it, touch nothing
set -euo pipefail
print=0
if [ "${1:-}" = --print ]; then print=1; shift; fi
ns=${1:-aenv-system}
secret="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
manifest() {
  kubectl create secret generic aenv-cluster-secret --namespace "$ns" \
    --from-literal=AENV_CLUSTER_SECRET="$secret" --dry-run=client -o yaml
}
if [ "$print" = 1 ]; then
  manifest
  exit 0
fi
if kubectl get secret aenv-cluster-secret --namespace "$ns" >/dev/null 2>&1; then
  echo "aenv-cluster-secret already exists in $ns; kept"
else
  kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
  manifest | kubectl apply -f -
  echo "created aenv-cluster-secret in $ns"
fi
