#!/usr/bin/env bash
# Builds the pinned VerticalPodAutoscaler's updater from the Go module proxy, with the wrapper
# module beside this script, and copies the release's CRDs, for the in-place resize test
# (tests/vpa_in_place.rs): the updater in InPlaceOrRecreate mode resizes a pod through the
# pods/resize subresource. Neither the recommender nor the admission controller is built: the
# test writes the recommendation into the VPA's status itself, and the updater runs with
# --use-admission-controller-status=false.
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/vpa-<version>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr (one line with the build's
# time); the last line on stdout is the directory holding bin/vpa-updater, crds.yaml and
# versions.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_prefix="vpa"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
module=k8s.io/autoscaler/vertical-pod-autoscaler
version=$(awk -v m="$module" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
  "$here/go.mod" | head -n 1)
[ -n "$version" ] || { echo "vpa/build.sh: cannot read the VPA version from go.mod" >&2; exit 1; }
key=$(cat "$here/build.sh" "$here"/go.{mod,sum} "$here"/*.go | sha256sum | cut -c1-12)
cache_root=$(k8s_cache_root)
out="$cache_root/vpa-$version-$key"

if [ -f "$out/.complete" ]; then
  echo "vpa: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-vpa.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "vpa: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "vpa/build.sh: Go is required to build the VPA updater (go not on PATH)" >&2; exit 1; }

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin"
trap 'rm -rf "$tmp"' EXIT
# -trimpath: the Go build cache of ../build.sh (which builds with it) is reused.
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0
step "building the VPA updater $version" \
  env -C "$here" go build -ldflags "-s -w" -o "$tmp/bin/vpa-updater" "$module/pkg/updater"
# The CRDs ship in the module (deploy/), so they match the updater's API types.
module_dir=$(env -C "$here" go list -m -f '{{.Dir}}' "$module")
install -m 0644 "$module_dir/deploy/vpa-v1-crd-gen.yaml" "$tmp/crds.yaml"
echo "vertical-pod-autoscaler=$version" >"$tmp/versions"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "vpa: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
