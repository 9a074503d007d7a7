#!/usr/bin/env bash
# Builds what the conformance runner (tests/harness/src/conformance.rs, `tensile-playground
# conformance`) needs, nothing installed into the system and nothing pulled from a container
# registry:
#   - e2e.test of the pinned Kubernetes release (the wrapper module beside this script pins the
#     same k8s.io/kubernetes as ../kubernetes), ginkgo (to run it in parallel), and the programs
#     of two test images, agnhost and nonewprivs: all from the Go module proxy;
#   - the e2e test images the node conformance tests use, made here as docker-archive tarballs
#     with their exact upstream names, for `ctr -n k8s.io images import` into the real node:
#       registry.k8s.io/e2e-test-images/agnhost:2.63.0 (also tagged :2.55)
#       registry.k8s.io/e2e-test-images/busybox:1.37.0-1
#       registry.k8s.io/e2e-test-images/nonroot:1.5
#       registry.k8s.io/e2e-test-images/nonewprivs:1.4
#       registry.k8s.io/pause:3.10.2
#     from Debian's busybox-static and bash-static (`apt-get download` into a private apt
#     state, ../lib.sh) and the programs above. /bin/sh is bash-static: Debian's busybox ash
#     drops environment variables whose names are not shell names, which upstream's images keep.
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/e2e-<k8s>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr (one line per binary with its
# time); the last line on stdout is the directory (bin/, images/, versions).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log_prefix="e2e"
# shellcheck source=../lib.sh
. "$here/../lib.sh"
packages=(busybox-static bash-static)
k8s_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }
  $1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2 }' "$here/go.mod" | head -n 1)
[ -n "$k8s_version" ] || { echo "e2e/build.sh: cannot read the Kubernetes version" >&2; exit 1; }
pause_dir="$here/../real-node/pause"
key=$( (cat "$here/build.sh" "$here/../lib.sh" "$here"/go.{mod,sum} "$here"/*.go "$pause_dir"/go.mod \
  "$pause_dir"/*.go; echo "${packages[*]}") | sha256sum | cut -c1-12)
cache_root=$(k8s_cache_root)
out="$cache_root/e2e-$k8s_version-$key"

if [ -f "$out/.complete" ]; then
  echo "e2e: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-e2e.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "e2e: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
for tool in go apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "e2e/build.sh: $tool is required (not on PATH)" >&2; exit 1; }
done

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/images" "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
# -trimpath: the Go build cache of ../build.sh (which builds with it) is reused.
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0

minor=${k8s_version#v1.}
minor=${minor%%.*}
kver="-X k8s.io/component-base/version.gitVersion=$k8s_version \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=$minor \
 -X k8s.io/client-go/pkg/version.gitTreeState=clean"
step "building e2e.test $k8s_version" \
  env -C "$here" go test -c -ldflags "-s -w $kver" -o "$tmp/bin/e2e.test" k8s.io/kubernetes/test/e2e
step "building ginkgo" \
  env -C "$here" go build -ldflags "-s -w" -o "$tmp/bin/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
step "building agnhost" \
  env -C "$here" go build -ldflags "-s -w" -o "$tmp/bin/agnhost" k8s.io/kubernetes/test/images/agnhost
step "building nonewprivs (nnp)" \
  env -C "$here" go build -ldflags "-s -w" -o "$tmp/bin/nonewprivs" k8s.io/kubernetes/test/images/nonewprivs
step "building the sandbox program (pause)" \
  env -C "$pause_dir" go build -ldflags "-s -w" -o "$tmp/work/pause" .

root="$tmp/work/root"
apt_fetch_unpack "$tmp/work" "$root" "$tmp/work/deb-versions" "${packages[@]}"

t0=$(date +%s)
# What the upstream images (Alpine or busybox based) have and the tests use: busybox's applets,
# bash as /bin/bash and /bin/sh, Alpine's PATH.
path_env='"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"'
base_rootfs() { # rootfs
  busybox_rootfs "$root/bin/busybox" "$1"
  install -m 0755 "$root/bin/bash-static" "$1/bin/bash"
  ln -sf bash "$1/bin/sh"
  mkdir -p "$1"/usr/{bin,sbin,local/bin} "$1/sbin" "$1/var" "$1/home"
  echo 'nobody:x:65534:65534:nobody:/:/bin/false' >>"$1/etc/passwd"
  echo 'nobody:x:65534:' >>"$1/etc/group"
}

busybox_root="$tmp/work/busybox-root"
base_rootfs "$busybox_root"
make_image_config "$busybox_root" registry.k8s.io/e2e-test-images/busybox:1.37.0-1 \
  "{\"Cmd\":[\"sh\"],\"Env\":[$path_env],\"WorkingDir\":\"/\"}" "$tmp/images/busybox.tar"
make_image_config "$busybox_root" registry.k8s.io/e2e-test-images/nonroot:1.5 \
  "{\"Cmd\":[\"sh\"],\"Env\":[$path_env],\"User\":\"1234\",\"WorkingDir\":\"/\"}" "$tmp/images/nonroot.tar"

nnp_root="$tmp/work/nonewprivs-root"
base_rootfs "$nnp_root"
install -m 4755 "$tmp/bin/nonewprivs" "$nnp_root/usr/local/bin/nnp"
make_image_config "$nnp_root" registry.k8s.io/e2e-test-images/nonewprivs:1.4 \
  "{\"Cmd\":[\"nnp\"],\"Env\":[$path_env],\"WorkingDir\":\"/\"}" "$tmp/images/nonewprivs.tar"

agnhost_root="$tmp/work/agnhost-root"
base_rootfs "$agnhost_root"
install -m 0755 "$tmp/bin/agnhost" "$agnhost_root/agnhost"
ln -s agnhost "$agnhost_root/agnhost-2"
kdir=$(env -C "$here" go list -m -f '{{.Dir}}' k8s.io/kubernetes)
install -m 0644 "$kdir"/test/images/agnhost/porter/localhost.{crt,key} "$agnhost_root/"
mkdir -p "$agnhost_root/uploads"
echo 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh' >>"$agnhost_root/etc/passwd"
{
  echo 'user-defined-in-image:x:1000:'
  echo 'group-defined-in-image:x:50000:user-defined-in-image'
} >>"$agnhost_root/etc/group"
mkdir -p "$agnhost_root/home/user-defined-in-image"
# curl (some tests run it inside agnhost): this system's, with the libraries it links.
if curl_bin=$(command -v curl); then
  install -m 0755 "$curl_bin" "$agnhost_root/usr/bin/curl"
  for lib in $(ldd "$curl_bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
    cp -L --parents "$lib" "$agnhost_root/"
  done
  curl_note="curl from this system ($("$curl_bin" --version | head -n 1 | cut -d' ' -f1,2))"
else
  echo "e2e: no curl on this system: the agnhost image has none" >&2
  curl_note="no curl"
fi
make_image_config "$agnhost_root" \
  "registry.k8s.io/e2e-test-images/agnhost:2.63.0\",\"registry.k8s.io/e2e-test-images/agnhost:2.55" \
  "{\"Entrypoint\":[\"/agnhost\"],\"Cmd\":[\"pause\"],\"Env\":[$path_env],\"WorkingDir\":\"/\"}" \
  "$tmp/images/agnhost.tar"

pause_root="$tmp/work/pause-root"
mkdir -p "$pause_root"
install -m 0755 "$tmp/work/pause" "$pause_root/pause"
make_image_config "$pause_root" registry.k8s.io/pause:3.10.2 \
  '{"Entrypoint":["/pause"],"WorkingDir":"/"}' "$tmp/images/pause.tar"
echo "e2e: images made in $(($(date +%s) - t0))s" >&2

{
  echo "kubernetes=$k8s_version"
  echo "ginkgo=$(env -C "$here" go list -m -f '{{.Version}}' github.com/onsi/ginkgo/v2)"
  cat "$tmp/work/deb-versions"
  echo "agnhost-image=registry.k8s.io/e2e-test-images/agnhost:2.63.0,2.55 ($curl_note)"
  echo "busybox-image=registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
  echo "nonroot-image=registry.k8s.io/e2e-test-images/nonroot:1.5"
  echo "nonewprivs-image=registry.k8s.io/e2e-test-images/nonewprivs:1.4"
  echo "pause-image=registry.k8s.io/pause:3.10.2"
} >"$tmp/versions"
rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "e2e: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
