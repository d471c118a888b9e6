//! The box's child processes: one process group, a log file each, and a watchdog.
//!
//! The shared box lives in a `static`, whose `Drop` never runs, so the processes must not
//! depend on it. The group is led by an idle `sleep`; every process of the box joins it, so
//! one `kill -KILL -<pgid>` ends them all. A watchdog shell in a group of its own polls the
//! test process and, once it is gone, kills the group and removes the box's temp dir.
//! [`Group::drop`] does the same for a box that is dropped (also on panic). No `unsafe`, no
//! libc binding.

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
    program: PathBuf,
    args: Vec<String>,
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
    leader: Child,
    watchdog: Child,
    pub procs: Vec<Proc>,
    logs: PathBuf,
}

impl Group {
    /// Starts the group's leader (its pid is the group id every later child joins) and the
    /// watchdog, which outlives the test process by at most half a second and removes
    /// `logs` (the box's temp dir) after killing the group.
    pub fn new(logs: &Path) -> anyhow::Result<Group> {
        let leader = Command::new("sleep")
            .arg("infinity")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the box's process group (sleep)")?;
        let pgid = leader.id();
        let me = std::process::id();
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; \
             kill -KILL -{pgid}; sleep 0.5; rm -rf \"$0\"",
        );
        let watchdog = Command::new("sh")
            .args(["-c", &script, &logs.to_string_lossy()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the box's watchdog (sh)")?;
        Ok(Group {
            pgid,
            leader,
            watchdog,
            procs: Vec::new(),
            logs: logs.to_path_buf(),
        })
    }

    /// Starts `program args` in the group with its output in `<logs>/<name>.log`.
    pub fn spawn(&mut self, name: &str, program: &Path, args: &[String]) -> anyhow::Result<()> {
        let log = self.logs.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = self.run(name, program, args, out)?;
        self.procs.push(Proc {
            name: name.to_string(),
            log,
            program: program.to_path_buf(),
            args: args.to_vec(),
            child,
        });
        Ok(())
    }

    fn run(&self, name: &str, program: &Path, args: &[String], out: File) -> anyhow::Result<Child> {
        let err = out.try_clone()?;
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(self.pgid as i32)
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))
    }

    fn member(&mut self, name: &str) -> anyhow::Result<&mut Proc> {
        self.procs
            .iter_mut()
            .find(|p| p.name == name)
            .with_context(|| format!("no process {name} in the box"))
    }

    /// SIGKILL to member `name` (no chance to flush or say goodbye), and its exit reaped.
    pub fn kill(&mut self, name: &str) -> anyhow::Result<std::process::ExitStatus> {
        let p = self.member(name)?;
        p.child.kill()?;
        Ok(p.child.wait()?)
    }

    /// Starts member `name` again with the same program and arguments; its log goes on
    /// after a marker line.
    pub fn respawn(&mut self, name: &str) -> anyhow::Result<()> {
        let (program, args, log) = {
            let p = self.member(name)?;
            (p.program.clone(), p.args.clone(), p.log.clone())
        };
        let mut out = std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        std::io::Write::write_all(&mut out, b"---- restarted by the test ----\n")?;
        let child = self.run(name, &program, &args, out)?;
        self.member(name)?.child = child;
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
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let _ = self.leader.wait();
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
