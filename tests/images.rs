//! tensile's images as users install them (`tests/k8s/images/build.sh`, made from the dev
//! profile's binaries here) against the Dockerfile that describes them: for each of its
//! four image stages (`FROM ... AS <target>`), the entrypoint, the exposed ports, the user
//! (resolved through the image's own /etc/passwd and /etc/group), the working directory,
//! the binary's path and the base (distroless/cc of one Debian release: glibc, libgcc_s and
//! the CA certificates of that release, no shell, /tmp 1777, nonroot's home) must agree, and
//! the binary must run in the image's file system against the image's own libraries
//! (`chroot`, as the image's user). Also: the script reads the profile's binaries where
//! cargo puts them, and the images are named what the chart's values render.
//!
//! Needs root (`chroot`), as the real-node tests do. Cached by content, a run takes a few
//! seconds: hashing the binaries, unpacking the four images.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use tensile_harness::images::{self, BINARIES, Image, Images};

/// Each Dockerfile target, its binary and the arguments that make it exit 0 at once.
const TARGETS: [(&str, &str, &[&str]); 4] = [
    ("virtual-node", "virtual-node", &["version"]),
    ("tensile-webhook", "tensile-webhook", &["--help"]),
    ("tensile-descheduler", "tensile-descheduler", &["--help"]),
    (
        "tensile-scheduler-extender",
        "tensile-scheduler-extender",
        &["--help"],
    ),
];

/// The distroless flavours the recipe makes, and the Debian packages each holds.
const FLAVOURS: [(&str, &[&str]); 1] = [("cc", &["libc6", "libgcc-s1", "ca-certificates"])];

/// Names of shells (and of busybox, which is one).
const SHELLS: [&str; 11] = [
    "sh", "bash", "dash", "ash", "ksh", "mksh", "zsh", "csh", "tcsh", "fish", "busybox",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_owned()
}

/// One `FROM ... AS <name>` stage of the Dockerfile: the instructions this test compares.
#[derive(Debug, Default)]
struct Stage {
    from: String,
    /// Each COPY: its flags (`--from=build`) and its arguments (sources, then destination).
    copies: Vec<(Vec<String>, Vec<String>)>,
    user: Option<String>,
    /// `port/proto`, `tcp` where the Dockerfile names none.
    expose: BTreeSet<String>,
    entrypoint: Option<Value>,
    workdir: Option<String>,
    /// Instructions this test does not compare (each one would be drift it cannot see).
    others: Vec<String>,
}

/// The named stages of a Dockerfile (continuation lines joined, comments dropped).
fn stages(dockerfile: &str) -> BTreeMap<String, Stage> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let line = line.trim();
        if line.starts_with('#') || (current.is_empty() && line.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(body) => {
                current.push_str(body);
                current.push(' ');
            }
            None => {
                current.push_str(line);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    let mut stages = BTreeMap::new();
    let mut stage: Option<(String, Stage)> = None;
    for line in lines {
        let (instruction, rest) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let rest = rest.trim();
        let words: Vec<String> = rest.split_whitespace().map(str::to_owned).collect();
        let instruction = instruction.to_ascii_uppercase();
        if instruction == "FROM" {
            stages.extend(stage.take());
            let words: Vec<&String> = words.iter().filter(|w| !w.starts_with("--")).collect();
            if let [image, as_, name] = words.as_slice()
                && as_.eq_ignore_ascii_case("as")
            {
                let from = image.to_string();
                stage = Some((
                    name.to_string(),
                    Stage {
                        from,
                        ..Stage::default()
                    },
                ));
            }
            continue;
        }
        let Some((_, stage)) = stage.as_mut() else {
            continue;
        };
        match instruction.as_str() {
            "COPY" => {
                let (flags, args) = words.into_iter().partition(|w| w.starts_with("--"));
                stage.copies.push((flags, args));
            }
            "USER" => stage.user = Some(rest.to_owned()),
            "WORKDIR" => stage.workdir = Some(rest.to_owned()),
            "EXPOSE" => stage.expose.extend(words.iter().map(|port| {
                if port.contains('/') {
                    port.to_ascii_lowercase()
                } else {
                    format!("{port}/tcp")
                }
            })),
            // The exec form is JSON; the shell form runs /bin/sh, which the image lacks.
            "ENTRYPOINT" => {
                stage.entrypoint = Some(
                    serde_json::from_str(rest)
                        .unwrap_or_else(|_| serde_json::json!(["/bin/sh", "-c", rest])),
                )
            }
            _ => stage.others.push(line.clone()),
        }
    }
    stages.extend(stage);
    stages
}

/// `gcr.io/distroless/<flavour>-debian<N>:<tag>` -> (flavour, N, tag).
fn distroless_base(from: &str) -> Option<(String, String, String)> {
    let rest = from.strip_prefix("gcr.io/distroless/")?;
    let (name, tag) = rest.split_once(':').unwrap_or((rest, "latest"));
    let (flavour, debian) = name.split_once("-debian")?;
    Some((flavour.to_owned(), debian.to_owned(), tag.to_owned()))
}

/// The value of `key=` in an os-release file.
fn os_release(text: &str, key: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| line.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.trim_matches('"').to_owned())
}

/// `USER user[:group]` resolved through the image's /etc/passwd and /etc/group, as the
/// runtime does: `uid:gid` (the user's primary group where none is named).
fn resolve_user(root: &Path, user: &str) -> Result<String, String> {
    let read = |file: &str| {
        std::fs::read_to_string(root.join(file)).map_err(|e| format!("reading /{file}: {e}"))
    };
    let passwd = read("etc/passwd")?;
    let group = read("etc/group")?;
    let (name, group_name) = match user.split_once(':') {
        Some((name, group)) => (name, Some(group)),
        None => (user, None),
    };
    let entry = passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() >= 4 && (fields[0] == name || fields[2] == name));
    let (uid, primary) = match entry {
        Some(fields) => (fields[2].to_owned(), fields[3].to_owned()),
        // A uid the image does not name runs with group 0, as runc and containerd do.
        None if name.parse::<u32>().is_ok() => (name.to_owned(), "0".to_owned()),
        None => return Err(format!("user {name} is not in the image's /etc/passwd")),
    };
    let gid = match group_name {
        None => primary,
        Some(group_name) => match group
            .lines()
            .map(|line| line.split(':').collect::<Vec<_>>())
            .find(|fields| {
                fields.len() >= 3 && (fields[0] == group_name || fields[2] == group_name)
            }) {
            Some(fields) => fields[2].to_owned(),
            None if group_name.parse::<u32>().is_ok() => group_name.to_owned(),
            None => {
                return Err(format!(
                    "group {group_name} is not in the image's /etc/group"
                ));
            }
        },
    };
    Ok(format!("{uid}:{gid}"))
}

/// Every path under `root` (relative, with a leading `/`) and its metadata, not following
/// links.
fn walk(root: &Path) -> Vec<(String, std::fs::Metadata)> {
    fn visit(root: &Path, dir: &Path, out: &mut Vec<(String, std::fs::Metadata)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let metadata = std::fs::symlink_metadata(&path).unwrap();
            let relative = format!("/{}", path.strip_prefix(root).unwrap().display());
            if metadata.is_dir() {
                visit(root, &path, out);
            }
            out.push((relative, metadata));
        }
    }
    let mut out = Vec::new();
    visit(root, root, &mut out);
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// What differs between the Dockerfile's `target` stage and the image of `binary`, each a
/// line naming the target.
fn drift(
    stage: &Stage,
    target: &str,
    binary: &str,
    run_args: &[&str],
    image: &Image,
    versions: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut faults = Vec::new();
    let mut fault = |what: String| faults.push(format!("{target}: {what}"));
    let unpacked = tempfile::tempdir().unwrap();
    let root = unpacked.path();
    images::unpack(&image.tarball, root).unwrap();
    let config = images::read_config(&image.tarball).unwrap();
    let config = &config["config"];

    for other in &stage.others {
        fault(format!(
            "the Dockerfile has `{other}`, which this test does not compare"
        ));
    }

    // The base: distroless/<flavour>-debian<N>:<tag>, the release and packages of the image.
    let Some((flavour, debian, base_tag)) = distroless_base(&stage.from) else {
        fault(format!(
            "FROM {}: not a distroless base the recipe knows",
            stage.from
        ));
        return faults;
    };
    match FLAVOURS.iter().find(|(f, _)| *f == flavour) {
        None => fault(format!(
            "FROM {}: the recipe makes {:?} images",
            stage.from, FLAVOURS
        )),
        Some((_, packages)) => {
            for package in *packages {
                let status = root.join("var/lib/dpkg/status.d").join(package);
                let version = std::fs::read_to_string(&status).ok().and_then(|text| {
                    text.lines()
                        .find_map(|l| l.strip_prefix("Version: ").map(str::to_owned))
                });
                if version.is_none() || version.as_ref() != versions.get(*package) {
                    fault(format!(
                        "Debian's {package} (FROM {}): the image records {version:?}, the \
                         build {:?}",
                        stage.from,
                        versions.get(*package)
                    ));
                }
            }
        }
    }
    let release = std::fs::read_to_string(root.join("etc/os-release")).unwrap_or_default();
    let version_id = os_release(&release, "VERSION_ID");
    if version_id.as_deref() != Some(debian.as_str()) || versions.get("debian") != Some(&debian) {
        fault(format!(
            "FROM {} is Debian {debian}; the image's packages are Debian {version_id:?} (os-release), \
             {:?} (the build's apt sources)",
            stage.from,
            versions.get("debian")
        ));
    }
    let bundle =
        std::fs::read_to_string(root.join("etc/ssl/certs/ca-certificates.crt")).unwrap_or_default();
    let shipped = std::fs::read_dir(root.join("usr/share/ca-certificates/mozilla"))
        .map(|dir| dir.count())
        .unwrap_or(0);
    let bundled = bundle.matches("-----BEGIN CERTIFICATE-----").count();
    if bundled < 100 || bundled != shipped {
        fault(format!(
            "/etc/ssl/certs/ca-certificates.crt holds {bundled} certificates, ca-certificates \
             ships {shipped}"
        ));
    }

    // The binary: COPY --from=build <binary> /usr/local/bin/<binary>, the only program.
    let binary_path = format!("/usr/local/bin/{binary}");
    match stage.copies.as_slice() {
        [(flags, args)]
            if flags.iter().any(|f| f.starts_with("--from="))
                && args.len() == 2
                && args[0].rsplit('/').next() == Some(binary)
                && args[1] == binary_path => {}
        copies => fault(format!(
            "the Dockerfile copies {copies:?}, the recipe the one binary to {binary_path}"
        )),
    }
    let entries = walk(root);
    let programs: Vec<&str> = entries
        .iter()
        .filter(|(path, m)| {
            !m.is_dir()
                && Path::new(path)
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|dir| dir == "bin" || dir == "sbin")
        })
        .map(|(path, _)| path.as_str())
        .collect();
    if programs != [binary_path.as_str()] {
        fault(format!("programs {programs:?}, not only {binary_path}"));
    }
    match entries.iter().find(|(path, _)| *path == binary_path) {
        Some((_, m)) if m.is_file() && m.permissions().mode() & 0o7777 == 0o755 => {}
        found => fault(format!(
            "{binary_path}: {:?}, not a file of mode 0755",
            found.map(|(_, m)| m.permissions().mode())
        )),
    }

    // No shell, and no executable script needing one (the packages' documentation holds
    // example scripts, not executable).
    for (path, m) in &entries {
        let name = Path::new(path).file_name().unwrap().to_string_lossy();
        if SHELLS.contains(&name.as_ref()) {
            fault(format!("{path}: a shell"));
        }
        if m.is_file() && m.mode() & 0o111 != 0 {
            let mut head = [0u8; 2];
            let mut file = std::fs::File::open(root.join(&path[1..])).unwrap();
            if std::io::Read::read(&mut file, &mut head).unwrap() == 2 && &head == b"#!" {
                fault(format!("{path}: an executable script"));
            }
        }
    }

    // The file system of the base: /tmp 1777, the users' homes theirs.
    match entries.iter().find(|(path, _)| path == "/tmp") {
        Some((_, m)) if m.is_dir() && m.mode() & 0o7777 == 0o1777 && m.uid() == 0 => {}
        found => fault(format!(
            "/tmp: {:?}, not root's with mode 1777",
            found.map(|(_, m)| m.mode())
        )),
    }

    // USER, resolved through the image's own passwd and group, is the config's numeric User.
    let default_user = if base_tag.contains("nonroot") {
        "nonroot"
    } else {
        "root"
    };
    let user = stage.user.as_deref().unwrap_or(default_user);
    match resolve_user(root, user) {
        Err(error) => fault(format!("USER {user}: {error}")),
        Ok(resolved) => {
            if config["User"].as_str() != Some(resolved.as_str()) {
                fault(format!(
                    "USER {user} is {resolved} in the image; its config says {}",
                    config["User"]
                ));
            }
            let home = std::fs::read_to_string(root.join("etc/passwd"))
                .unwrap_or_default()
                .lines()
                .map(|line| line.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 6 && format!("{}:{}", f[2], f[3]) == resolved)
                .map(|f| f[5].to_owned());
            match home
                .as_deref()
                .map(|home| std::fs::symlink_metadata(root.join(&home[1..])))
            {
                Some(Ok(m)) if format!("{}:{}", m.uid(), m.gid()) == resolved => {}
                _ => fault(format!(
                    "the home of {resolved} ({home:?}) is missing or not theirs"
                )),
            }
        }
    }

    // ENTRYPOINT, EXPOSE, WORKDIR (the base's where the stage sets none), the base's Env.
    if stage.entrypoint.as_ref() != Some(&config["Entrypoint"]) {
        fault(format!(
            "ENTRYPOINT {:?}, the image's {}",
            stage.entrypoint, config["Entrypoint"]
        ));
    }
    if config["Entrypoint"][0].as_str() != Some(binary_path.as_str()) {
        fault(format!(
            "the entrypoint {} is not {binary_path}",
            config["Entrypoint"]
        ));
    }
    let exposed: BTreeSet<String> = config["ExposedPorts"]
        .as_object()
        .map(|ports| ports.keys().cloned().collect())
        .unwrap_or_default();
    if exposed != stage.expose {
        fault(format!(
            "EXPOSE {:?}, the image's {exposed:?}",
            stage.expose
        ));
    }
    let default_workdir = if base_tag.contains("nonroot") {
        "/home/nonroot"
    } else {
        "/"
    };
    let workdir = stage.workdir.as_deref().unwrap_or(default_workdir);
    if config["WorkingDir"].as_str() != Some(workdir) {
        fault(format!(
            "WORKDIR {workdir}, the image's {}",
            config["WorkingDir"]
        ));
    }
    let env = serde_json::json!([
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"
    ]);
    if config["Env"] != env {
        fault(format!("Env {}, distroless's {env}", config["Env"]));
    }

    // The binary runs in the image, as its user, against its libraries.
    let uid_gid = config["User"].as_str().unwrap_or("65532:65532");
    let output = Command::new("chroot")
        .arg(format!("--userspec={uid_gid}"))
        .arg(root)
        .arg(&binary_path)
        .args(run_args)
        .stdin(Stdio::null())
        .output()
        .expect("running chroot (the test needs root)");
    if !output.status.success() {
        fault(format!(
            "chroot {} {binary_path} {}: {} (the test needs root)\n{}",
            root.display(),
            run_args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    faults
}

/// The four images against the Dockerfile's four stages; the images are named what the
/// chart's default values render.
#[test]
fn the_images_are_what_the_dockerfile_describes() {
    let images = Images::build(None).unwrap();
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let stages = stages(&dockerfile);
    let targets: BTreeSet<&str> = TARGETS.iter().map(|(t, _, _)| *t).collect();
    let named: BTreeSet<&str> = stages
        .keys()
        .map(String::as_str)
        .filter(|s| *s != "build")
        .collect();
    assert_eq!(
        named, targets,
        "the Dockerfile's image stages and the recipe's images"
    );
    assert_eq!(
        TARGETS.map(|(_, binary, _)| binary),
        BINARIES,
        "the test's table and the harness's binaries"
    );

    let chart: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo().join("deploy/helm/tensile/Chart.yaml")).unwrap(),
    )
    .unwrap();
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo().join("deploy/helm/tensile/values.yaml")).unwrap(),
    )
    .unwrap();
    let app_version = chart["appVersion"].as_str().unwrap();
    let repository = values["image"]["repository"].as_str().unwrap();
    assert_eq!(
        images.tag, app_version,
        "the default tag is the chart's appVersion"
    );

    let mut faults = Vec::new();
    for (target, binary, run_args) in TARGETS {
        let image = images.image(binary).unwrap();
        let name = format!("{repository}/{binary}:{app_version}");
        let tags = images::read_repo_tags(&image.tarball).unwrap();
        if image.name != name || tags != [name.clone()] {
            faults.push(format!(
                "{target}: named {} (tarball: {tags:?}), the chart renders {name}",
                image.name
            ));
        }
        faults.extend(drift(
            &stages[target],
            target,
            binary,
            run_args,
            image,
            images.versions(),
        ));
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

/// A second tag makes the same images under other names (an upgrade test's "new release").
#[test]
fn a_second_tag_names_the_same_images() {
    let first = Images::build(None).unwrap();
    let second = Images::build(Some("0.0.0-images-test")).unwrap();
    assert_ne!(first.dir, second.dir);
    for (a, b) in first.all().into_iter().zip(second.all()) {
        assert_eq!(b.name, format!("tensile/{}:0.0.0-images-test", a.binary));
        assert_eq!(
            images::read_repo_tags(&b.tarball).unwrap(),
            std::slice::from_ref(&b.name)
        );
        assert_eq!(
            images::read_config(&a.tarball).unwrap(),
            images::read_config(&b.tarball).unwrap(),
            "{}: the same configuration (and so the same layer)",
            a.binary
        );
    }
}

/// `--profile` reads the binaries where cargo puts them (dev: `debug`), and says how to
/// build what is missing.
#[test]
fn the_profile_picks_cargos_directory() {
    let target = tempfile::tempdir().unwrap();
    for (profile, dir) in [("dist", "dist"), ("release", "release"), ("dev", "debug")] {
        let output = Command::new("bash")
            .arg(images::build_script())
            .args(["--profile", profile])
            .env("CARGO_TARGET_DIR", target.path())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        let missing = format!(
            "{}/virtual-node is missing",
            target.path().join(dir).display()
        );
        assert!(
            !output.status.success() && stderr.contains(&missing),
            "{profile}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("--profile {profile}")),
            "{profile}: {stderr}"
        );
    }
}

/// The Dockerfile reader: continuation lines, comments, flags, EXPOSE's protocols, the
/// entrypoint's two forms, and what it does not compare.
#[test]
fn dockerfile_stages_are_read_as_docker_reads_them() {
    let stages = stages(
        "FROM rust AS build\nRUN cargo build\n\
         # a comment\n\
         FROM --platform=linux/amd64 gcr.io/distroless/cc-debian12:nonroot AS a\n\
         COPY --from=build /out/a \\\n  /usr/local/bin/a\n\
         USER nonroot:nonroot\nEXPOSE 80 53/UDP\nENTRYPOINT [\"/usr/local/bin/a\", \"x\"]\n\
         FROM scratch AS b\nENTRYPOINT /b --flag\nENV A=1\nWORKDIR /w\n\
         FROM scratch\nEXPOSE 1\n",
    );
    assert_eq!(stages.keys().collect::<Vec<_>>(), ["a", "b", "build"]);
    let a = &stages["a"];
    assert_eq!(a.from, "gcr.io/distroless/cc-debian12:nonroot");
    assert_eq!(
        a.copies,
        [(
            vec!["--from=build".to_owned()],
            vec!["/out/a".to_owned(), "/usr/local/bin/a".to_owned()]
        )]
    );
    assert_eq!(a.user.as_deref(), Some("nonroot:nonroot"));
    assert_eq!(
        a.expose,
        BTreeSet::from(["80/tcp".to_owned(), "53/udp".to_owned()])
    );
    assert_eq!(
        a.entrypoint,
        Some(serde_json::json!(["/usr/local/bin/a", "x"]))
    );
    assert!(a.others.is_empty(), "{:?}", a.others);
    let b = &stages["b"];
    assert_eq!(
        b.entrypoint,
        Some(serde_json::json!(["/bin/sh", "-c", "/b --flag"]))
    );
    assert_eq!(b.workdir.as_deref(), Some("/w"));
    assert_eq!(b.others, ["ENV A=1"]);
    assert_eq!(stages["build"].others, ["RUN cargo build"]);
    assert_eq!(
        distroless_base(&a.from),
        Some(("cc".to_owned(), "12".to_owned(), "nonroot".to_owned()))
    );
    assert_eq!(distroless_base("debian:12"), None);
}

/// USER through an image's passwd and group, as the runtime resolves it.
#[test]
fn users_resolve_through_the_images_passwd_and_group() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("etc")).unwrap();
    std::fs::write(
        root.path().join("etc/passwd"),
        "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n",
    )
    .unwrap();
    std::fs::write(
        root.path().join("etc/group"),
        "root:x:0:\nstaff:x:50:\nnonroot:x:65532:\n",
    )
    .unwrap();
    for (user, resolved) in [
        ("nonroot:nonroot", Ok("65532:65532")),
        ("nonroot", Ok("65532:65532")),
        ("nonroot:staff", Ok("65532:50")),
        ("65532:65532", Ok("65532:65532")),
        ("root", Ok("0:0")),
        ("1000", Ok("1000:0")),
        ("1000:7", Ok("1000:7")),
        ("nobody", Err(())),
        ("nonroot:wheel", Err(())),
    ] {
        assert_eq!(
            resolve_user(root.path(), user).map_err(|_| ()),
            resolved.map(str::to_owned),
            "{user}"
        );
    }
}
