//! Locating the workspace's real binaries for process-level tests and the demo.
//!
//! A bin of another workspace crate is not built for this crate's test targets, so it is
//! built on first use with the same cargo, profile and target dir (a no-op when up to date)
//! and found in the profile directory: the parent of a test's `deps/` directory, or the
//! directory of a running bin (the demo).
//!
//! The profile is read from that directory: `debug` is `dev`, and `release` holds what
//! `cargo bench` and `cargo test --release` build, the `bench` profile, so the bin reuses
//! the bench's dependencies instead of rebuilding them all with the shipped profile's fat
//! LTO. [`shipped_binary`] asks for the `release` profile itself (what the images ship).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Bins built by this process: (bin, profile, path).
static BUILT: Mutex<Vec<(String, String, PathBuf)>> = Mutex::new(Vec::new());

/// Why a workspace binary could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum BinaryError {
    #[error("locating the running executable")]
    CurrentExe(#[source] std::io::Error),
    #[error("{0} is not inside a cargo target profile directory")]
    NoProfileDir(PathBuf),
    #[error("running cargo build for {bin}")]
    Spawn {
        bin: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cargo build -p {package} --bin {bin} failed ({status})")]
    Build {
        package: String,
        bin: String,
        status: std::process::ExitStatus,
    },
    #[error("{} missing after the build", .0.display())]
    Missing(PathBuf),
}

/// Path to `bin` of workspace package `package`, building it if needed.
///
/// # Panics
/// If the build fails or the binary cannot be found (tests want a loud failure).
pub fn workspace_binary(package: &str, bin: &str) -> PathBuf {
    try_workspace_binary(package, bin).unwrap_or_else(|e| panic!("{e}"))
}

/// Like [`workspace_binary`], reporting failures instead of panicking.
pub fn try_workspace_binary(package: &str, bin: &str) -> Result<PathBuf, BinaryError> {
    build(package, bin, None)
}

/// Path to `bin` built with the `release` profile, the one the images ship (opt-level "s",
/// fat LTO), for measurements of the shipped binary (its memory). Only from a test or
/// bench built under `target/release`, where that binary lands.
///
/// # Panics
/// As [`workspace_binary`].
pub fn shipped_binary(package: &str, bin: &str) -> PathBuf {
    build(package, bin, Some("release")).unwrap_or_else(|e| panic!("{e}"))
}

fn build(package: &str, bin: &str, profile: Option<&str>) -> Result<PathBuf, BinaryError> {
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().map_err(BinaryError::CurrentExe)?;
    let profile_dir = profile_dir(&exe).ok_or_else(|| BinaryError::NoProfileDir(exe.clone()))?;
    let profile = profile
        .map(str::to_string)
        .unwrap_or_else(|| profile_of(&profile_dir));
    if let Some((_, _, p)) = built.iter().find(|(b, pr, _)| b == bin && *pr == profile) {
        return Ok(p.clone());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "-p", package, "--bin", bin, "--profile", &profile])
        .current_dir(package_dir());
    if let (None, Some(target)) = (std::env::var_os("CARGO_TARGET_DIR"), profile_dir.parent()) {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    let status = cmd.status().map_err(|source| BinaryError::Spawn {
        bin: bin.to_string(),
        source,
    })?;
    if !status.success() {
        return Err(BinaryError::Build {
            package: package.to_string(),
            bin: bin.to_string(),
            status,
        });
    }
    let path = profile_dir.join(bin);
    if !path.is_file() {
        return Err(BinaryError::Missing(path));
    }
    built.push((bin.to_string(), profile, path.clone()));
    Ok(path)
}

/// The cargo profile whose output directory is `dir`: `debug` is `dev`'s, `release` is
/// where `bench` (and `release`) put theirs, any other is a custom profile's own name.
fn profile_of(dir: &Path) -> String {
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".into(),
        Some("release") => "bench".into(),
        Some(other) => other.into(),
    }
}

/// The profile directory (`target/<profile>`) of a running executable: tests and benches
/// live in `target/<profile>/deps/`, bins in `target/<profile>/` itself.
fn profile_dir(exe: &Path) -> Option<PathBuf> {
    let dir = exe.parent()?;
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().map(Path::to_path_buf)
    } else {
        Some(dir.to_path_buf())
    }
}

/// This package's directory: where it was built, or, when the build was made in another
/// copy of the workspace (a CI checkout reusing a shared target directory), the directory
/// the test runs in (cargo runs each test in its package's directory).
pub fn package_dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.is_dir() {
        return built;
    }
    std::env::current_dir().unwrap_or(built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_dir_of_tests_and_bins() {
        assert_eq!(
            profile_dir(Path::new("/t/debug/deps/agent_drain-0123abcd")),
            Some(PathBuf::from("/t/debug"))
        );
        assert_eq!(
            profile_dir(Path::new("/t/release/lastcall-demo")),
            Some(PathBuf::from("/t/release"))
        );
    }

    #[test]
    fn profile_from_its_directory() {
        assert_eq!(profile_of(Path::new("/t/debug")), "dev");
        assert_eq!(profile_of(Path::new("/t/release")), "bench");
        assert_eq!(profile_of(Path::new("/t/mutants")), "mutants");
    }
}
