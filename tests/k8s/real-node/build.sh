#!/usr/bin/env bash
# Builds what the harness's real node needs (tests/harness/src/real_node.rs), nothing
# installed into the system and nothing pulled from a container registry:
#   - kubelet of the pinned Kubernetes release, from the Go module proxy (the wrapper module
#     in ./kubelet pins the same k8s.io/kubernetes as ../kubernetes);
#   - containerd (with its runc shim and ctr), runc, the CNI plugins (bridge, host-local,
#     loopback) and busybox-static: Debian's packages, fetched with `apt-get download`
#     (into a private apt state, so the system's package lists are not touched) and
#     unpacked with `dpkg -x`;
#   - two images, made here as docker-archive tarballs for `ctr images import`:
#     tensile.local/pause:1 (./pause, a static Go program: the sandbox image) and
#     tensile.local/busybox:1.35.0 (busybox-static and its applet links).
# Idempotent: the result is cached under
#   ${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tensile/k8s}/real-node-<k8s>-<hash>/
# and a warm run only checks the stamp. Progress goes to stderr; the last line on stdout is
# the directory (bin/, cni/, images/, versions), which the harness reads.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
packages=(containerd runc containernetworking-plugins busybox-static)
k8s_version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }' "$here/kubelet/go.mod")
[ -n "$k8s_version" ] || { echo "real-node/build.sh: cannot read the kubelet version" >&2; exit 1; }
key=$( (cat "$here/build.sh" "$here"/kubelet/go.{mod,sum} "$here"/kubelet/*.go "$here"/pause/go.mod \
  "$here"/pause/*.go; echo "${packages[*]}") | sha256sum | cut -c1-12)
cache_root=${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile/k8s}
out="$cache_root/real-node-$k8s_version-$key"

if [ -f "$out/.complete" ]; then
  echo "real node: cached in $out" >&2
  echo "$out"
  exit 0
fi
mkdir -p "$cache_root"
exec 9>"$cache_root/.build-real-node.lock"
flock 9
if [ -f "$out/.complete" ]; then
  echo "real node: built by a concurrent run in $out" >&2
  echo "$out"
  exit 0
fi
for tool in go apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "real-node/build.sh: $tool is required (not on PATH)" >&2; exit 1; }
done

start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/cni" "$tmp/images" "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
export GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
export CGO_ENABLED=0

step() { # name, then the command
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "real node: $name ..." >&2
  "$@" >&2
  echo "real node: $name done in $(($(date +%s) - t0))s" >&2
}

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
step "building kubelet $k8s_version" \
  env -C "$here/kubelet" go build -ldflags "-s -w $kver" -o "$tmp/bin/kubelet" k8s.io/kubernetes/cmd/kubelet
step "building the sandbox program (pause)" \
  env -C "$here/pause" go build -ldflags "-s -w" -o "$tmp/work/pause" .

# Debian's packages, downloaded with a private apt state (lists, cache), so neither the
# system's package lists nor its installed packages change.
apt_dir="$tmp/work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$tmp/work/debs"
apt_opts=(-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir"
  -o "Dir::Cache::archives=$apt_dir/archives" -o Debug::NoLocking=1 -o APT::Sandbox::User=root -q)
step "apt-get update (private lists)" apt-get "${apt_opts[@]}" update
step "apt-get download ${packages[*]}" \
  env -C "$tmp/work/debs" apt-get "${apt_opts[@]}" download "${packages[@]}"
root="$tmp/work/root"
for deb in "$tmp"/work/debs/*.deb; do
  dpkg -x "$deb" "$root"
  dpkg-deb -f "$deb" Package Version | paste -sd= | sed 's/=Version: /=/; s/^Package: //' >>"$tmp/work/deb-versions"
done
install -m 0755 "$root"/usr/bin/{containerd,containerd-shim-runc-v2,ctr} "$root/usr/sbin/runc" "$tmp/bin/"
install -m 0755 "$root"/usr/lib/cni/{bridge,host-local,loopback} "$tmp/cni/"
# runc links libseccomp (Debian's runc is built with seccomp); everything else is static or
# needs only libc.
if ldd "$tmp/bin/runc" | grep -q 'not found'; then
  echo "real-node/build.sh: runc needs a library this system lacks:" >&2
  ldd "$tmp/bin/runc" >&2
  echo "(install Debian's libseccomp2)" >&2
  exit 1
fi

# A docker-archive image (one layer) of a directory: ctr images import reads it.
make_image() { # rootfs, name, entrypoint (JSON), out
  local rootfs=$1 name=$2 entrypoint=$3 out=$4 w diff config
  w=$(mktemp -d "$tmp/work/image.XXXXXX")
  tar -C "$rootfs" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$w/layer.tar" .
  diff=$(sha256sum "$w/layer.tar" | cut -d' ' -f1)
  mkdir "$w/$diff"
  mv "$w/layer.tar" "$w/$diff/layer.tar"
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":%s,"Env":["PATH=/bin"],"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$entrypoint" "$diff" >"$w/config.json"
  config=$(sha256sum "$w/config.json" | cut -d' ' -f1)
  mv "$w/config.json" "$w/$config.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config" "$name" "$diff" \
    >"$w/manifest.json"
  tar -C "$w" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" manifest.json "$config.json" "$diff"
}
pause_root="$tmp/work/pause-root"
mkdir -p "$pause_root"
install -m 0755 "$tmp/work/pause" "$pause_root/pause"
make_image "$pause_root" tensile.local/pause:1 '["/pause"]' "$tmp/images/pause.tar"
busybox_root="$tmp/work/busybox-root"
mkdir -p "$busybox_root"/{bin,etc,root,tmp}
chmod 1777 "$busybox_root/tmp"
install -m 0755 "$root/bin/busybox" "$busybox_root/bin/busybox"
for applet in $("$root/bin/busybox" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$busybox_root/bin/$applet"
done
echo 'root:x:0:0:root:/root:/bin/sh' >"$busybox_root/etc/passwd"
echo 'root:x:0:' >"$busybox_root/etc/group"
busybox_version=$(awk -F= '$1 == "busybox-static" { print $2 }' "$tmp/work/deb-versions")
make_image "$busybox_root" tensile.local/busybox:1.35.0 '["/bin/sh"]' "$tmp/images/busybox.tar"

{
  echo "kubelet=$k8s_version"
  cat "$tmp/work/deb-versions"
  echo "pause-image=tensile.local/pause:1"
  echo "busybox-image=tensile.local/busybox:1.35.0 (busybox-static $busybox_version)"
} >"$tmp/versions"
rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
echo "real node: done in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
