//! Locating the workspace's real binaries for process-level tests.
//!
//! A bin of another workspace crate is not built for this crate's test targets, so it is
//! built on first use with the same cargo, profile and target dir (a no-op when up to date)
//! and found next to the running test's `deps/` directory.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static BUILT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

/// Path to `bin` of workspace package `package`, building it if needed.
pub fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = built.iter().find(|(b, _)| b == bin) {
        return p.clone();
    }
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target profile dir")
        .to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "-p", package, "--bin", bin])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    if let (None, Some(target)) = (std::env::var_os("CARGO_TARGET_DIR"), profile_dir.parent()) {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running cargo build for {bin}: {e}"));
    assert!(
        status.success(),
        "cargo build -p {package} --bin {bin} failed"
    );
    let path = profile_dir.join(bin);
    assert!(path.is_file(), "{} missing after the build", path.display());
    built.push((bin.to_string(), path.clone()));
    path
}

/// A free TCP port on 127.0.0.1 (racy by nature; fine for tests that bind it at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding an ephemeral port")
}
