#!/usr/bin/env bash
# Create the Secret aenv-api-key (key AENV_API_KEY) that every aenv node reads, with a
# fresh random key of the server's own form (e2b_ + 40 hex digits). An existing Secret
# is kept: replacing it would lock out every client holding the old key.
#   deploy/k8s/create-api-key.sh [NAMESPACE]           create it in the cluster
#   deploy/k8s/create-api-key.sh --print [NAMESPACE]   print the manifest, touch nothing
set -euo pipefail
print=0
if [ "${1:-}" = --print ]; then print=1; shift; fi
ns=${1:-aenv-system}
key="e2b_$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')"
manifest() {
  kubectl create secret generic aenv-api-key --namespace "$ns" \
    --from-literal=AENV_API_KEY="$key" --dry-run=client -o yaml
}
if [ "$print" = 1 ]; then
  manifest
  exit 0
fi
if kubectl get secret aenv-api-key --namespace "$ns" >/dev/null 2>&1; then
  echo "aenv-api-key already exists in $ns; kept"
else
  kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
  manifest | kubectl apply -f -
  echo "created aenv-api-key in $ns"
fi
echo "read it: kubectl -n $ns get secret aenv-api-key -o jsonpath='{.data.AENV_API_KEY}' | base64 -d"
