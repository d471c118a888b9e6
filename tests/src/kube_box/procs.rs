//! The box's child processes: one process group led by a watchdog, a log file each.
//!
//! The shared box lives in a `static`, whose `Drop` never runs, so the processes must not
//! depend on it: the first child is a watchdog shell (`sh`, in its own process group) that
//! polls the test process and, once it is gone, kills its whole group. Every other child
//! joins that group, so one `kill -KILL -<pgid>` ends them all; [`Group::drop`] does the
//! same for a box that is dropped (also on panic). No `unsafe`, no libc binding.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Context;

/// A child's name and its log (stdout and stderr together).
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// The process group and its members.
#[derive(Debug)]
pub struct Group {
    pgid: u32,
    watchdog: Child,
    pub procs: Vec<Proc>,
    logs: PathBuf,
}

impl Group {
    /// Starts the watchdog; its pid is the group id every later child joins.
    /// Once the test process is gone it also removes `logs` (the box's temp dir, which a
    /// `static` box never drops), from a session of its own that outlives the group.
    pub fn new(logs: &Path) -> anyhow::Result<Group> {
        let me = std::process::id();
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; \
             setsid sh -c 'sleep 1; rm -rf \"$0\"' \"{dir}\" </dev/null >/dev/null 2>&1 & \
             kill -KILL 0",
            dir = logs.display()
        );
        let watchdog = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the box's watchdog (sh)")?;
        Ok(Group {
            pgid: watchdog.id(),
            watchdog,
            procs: Vec::new(),
            logs: logs.to_path_buf(),
        })
    }

    /// Starts `program args` in the group with its output in `<logs>/<name>.log`.
    pub fn spawn(&mut self, name: &str, program: &Path, args: &[String]) -> anyhow::Result<()> {
        let log = self.logs.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(self.pgid as i32)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        self.procs.push(Proc {
            name: name.to_string(),
            log,
            child,
        });
        Ok(())
    }

    /// The first member that has exited, with its status.
    pub fn exited(&mut self) -> Option<(String, std::process::ExitStatus)> {
        self.procs
            .iter_mut()
            .find_map(|p| p.exited().map(|s| (p.name.clone(), s)))
    }

    /// The last `lines` lines of every member's log.
    pub fn tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for p in &self.procs {
            out.push_str(&format!("---- {} ({}) ----\n", p.name, p.log.display()));
            out.push_str(&tail(&p.log, lines));
            out.push('\n');
        }
        out
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.pgid)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.watchdog.wait();
        for p in &mut self.procs {
            let _ = p.child.wait();
        }
    }
}

/// The last `lines` lines of `path` (reading at most its last 256 KiB).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("({} unreadable)", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(256 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
