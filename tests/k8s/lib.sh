# Shell functions shared by the build scripts beside this file (real-node/build.sh,
# e2e/build.sh): sourced, not run. Each caller sets `log_prefix` (its progress lines) first.

# The cache root every build script writes under.
k8s_cache_root() {
  echo "${TENSILE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile/k8s}"
}

# Runs a command with its output on stderr, timed: one line when it starts, one with its time.
step() { # name, then the command
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "$log_prefix: $name ..." >&2
  "$@" >&2
  echo "$log_prefix: $name done in $(($(date +%s) - t0))s" >&2
}

# Downloads Debian packages with a private apt state (lists, cache), so neither the system's
# package lists nor its installed packages change, and unpacks them all into one root with
# `dpkg -x`. Appends `package=version` lines to <versions>.
apt_fetch_unpack() { # work-dir, root, versions, packages...
  local work=$1 root=$2 versions=$3 deb
  shift 3
  local apt_dir="$work/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$work/debs" "$root"
  local apt_opts=(-o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir"
    -o "Dir::Cache::archives=$apt_dir/archives" -o Debug::NoLocking=1 -o APT::Sandbox::User=root -q)
  step "apt-get update (private lists)" apt-get "${apt_opts[@]}" update
  step "apt-get download $*" env -C "$work/debs" apt-get "${apt_opts[@]}" download "$@"
  for deb in "$work"/debs/*.deb; do
    dpkg -x "$deb" "$root"
    dpkg-deb -f "$deb" Package Version | paste -sd= | sed 's/=Version: /=/; s/^Package: //' >>"$versions"
  done
}

# A docker-archive image (one layer) of a directory, which `ctr images import` reads.
# <config> is the JSON object of the image's `config` (Entrypoint, Cmd, Env, User, ...).
# Every file is root's, but for the paths given as `uid:gid:path` (path relative to the root,
# e.g. 65532:65532:home/nonroot): those and what they hold are that owner's, appended to the
# layer after the rest (no chown on disk, so it works unprivileged).
make_image_config() { # rootfs, name, config (JSON object), out, [uid:gid:path...]
  local rootfs=$1 name=$2 image_config=$3 out=$4 w diff config owned uid gid path excluded=()
  shift 4
  for owned in "$@"; do excluded+=(--anchored "--exclude=./${owned#*:*:}"); done
  w=$(mktemp -d "$(dirname "$out")/.image.XXXXXX")
  tar -C "$rootfs" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner "${excluded[@]}" -cf "$w/layer.tar" .
  for owned in "$@"; do
    IFS=: read -r uid gid path <<<"$owned"
    tar -C "$rootfs" --sort=name --mtime=@0 --owner="$uid" --group="$gid" --numeric-owner -rf "$w/layer.tar" "./$path"
  done
  diff=$(sha256sum "$w/layer.tar" | cut -d' ' -f1)
  mkdir "$w/$diff"
  mv "$w/layer.tar" "$w/$diff/layer.tar"
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$image_config" "$diff" >"$w/config.json"
  config=$(sha256sum "$w/config.json" | cut -d' ' -f1)
  mv "$w/config.json" "$w/$config.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$config" "$name" "$diff" \
    >"$w/manifest.json"
  tar -C "$w" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" manifest.json "$config.json" "$diff"
  rm -rf "$w"
}

# The same with only an entrypoint, PATH=/bin and the working directory /.
make_image() { # rootfs, name, entrypoint (JSON), out
  make_image_config "$1" "$2" "{\"Entrypoint\":$3,\"Env\":[\"PATH=/bin\"],\"WorkingDir\":\"/\"}" "$4"
}

# A busybox root file system: the static busybox at /bin/busybox, a link per applet, /etc
# with root only, /root and /tmp (sticky).
busybox_rootfs() { # busybox binary, rootfs
  local busybox=$1 rootfs=$2 applet
  mkdir -p "$rootfs"/{bin,etc,root,tmp}
  chmod 1777 "$rootfs/tmp"
  install -m 0755 "$busybox" "$rootfs/bin/busybox"
  for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$rootfs/bin/$applet"
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$rootfs/etc/passwd"
  echo 'root:x:0:' >"$rootfs/etc/group"
}
