//! Child processes of the harness: each in its own process group (so a terminal's Ctrl-C
//! reaches only the harness, which stops them in order), its output in a log file, and
//! stopped by PID, never by name.
//!
//! A reaper (`sh`, reading the harness's pipe) kills every recorded PID when that pipe
//! closes, which the kernel does when the harness process ends in any way — so clusters
//! shared by a whole test binary do not outlive it even though statics are never dropped.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Kills the recorded PIDs (and optionally removes a directory) when the harness ends.
pub struct Reaper {
    pid_file: PathBuf,
    lock: Mutex<()>,
    _child: Child,
    _pipe: ChildStdin,
}

impl Reaper {
    /// Starts a reaper that records PIDs in `pid_file`; with `remove`, it deletes that
    /// directory after killing them.
    pub fn start(pid_file: &Path, remove: Option<&Path>) -> Result<Self> {
        File::create(pid_file).with_context(|| format!("creating {}", pid_file.display()))?;
        // A previous harness's commands (same directory) are not this one's.
        let _ = std::fs::remove_file(pid_file.with_extension("on-exit"));
        let script = r#"cat >/dev/null
for pid in $(cat "$1"); do kill -9 "$pid" 2>/dev/null; done
if [ -f "$1.on-exit" ]; then sh "$1.on-exit" >/dev/null 2>&1; fi
if [ -n "$2" ]; then sleep 0.5; rm -rf "$2"; fi"#;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("tensile-reaper")
            .arg(pid_file)
            .arg(remove.map(Path::as_os_str).unwrap_or_default())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the reaper (sh)")?;
        let pipe = child.stdin.take().context("reaper has no stdin")?;
        Ok(Self {
            pid_file: pid_file.to_owned(),
            lock: Mutex::new(()),
            _child: child,
            _pipe: pipe,
        })
    }

    /// Has the reaper run the shell command `command` after killing the PIDs (e.g. to
    /// remove what a component leaves outside the state directory).
    pub fn on_exit(&self, command: &str) -> Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.pid_file.with_extension("on-exit");
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(file, "{command}").with_context(|| format!("writing {}", path.display()))
    }

    fn record(&self, pid: u32) -> Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut file = OpenOptions::new()
            .append(true)
            .open(&self.pid_file)
            .with_context(|| format!("opening {}", self.pid_file.display()))?;
        writeln!(file, "{pid}").with_context(|| format!("writing {}", self.pid_file.display()))
    }
}

/// A running component. Dropping it kills it.
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
    /// How it was started, to start it again.
    command: (PathBuf, Vec<String>, Vec<(String, String)>),
}

impl Process {
    /// Spawns `program args` with stdout and stderr appended to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
        log: &Path,
        reaper: &Reaper,
    ) -> Result<Self> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        reaper.record(child.id())?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
            command: (program.to_owned(), args.to_owned(), envs.to_owned()),
        })
    }

    /// SIGKILLs it and starts it again the same way (its log continues).
    pub fn restart(&mut self, reaper: &Reaper) -> Result<()> {
        self.kill()?;
        let (program, args, envs) = self.command.clone();
        *self = Self::spawn(&self.name, &program, &args, &envs, &self.log, reaper)?;
        Ok(())
    }

    /// The component's name (e.g. `lower/kube-apiserver`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Fails with the log's tail if the process has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 20)
            );
        }
        Ok(())
    }

    /// Sends `signal` without waiting.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.child.id())?);
        kill(pid, signal).with_context(|| format!("sending {signal} to {}", self.name))
    }

    /// SIGTERM, then SIGKILL after `grace`; waits for the exit.
    pub fn stop(&mut self, grace: Duration) -> Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        self.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill()
    }

    /// SIGKILL and wait.
    pub fn kill(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            // It may exit between the check and the kill; the wait below settles it.
            let _ = self.child.kill();
        }
        self.child
            .wait()
            .with_context(|| format!("waiting for {}", self.name))?;
        Ok(())
    }
}

impl Drop for Process {
    /// Kills it; when a test is failing (the thread panics), its log's tail goes to
    /// stderr first, so that CI output shows what the component did.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- last lines of {} ({}):\n{}\n---",
                self.name,
                self.log.display(),
                tail(&self.log, 40)
            );
        }
        let _ = self.kill();
    }
}

/// The last `lines` lines of a log file (for error messages).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
