#!/usr/bin/env bash
# Builds the pinned helm (v3) from the Go module proxy, with the wrapper module beside this
# script, for the chart's tests (tests/helm.rs) and for users without a helm of their own.
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/helm-<version>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr (one line with the build's
# time); the last line on stdout is the directory holding bin/helm and versions.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_prefix="helm"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
version=$(awk '$1 == "require" && $2 == "helm.sh/helm/v3" { print $3 }
  $1 == "helm.sh/helm/v3" && $2 ~ /^v/ { print $2 }' "$here/go.mod" | head -n 1)
[ -n "$version" ] || { echo "helm/build.sh: cannot read the helm version from go.mod" >&2; exit 1; }
key=$(cat "$here/build.sh" "$here"/go.{mod,sum} "$here"/*.go | sha256sum | cut -c1-12)
cache_root=$(k8s_cache_root)
out="$cache_root/helm-$version-$key"

if [ -f "$out/.complete" ]; then
  echo "helm: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-helm.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "helm: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "helm/build.sh: Go is required to build helm (go not on PATH)" >&2; exit 1; }

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin"
trap 'rm -rf "$tmp"' EXIT
# -trimpath: the Go build cache of ../build.sh (which builds with it) is reused.
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0
# As helm's Makefile does: the Kubernetes release `helm template` and `helm lint` assume
# (without a cluster) is the one of the client-go helm is built with (v0.N -> v1.N).
client_go=$(env -C "$here" go list -m -f '{{.Version}}' k8s.io/client-go)
k8s_minor=$(echo "$client_go" | cut -d. -f2)
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
step "building helm $version" \
  env -C "$here" go build -ldflags "$ldflags" -o "$tmp/bin/helm" helm.sh/helm/v3/cmd/helm
echo "helm=$version" >"$tmp/versions"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "helm: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
