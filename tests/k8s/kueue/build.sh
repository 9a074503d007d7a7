#!/usr/bin/env bash
# Builds the pinned Kueue release's manager from the Go module proxy, with the wrapper module
# beside this script, and copies the same module's CRDs and webhook manifests, for the
# batch-bursting tests (tests/kueue.rs, tests/harness/src/kueue.rs). The harness runs the
# manager as a host process against a harness cluster and turns the webhook manifests and the
# CRDs' conversion webhooks (service references) into URL-based ones.
# One line of cmd/kueue/main.go differs from the release: that file (the only one of package
# main) is built from a patched copy in a copy of the wrapper module, every other package as
# the proxy serves it (go.sum-checked). With internal certificate management off, v0.17.0
# reads its metrics serving certificate from the fixed /etc/kueue/metrics/certs (a Secret
# mounted in its pod) and exits without it; the copy takes that directory from
# TENSILE_KUEUE_METRICS_CERT_DIR when set, so a host process serves a certificate the harness
# issued in its own state directory.
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/kueue-<version>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr (one line with the build's
# time); the last line on stdout is the directory holding bin/kueue, crds.yaml,
# webhooks.yaml, webhook-kustomization.yaml, conversion.yaml and versions.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_prefix="kueue"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
module=sigs.k8s.io/kueue
version=$(awk -v m="$module" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
  "$here/go.mod" | head -n 1)
[ -n "$version" ] || { echo "kueue/build.sh: cannot read the Kueue version from go.mod" >&2; exit 1; }
key=$(cat "$here/build.sh" "$here"/go.{mod,sum} "$here"/*.go | sha256sum | cut -c1-12)
cache_root=$(k8s_cache_root)
out="$cache_root/kueue-$version-$key"

if [ -f "$out/.complete" ]; then
  echo "kueue: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-kueue.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "kueue: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "kueue/build.sh: Go is required to build Kueue (go not on PATH)" >&2; exit 1; }

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin"
trap 'rm -rf "$tmp"' EXIT
# -trimpath: the Go build cache of ../build.sh (which builds with it) is reused.
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0
# The module's source first: on a machine whose module cache is empty, `go list -m` names
# no directory until it is downloaded.
env -C "$here" go mod download "$module"
module_dir=$(env -C "$here" go list -m -f '{{.Dir}}' "$module")
main_go="$module_dir/cmd/kueue/main.go"
fixed='metricsCertPath := "/etc/kueue/metrics/certs"'
[ "$(grep -cF "$fixed" "$main_go")" = 1 ] ||
  { echo "kueue/build.sh: $main_go does not set the metrics certificate path once as expected" >&2; exit 1; }
src="$tmp/src"
mkdir -p "$src/cmd/kueue"
install -m 0644 "$here/go.mod" "$here/go.sum" "$src/"
sed "s|$fixed|$fixed; if dir := os.Getenv(\"TENSILE_KUEUE_METRICS_CERT_DIR\"); dir != \"\" { metricsCertPath = dir }|" \
  "$main_go" >"$src/cmd/kueue/main.go"
step "building the Kueue manager $version" \
  env -C "$src" go build -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
  -o "$tmp/bin/kueue" ./cmd/kueue
rm -rf "$src"
# The CRDs, the webhooks and the CRDs' conversion webhooks ship in the module
# (config/components/), so they match the manager's API types and its webhook server's
# paths. The conversion patches are those its kustomization applies (uncommented lines).
for crd in "$module_dir"/config/components/crd/bases/*.yaml; do
  printf -- '---\n'
  cat "$crd"
done >"$tmp/crds.yaml"
install -m 0644 "$module_dir/config/components/webhook/manifests.yaml" "$tmp/webhooks.yaml"
# Its patches: the namespace selectors of the pod, deployment and statefulset webhooks.
install -m 0644 "$module_dir/config/components/webhook/kustomization.yaml" "$tmp/webhook-kustomization.yaml"
crd_dir="$module_dir/config/components/crd"
for patch in $(sed -n 's|^- path: \(patches/webhook_in_[a-z]*\.yaml\)$|\1|p' "$crd_dir/kustomization.yaml"); do
  printf -- '---\n'
  cat "$crd_dir/$patch"
done >"$tmp/conversion.yaml"
grep -q 'name: workloads.kueue.x-k8s.io' "$tmp/conversion.yaml" ||
  { echo "kueue/build.sh: no conversion webhook patches found in $crd_dir/kustomization.yaml" >&2; exit 1; }
chmod 0644 "$tmp/crds.yaml" "$tmp/conversion.yaml"
echo "kueue=$version" >"$tmp/versions"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "kueue: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
