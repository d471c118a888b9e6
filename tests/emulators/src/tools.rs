//! The programs the suite and the demo run beside the workspace's own binaries
//! (`redis-server`, `redis-cli`, `promtool`): found on `PATH`, or installed from the
//! distribution's packages on first use, so `cargo test --workspace` and the demo pass on a
//! fresh machine with nothing installed by hand.
//!
//! Installing needs root (or `sudo` without a password) and `apt-get`; anywhere else the
//! error names the package to install. Installs are serialised across test processes with
//! `flock(1)` and within one process by a lock, and each package is tried once per process.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, bail};

use crate::process::on_path;

/// Where the install lock lives (outside any clone, shared by every test process).
const LOCK: &str = "/var/tmp/lastcall-apt.lock";

/// Outcome of each package tried in this process, so a failed install is not retried by
/// every test that needs it.
static TRIED: Mutex<BTreeMap<&'static str, Result<(), String>>> = Mutex::new(BTreeMap::new());

/// `program` on `PATH`, installing Debian package `package` first when it is missing.
pub fn ensure(program: &str, package: &'static str) -> anyhow::Result<()> {
    if on_path(program) {
        return Ok(());
    }
    let mut tried = TRIED.lock().unwrap_or_else(|p| p.into_inner());
    let outcome = tried
        .entry(package)
        .or_insert_with(|| install(package).map_err(|e| format!("{e:#}")))
        .clone();
    drop(tried);
    match outcome {
        Ok(()) if on_path(program) => Ok(()),
        Ok(()) => bail!("installed the package {package}, but {program} is still not on PATH"),
        Err(e) => bail!("{program} is not on PATH and could not be installed: {e}"),
    }
}

/// `apt-get install` of one package, as root or through `sudo -n`.
fn install(package: &str) -> anyhow::Result<()> {
    if !on_path("apt-get") {
        bail!(
            "no apt-get here: install the package providing it ({package} on Debian/Ubuntu) by hand"
        );
    }
    let prefix: &[&str] = if is_root() {
        &[]
    } else if Command::new("sudo")
        .args(["-n", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        &["sudo", "-n"]
    } else {
        bail!("not root and no password-less sudo: run `sudo apt-get install -y {package}`");
    };
    eprintln!("lastcall test kit: installing the Debian package {package} (apt-get)");
    let script = format!(
        "apt-get install -y -qq {package} >/dev/null 2>&1 || \
         (apt-get update -qq && apt-get install -y -qq {package})"
    );
    let mut cmd = Command::new(prefix.first().copied().unwrap_or("flock"));
    if !prefix.is_empty() {
        cmd.args(&prefix[1..]).arg("flock");
    }
    let out = cmd
        .args([LOCK, "sh", "-c", &script])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running apt-get for {package}"))?;
    if !out.status.success() {
        bail!(
            "apt-get install {package} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_program_needs_nothing_and_a_missing_package_is_a_clear_error() {
        ensure("sh", "dash").expect("sh is on PATH");
        let e = ensure(
            "lastcall-no-such-program",
            "lastcall-no-such-package-anywhere",
        )
        .expect_err("nothing provides it");
        let msg = format!("{e:#}");
        assert!(
            msg.contains("lastcall-no-such-program")
                && msg.contains("lastcall-no-such-package-anywhere"),
            "{msg}"
        );
    }
}
