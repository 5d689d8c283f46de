//! A private `XDG_RUNTIME_DIR` for the wgpu backend when the environment has no usable one.
//!
//! On Linux, Mesa's Vulkan device-selection layer (`VK_LAYER_MESA_device_select`, an implicit
//! layer installed with `mesa-vulkan-drivers`) looks for a Wayland compositor while wgpu
//! enumerates the adapters: it calls libwayland-client's `wl_display_connect`, which, with
//! `XDG_RUNTIME_DIR` unset or not an absolute path, prints
//! `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` on stderr (twice in a
//! `cce run`), before any output of ours. Nothing fails: the layer finds no compositor either
//! way and the adapters are the same.
//!
//! So `cce`, before it opens a wgpu backend and only when the variable is unset or not
//! absolute, points it at an empty directory of its own (mode 0700, under the temporary
//! directory), which it removes on exit. A usable value is never changed.

use std::ffi::OsStr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The directory `XDG_RUNTIME_DIR` points at for this process; removed when dropped.
#[derive(Debug)]
pub struct PrivateRuntimeDir {
    path: PathBuf,
}

impl PrivateRuntimeDir {
    /// The directory.
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PrivateRuntimeDir {
    fn drop(&mut self) {
        // Nothing is expected inside (no compositor runs there); remove whatever is.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Whether `value` is a usable `XDG_RUNTIME_DIR`: set and an absolute path. The XDG Base
/// Directory specification says to ignore a relative one, and libwayland-client rejects it
/// (with the message this module avoids), as it does an empty or missing one.
pub fn is_usable(value: Option<&OsStr>) -> bool {
    value.is_some_and(|v| Path::new(v).is_absolute())
}

/// An empty directory private to this process (mode 0700) under `parent`:
/// `cce-runtime-<pid>-<k>`, the first `k` whose name is free.
fn create_private_dir(parent: &Path) -> std::io::Result<PathBuf> {
    let pid = std::process::id();
    let mut last = None;
    for k in 0..16 {
        let path = parent.join(format!("cce-runtime-{pid}-{k}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => return Ok(path),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free name")))
}

/// When `XDG_RUNTIME_DIR` is unset or not absolute, creates a private empty directory (module
/// docs) and sets `XDG_RUNTIME_DIR` to it for this process; returns the guard that removes it,
/// or `None` when the variable is usable (left alone) or the directory cannot be created
/// (then the loader's message may appear, and nothing else changes).
///
/// Call it before any thread is spawned: it sets an environment variable, which other threads
/// may be reading (`getenv` is not synchronized with `setenv` in C).
pub fn ensure() -> Option<PrivateRuntimeDir> {
    if is_usable(std::env::var_os("XDG_RUNTIME_DIR").as_deref()) {
        return None;
    }
    let path = create_private_dir(&std::env::temp_dir()).ok()?;
    // Thread safety: `main` calls this after parsing the command line and before anything
    // that spawns a thread (the backend, rayon's pool, the progress spinner), so no other
    // thread can read the environment while it changes. (In edition 2024 `set_var` is
    // `unsafe` for this reason; this crate is edition 2021.)
    std::env::set_var("XDG_RUNTIME_DIR", &path);
    Some(PrivateRuntimeDir { path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_absolute_path_is_usable() {
        assert!(!is_usable(None));
        assert!(!is_usable(Some(OsStr::new(""))));
        assert!(!is_usable(Some(OsStr::new("run/user/1000"))));
        assert!(is_usable(Some(OsStr::new("/run/user/1000"))));
        // An absolute path that does not exist is the user's choice: left alone.
        assert!(is_usable(Some(OsStr::new("/nonexistent"))));
    }

    #[test]
    fn the_private_dir_is_0700_and_removed_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let first = PrivateRuntimeDir {
            path: create_private_dir(parent.path()).unwrap(),
        };
        let second = PrivateRuntimeDir {
            path: create_private_dir(parent.path()).unwrap(),
        };
        assert_ne!(first.path(), second.path());
        let mode = std::fs::metadata(first.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let path = first.path().to_path_buf();
        drop(first);
        assert!(!path.exists());
        drop(second);
        assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
    }
}
