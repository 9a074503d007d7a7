//! tensile's four container images, as users install them: made by
//! `tests/k8s/images/build.sh` from the binaries cargo built and Debian's packages, the
//! images the Dockerfile describes, as docker-archive tarballs that a node's containerd
//! imports (`ctr -n k8s.io images import`). Cached by content: a warm call only hashes the
//! binaries (under a second).
//!
//! ```no_run
//! # fn example() -> anyhow::Result<()> {
//! use tensile_harness::images::{Images, Profile};
//! let images = Images::build(None)?; // target/debug's binaries, tagged the chart's appVersion
//! for image in images.all() {
//!     println!("{} in {}", image.name, image.tarball.display());
//! }
//! let upgrade = Images::build(Some("0.1.1-upgrade"))?;
//! let shipped = Images::build_profile(Profile::Dist, None)?; // target/dist's
//! # let _ = (upgrade, shipped); Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The binaries, one image each (`tensile/<binary>:<tag>`), in the build script's order.
pub const BINARIES: [&str; 4] = [
    "virtual-node",
    "tensile-webhook",
    "tensile-descheduler",
    "tensile-scheduler-extender",
];

/// The image repository the chart's values render (`image.repository`).
pub const REPOSITORY: &str = "tensile";

/// Which cargo profile's binaries go into the images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `target/debug`: what the test build made (the tests and CI).
    Dev,
    /// `target/release`.
    Release,
    /// `target/dist` (fat LTO): what the Dockerfile ships.
    Dist,
}

impl Profile {
    /// The name `cargo --profile` and the build script take.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Dev => "dev",
            Profile::Release => "release",
            Profile::Dist => "dist",
        }
    }
}

/// One image: its binary, its name (`tensile/<binary>:<tag>`) and its tarball.
#[derive(Clone, Debug)]
pub struct Image {
    pub binary: &'static str,
    pub name: String,
    pub tarball: PathBuf,
}

/// The four images the build script made, in the directory it printed.
#[derive(Clone, Debug)]
pub struct Images {
    pub dir: PathBuf,
    pub tag: String,
    pub virtual_node: Image,
    pub webhook: Image,
    pub descheduler: Image,
    pub scheduler_extender: Image,
    versions: BTreeMap<String, String>,
}

impl Images {
    /// Makes the images of the dev profile's binaries (`target/debug`, which the test
    /// build made; `cargo build --workspace --bins` makes the webhook's and the extender's)
    /// under `tag` (`None`: the workspace version, which is the chart's appVersion), or
    /// finds them cached.
    pub fn build(tag: Option<&str>) -> Result<Self> {
        Self::build_profile(Profile::Dev, tag)
    }

    /// The same with `profile`'s binaries (which must have been built).
    pub fn build_profile(profile: Profile, tag: Option<&str>) -> Result<Self> {
        let mut args = vec!["--profile", profile.as_str()];
        if let Some(tag) = tag {
            args.extend(["--tag", tag]);
        }
        let dir = crate::binaries::run_build_script_with(&build_script(), &args)?;
        let images = Self::at(&dir)?;
        if let Some(tag) = tag
            && images.tag != tag
        {
            bail!("{} holds tag {}, not {tag}", dir.display(), images.tag);
        }
        Ok(images)
    }

    /// The images in `dir` (a directory the build script printed).
    pub fn at(dir: &Path) -> Result<Self> {
        if !dir.join(".complete").exists() {
            bail!(
                "{} is not a directory made by tests/k8s/images/build.sh",
                dir.display()
            );
        }
        let versions_file = dir.join("versions");
        let text = std::fs::read_to_string(&versions_file)
            .with_context(|| format!("reading {}", versions_file.display()))?;
        let versions: BTreeMap<String, String> = text
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let tag = versions
            .get("tag")
            .with_context(|| format!("{} names no tag", versions_file.display()))?
            .clone();
        let image = |binary: &'static str| -> Result<Image> {
            let tarball = dir.join(format!("{binary}.tar"));
            if !tarball.is_file() {
                bail!("{} is missing", tarball.display());
            }
            Ok(Image {
                binary,
                name: format!("{REPOSITORY}/{binary}:{tag}"),
                tarball,
            })
        };
        Ok(Self {
            dir: dir.to_owned(),
            virtual_node: image("virtual-node")?,
            webhook: image("tensile-webhook")?,
            descheduler: image("tensile-descheduler")?,
            scheduler_extender: image("tensile-scheduler-extender")?,
            tag,
            versions,
        })
    }

    /// The four images, in [`BINARIES`]' order.
    pub fn all(&self) -> [&Image; 4] {
        [
            &self.virtual_node,
            &self.webhook,
            &self.descheduler,
            &self.scheduler_extender,
        ]
    }

    /// The image of `binary`, if it is one of [`BINARIES`].
    pub fn image(&self, binary: &str) -> Option<&Image> {
        self.all().into_iter().find(|image| image.binary == binary)
    }

    /// What the images hold: `tag`, `profile`, `debian` (the release the packages came
    /// from), `debian-codename`, and each Debian package's version (`libc6`, ...).
    pub fn versions(&self) -> &BTreeMap<String, String> {
        &self.versions
    }
}

/// The build script of the images.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/images/build.sh")
}

/// A docker-archive's `manifest.json`, its one image: the config's and the layers' names.
fn manifest(tarball: &Path) -> Result<Value> {
    let manifest: Value = serde_json::from_slice(&member(tarball, "manifest.json")?)
        .with_context(|| format!("parsing manifest.json of {}", tarball.display()))?;
    match manifest.as_array().map(Vec::as_slice) {
        Some([image]) => Ok(image.clone()),
        _ => bail!("{}: manifest.json holds not one image", tarball.display()),
    }
}

/// The bytes of `name` in the tar archive `tarball`.
fn member(tarball: &Path, name: &str) -> Result<Vec<u8>> {
    let output = Command::new("tar")
        .arg("-xOf")
        .arg(tarball)
        .arg(name)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running tar on {}", tarball.display()))?;
    if !output.status.success() {
        bail!(
            "reading {name} from {}: {}",
            tarball.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output.stdout)
}

/// The image's configuration (docker-archive: `manifest.json`'s `Config`), whose `config`
/// holds `Entrypoint`, `User`, `ExposedPorts`, `Env` and `WorkingDir`.
pub fn read_config(tarball: &Path) -> Result<Value> {
    let manifest = manifest(tarball)?;
    let config = manifest["Config"]
        .as_str()
        .with_context(|| format!("{}: manifest.json names no Config", tarball.display()))?;
    serde_json::from_slice(&member(tarball, config)?)
        .with_context(|| format!("parsing {config} of {}", tarball.display()))
}

/// The names the image is tagged with (`manifest.json`'s `RepoTags`).
pub fn read_repo_tags(tarball: &Path) -> Result<Vec<String>> {
    let manifest = manifest(tarball)?;
    Ok(manifest["RepoTags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|tag| tag.as_str().map(str::to_owned))
        .collect())
}

/// Unpacks the image's file system (its one layer) into `dest`; run as root, the files keep
/// their owners.
pub fn unpack(tarball: &Path, dest: &Path) -> Result<()> {
    let manifest = manifest(tarball)?;
    let layers: Vec<&str> = manifest["Layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let [layer] = layers.as_slice() else {
        bail!("{}: not one layer ({layers:?})", tarball.display());
    };
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let mut outer = Command::new("tar")
        .arg("-xOf")
        .arg(tarball)
        .arg(layer)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running tar on {}", tarball.display()))?;
    let stdout = outer.stdout.take().context("tar's stdout")?;
    let inner = Command::new("tar")
        .arg("-xf")
        .arg("-")
        .arg("--numeric-owner")
        .arg("-C")
        .arg(dest)
        .stdin(stdout)
        .status()
        .with_context(|| format!("unpacking {layer} into {}", dest.display()));
    let outer = outer.wait().context("waiting for tar")?;
    let inner = inner?;
    if !outer.success() || !inner.success() {
        bail!(
            "unpacking {layer} of {} into {}: tar {outer}, {inner}",
            tarball.display(),
            dest.display()
        );
    }
    Ok(())
}
