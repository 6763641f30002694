//! Compiles `gpu-kernels/` to one PTX file with rustc's NVPTX backend and hands its path to
//! the library (`include_str!(env!("ORCD_PTX"))`). Needs no GPU and no CUDA: only the pinned
//! nightly with `rust-src` (for `-Zbuild-std=core`).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest_dir.join("../gpu-kernels");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    // The kernels' own target dir: the outer cargo holds the lock on its own.
    let target_dir = out_dir.join("ptx-target");
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        kernels.join("Cargo.toml").display()
    );

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&kernels)
        .args([
            "rustc",
            "--release",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--", "-C", "target-cpu=sm_80", "--emit=asm", "-Zno-link"]);
    // The outer build's flags and settings are for the host target, not for nvptx.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key == "RUSTFLAGS"
            || key == "RUSTC_WRAPPER"
            || key == "RUSTC_WORKSPACE_WRAPPER"
            || (key.starts_with("CARGO_") && key != "CARGO_HOME")
        {
            cmd.env_remove(key.as_ref());
        }
    }
    let status = cmd
        .status()
        .expect("build.rs: could not start cargo to build gpu-kernels");
    if !status.success() {
        // rustc's own errors are printed above; fail the build with them.
        panic!("gpu-kernels failed to compile to PTX (see rustc's errors above)");
    }
    let ptx = target_dir.join("nvptx64-nvidia-cuda/release/deps/gpu_kernels.s");
    assert!(ptx.exists(), "build.rs: no PTX at {}", ptx.display());
    println!("cargo:rustc-env=ORCD_PTX={}", ptx.display());
}
