#!/usr/bin/env bash
# Install splitserve on the Kubernetes cluster your kubeconfig points at, run an example
# InferenceDeployment, send a request through its router, scale it, and uninstall.
#
#   deploy/install-on-cluster.sh all deploy/examples/llama-8b-disaggregated.yaml   # every step below
#   deploy/install-on-cluster.sh install                 # CRDs + Helm chart, waits for the operator
#   deploy/install-on-cluster.sh deploy FILE             # kubectl apply + wait for condition Ready
#   deploy/install-on-cluster.sh request NAME            # port-forward the router + one completion
#   deploy/install-on-cluster.sh scale NAME REPLICAS     # decode replicas via kubectl patch
#   deploy/install-on-cluster.sh uninstall [NAME...]     # delete the InferenceDeployments, the release
#   deploy/install-on-cluster.sh kind                    # local kind cluster with locally built images
#
# Settings (environment): KUBE_CONTEXT (default: current context), NAMESPACE (where the example
# runs, default "default"), OPERATOR_NAMESPACE (default "splitserve-system"), RELEASE (default
# "splitserve"), READY_TIMEOUT (default 30m: model download + load), HELM_ARGS (extra arguments for
# helm, e.g. "--set watchNamespaces={default}"), PURGE_CRDS=1 (uninstall also deletes the CRDs and
# with them every InferenceDeployment), DRY_RUN=1 (print the commands, touch nothing).
# Needs kubectl >= 1.29, helm >= 3.13 (Helm 4 works) and curl. See docs/cluster-guide.md.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART_DIR="${REPO_ROOT}/charts/splitserve"
NAMESPACE="${NAMESPACE:-default}"
OPERATOR_NAMESPACE="${OPERATOR_NAMESPACE:-splitserve-system}"
RELEASE="${RELEASE:-splitserve}"
READY_TIMEOUT="${READY_TIMEOUT:-30m}"
HELM_ARGS="${HELM_ARGS:-}"
LOCAL_PORT="${LOCAL_PORT:-18000}"
DRY_RUN="${DRY_RUN:-0}"
PURGE_CRDS="${PURGE_CRDS:-0}"

KUBECTL=(kubectl)
HELM=(helm)
if [[ -n "${KUBE_CONTEXT:-}" ]]; then
  KUBECTL+=(--context "${KUBE_CONTEXT}")
  HELM+=(--kube-context "${KUBE_CONTEXT}")
fi

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Runs a command, or only prints it when DRY_RUN=1.
run() {
  if [[ "${DRY_RUN}" == "1" ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

need() {
  [[ "${DRY_RUN}" == "1" ]] && return 0
  command -v "$1" > /dev/null || die "$1 not found in PATH ($2)"
}

# metadata.name of the first document in an InferenceDeployment file.
name_of() {
  awk '/^metadata:/ {in_meta = 1; next} in_meta && /^[^ ]/ {in_meta = 0} in_meta && /^  name:/ {print $2; exit}' "$1"
}

cmd_install() {
  need kubectl "https://kubernetes.io/docs/tasks/tools/"
  need helm "https://helm.sh/docs/intro/install/"
  if [[ "${DRY_RUN}" != "1" ]]; then
    say "cluster: $("${KUBECTL[@]}" config current-context) ($("${KUBECTL[@]}" version -o json | awk -F'"' '/gitVersion/ {v = $4} END {print v}'))"
  fi
  say "CRDs (server-side apply: Helm installs crds/ only once and never upgrades them)"
  run "${KUBECTL[@]}" apply --server-side --force-conflicts -f "${CHART_DIR}/crds/"
  run "${KUBECTL[@]}" wait --for=condition=Established --timeout=60s crd/inferencedeployments.splitserve.io
  say "operator: helm upgrade --install ${RELEASE} in ${OPERATOR_NAMESPACE}"
  # shellcheck disable=SC2086  # HELM_ARGS is a list of words on purpose
  run "${HELM[@]}" upgrade --install "${RELEASE}" "${CHART_DIR}" \
    --namespace "${OPERATOR_NAMESPACE}" --create-namespace --skip-crds --wait --timeout 5m ${HELM_ARGS}
  run "${KUBECTL[@]}" -n "${OPERATOR_NAMESPACE}" wait --for=condition=Available deployment \
    -l "app.kubernetes.io/instance=${RELEASE},app.kubernetes.io/component=operator" --timeout=5m
}

cmd_deploy() {
  local file="${1:?usage: deploy FILE}"
  [[ -f "${file}" ]] || die "no such file: ${file}"
  local name
  name="$(name_of "${file}")"
  [[ -n "${name}" ]] || die "${file} has no metadata.name"
  say "InferenceDeployment ${NAMESPACE}/${name} from ${file}"
  run "${KUBECTL[@]}" apply -n "${NAMESPACE}" -f "${file}"
  say "waiting up to ${READY_TIMEOUT} for Ready (model download and load take most of it)"
  if ! run "${KUBECTL[@]}" wait -n "${NAMESPACE}" --for=condition=Ready "idep/${name}" --timeout="${READY_TIMEOUT}"; then
    "${KUBECTL[@]}" get -n "${NAMESPACE}" "idep/${name}" -o wide >&2 || true
    "${KUBECTL[@]}" describe -n "${NAMESPACE}" "idep/${name}" >&2 || true
    die "${name} did not become Ready; the conditions above say which part fails"
  fi
  run "${KUBECTL[@]}" get -n "${NAMESPACE}" "idep/${name}" -o wide
}

cmd_request() {
  local name="${1:?usage: request NAME}"
  need curl "apt-get install curl"
  local model="MODEL" port="8000"
  if [[ "${DRY_RUN}" != "1" ]]; then
    model="$("${KUBECTL[@]}" get -n "${NAMESPACE}" "idep/${name}" -o jsonpath='{.spec.model.name}')"
    port="$("${KUBECTL[@]}" get -n "${NAMESPACE}" "idep/${name}" -o jsonpath='{.spec.router.port}')"
    port="${port:-8000}"
  fi
  say "port-forward svc/${name}-router ${LOCAL_PORT}:${port}"
  if [[ "${DRY_RUN}" == "1" ]]; then
    run "${KUBECTL[@]}" port-forward -n "${NAMESPACE}" "svc/${name}-router" "${LOCAL_PORT}:${port}"
  else
    "${KUBECTL[@]}" port-forward -n "${NAMESPACE}" "svc/${name}-router" "${LOCAL_PORT}:${port}" > /dev/null 2>&1 &
    local forward_pid=$!
    trap 'kill "${forward_pid}" 2> /dev/null || true' RETURN
    local _
    for _ in $(seq 1 50); do
      curl -fsS "http://127.0.0.1:${LOCAL_PORT}/v1/models" > /dev/null 2>&1 && break
      sleep 0.2
    done
  fi
  run curl -fsS "http://127.0.0.1:${LOCAL_PORT}/v1/models"
  run curl -fsS "http://127.0.0.1:${LOCAL_PORT}/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"${model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
  echo
}

cmd_scale() {
  local name="${1:?usage: scale NAME REPLICAS}" replicas="${2:?usage: scale NAME REPLICAS}"
  [[ "${replicas}" =~ ^[0-9]+$ ]] || die "REPLICAS must be a number, got ${replicas}"
  say "decode replicas of ${name} -> ${replicas}"
  run "${KUBECTL[@]}" patch -n "${NAMESPACE}" "idep/${name}" --type merge -p "{\"spec\":{\"decode\":{\"replicas\":${replicas}}}}"
  run "${KUBECTL[@]}" wait -n "${NAMESPACE}" --for=jsonpath='{.status.decode.readyReplicas}'="${replicas}" \
    "idep/${name}" --timeout="${READY_TIMEOUT}"
  run "${KUBECTL[@]}" wait -n "${NAMESPACE}" --for=condition=Ready "idep/${name}" --timeout="${READY_TIMEOUT}"
  run "${KUBECTL[@]}" get -n "${NAMESPACE}" "idep/${name}" -o wide
}

cmd_uninstall() {
  local name
  for name in "$@"; do
    say "deleting InferenceDeployment ${NAMESPACE}/${name} (its children go with it)"
    run "${KUBECTL[@]}" delete -n "${NAMESPACE}" "idep/${name}" --ignore-not-found --wait --timeout=5m
  done
  say "helm uninstall ${RELEASE}"
  run "${HELM[@]}" uninstall "${RELEASE}" --namespace "${OPERATOR_NAMESPACE}" --wait --ignore-not-found
  if [[ "${PURGE_CRDS}" == "1" ]]; then
    say "deleting the CRDs: every remaining InferenceDeployment in the cluster goes with them"
    run "${KUBECTL[@]}" delete -f "${CHART_DIR}/crds/" --ignore-not-found
  else
    say "CRDs kept (Helm never deletes them); PURGE_CRDS=1 removes them"
  fi
}

# A kind cluster (CPU only) with the images built here and loaded into it; then use
# KUBE_CONTEXT=kind-${KIND_CLUSTER} for the other steps.
cmd_kind() {
  local cluster="${KIND_CLUSTER:-splitserve}"
  need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
  need docker "a Docker engine builds the images"
  say "kind cluster ${cluster}"
  if [[ "${DRY_RUN}" == "1" ]] || ! kind get clusters 2> /dev/null | grep -qx "${cluster}"; then
    run kind create cluster --name "${cluster}" --wait 2m
  fi
  say "images: build and load into kind (the worker image needs VLLM_IMAGE=<a vLLM CPU image> to run on CPU)"
  run make -C "${REPO_ROOT}/deploy/images" images kind-load KIND_CLUSTER="${cluster}" ${VLLM_IMAGE:+VLLM_IMAGE="${VLLM_IMAGE}"}
  say "next: KUBE_CONTEXT=kind-${cluster} $0 install"
}

cmd_all() {
  local file="${1:?usage: all FILE}"
  local name
  name="$(name_of "${file}")"
  cmd_install
  cmd_deploy "${file}"
  cmd_request "${name}"
  cmd_scale "${name}" 2
  cmd_request "${name}"
  cmd_uninstall "${name}"
}

main() {
  local command="${1:-}"
  shift || true
  case "${command}" in
    install) cmd_install "$@" ;;
    deploy) cmd_deploy "$@" ;;
    request) cmd_request "$@" ;;
    scale) cmd_scale "$@" ;;
    uninstall) cmd_uninstall "$@" ;;
    all) cmd_all "$@" ;;
    kind) cmd_kind "$@" ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
  esac
}

main "$@"
