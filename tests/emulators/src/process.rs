//! Child processes of a test: finding programs, signalling them, waiting for their exit.
//!
//! Signals go through `kill(1)`, as a kubelet or an operator sends them, so no test needs
//! `unsafe` or a libc binding.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

/// Whether `program` is an executable file in a directory of `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(program).is_file()))
}

/// Sends `SIG<sig>` (`"TERM"`, `"INT"`, `"KILL"`, …) to `pid`; an error if `kill` could not
/// run or did not succeed (no such process, not permitted).
pub async fn signal(pid: u32, sig: &str) -> std::io::Result<()> {
    let status = tokio::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "kill -{sig} {pid} failed ({status})"
        )))
    }
}

/// The exit status of `child` if it exits within `within`; `None` if it is still running.
pub async fn exited_within(
    child: &mut tokio::process::Child,
    within: Duration,
) -> std::io::Result<Option<ExitStatus>> {
    match tokio::time::timeout(within, child.wait()).await {
        Ok(status) => status.map(Some),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_signalled_child_exits_and_a_missing_one_is_an_error() {
        assert!(on_path("sleep"), "coreutils sleep is expected on PATH");
        assert!(!on_path("lastcall-no-such-program"));
        let mut child = tokio::process::Command::new("sleep")
            .arg("30")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        assert_eq!(
            exited_within(&mut child, Duration::from_millis(50))
                .await
                .unwrap(),
            None,
            "still running"
        );
        signal(pid, "TERM").await.unwrap();
        let status = exited_within(&mut child, Duration::from_secs(10))
            .await
            .unwrap()
            .expect("exits on SIGTERM");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(15));
        assert!(signal(pid, "TERM").await.is_err(), "the process is gone");
    }
}
