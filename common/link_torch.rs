//! Build script of every crate that links libtorch (`build = "../common/link_torch.rs"`);
//! `common/build.rs` calls it too.
//!
//! torch-sys tells its direct dependents where libtorch lives through `DEP_TCH_LIBTORCH_LIB`.
//! We bake that directory into the rpath so binaries and test executables run without
//! `LD_LIBRARY_PATH`, and we force a `NEEDED` entry for `libtorch_cuda.so`: nothing in our
//! code references its symbols, so `--as-needed` would drop it and libtorch would silently
//! never register its CUDA backend.

use std::path::Path;

#[allow(dead_code)]
fn main() {
    link_torch();
}

/// Emits the rpath and the forced `libtorch_cuda` link for the crate being built.
pub(crate) fn link_torch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    if Path::new(&lib_dir).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{lib_dir}");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
