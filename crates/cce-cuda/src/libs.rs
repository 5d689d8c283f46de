//! Whether a CUDA library can be loaded, checked before the first call into it.
//!
//! cudarc panics when a library it loads at run time (`dynamic-loading`) is missing, so the
//! backend checks first and returns `NoDevice` instead. cudarc's own check exists only in that
//! mode; when another crate in the build links the libraries (`dynamic-linking`, as
//! candle-core's `cuda` feature does) the same names are looked up here, and an already linked
//! library is found at once.

/// The file names cudarc tries for `lib` (`"cuda"`, `"nvrtc"`, `"cublas"`): the unversioned
/// name, the CUDA 13 / 12 sonames and the driver's `.so.1` (Linux), or the `64_*` DLLs.
fn candidates(lib: &str) -> Vec<String> {
    let (pre, suf) = if cfg!(windows) {
        ("", ".dll")
    } else if cfg!(target_os = "macos") {
        ("lib", ".dylib")
    } else {
        ("lib", ".so")
    };
    let mut names = vec![format!("{pre}{lib}{suf}")];
    for major in ["13", "12"] {
        names.push(format!("{pre}{lib}{suf}.{major}"));
        names.push(format!("{pre}{lib}64_{major}{suf}"));
        names.push(format!("{pre}{lib}64_{major}0_0{suf}"));
    }
    names.push(format!("{pre}{lib}{suf}.1"));
    names
}

/// Whether the CUDA library `lib` (`"cuda"` for the driver, `"nvrtc"`, `"cublas"`) can be
/// loaded by one of the names cudarc tries. Loads nothing into the process beyond what the
/// dynamic loader keeps for the check; calls no symbol.
pub fn present(lib: &str) -> bool {
    candidates(lib).into_iter().any(|name| {
        // SAFETY: loading a CUDA library runs only its initializers, which have no
        // preconditions; no symbol is resolved or called, and the handle is closed at once.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn candidates_include_the_cuda_13_soname() {
        let names = super::candidates("nvrtc");
        if cfg!(target_os = "linux") {
            assert!(names.contains(&"libnvrtc.so.13".to_string()), "{names:?}");
            assert!(super::candidates("cuda").contains(&"libcuda.so.1".to_string()));
        }
    }
}
