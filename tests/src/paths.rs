//! Where the test kit's files are, also when its build was made in another copy of the
//! workspace.

use std::path::PathBuf;

/// The test kit's package directory (`tests/`): where it was built, else the directory the
/// test runs in (cargo runs each test in its package's directory).
pub fn package_dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.is_dir() {
        return built;
    }
    std::env::current_dir().unwrap_or(built)
}
