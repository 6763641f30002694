//! Compiles `gpu-kernels/` to PTX with rustc's NVPTX backend, twice, and hands the paths to
//! the library (`include_str!(env!("ORCD_PTX"))`, `ORCD_PTX_SM90`): for sm_80 and, with
//! programmatic dependent launch (`--cfg orcd_pdl`, `griddepcontrol`), for sm_90. Needs no GPU
//! and no CUDA: only the pinned nightly with `rust-src` (for `-Zbuild-std=core`).
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest_dir.join("../gpu-kernels");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        kernels.join("Cargo.toml").display()
    );
    for (env, cpu, cfg) in [
        ("ORCD_PTX", "sm_80", None),
        ("ORCD_PTX_SM90", "sm_90", Some("orcd_pdl")),
    ] {
        // The kernels' own target dirs: the outer cargo holds the lock on its own.
        let ptx = build_ptx(&kernels, &out_dir.join(format!("ptx-{cpu}")), cpu, cfg);
        println!("cargo:rustc-env={env}={}", ptx.display());
    }
}

/// Builds the kernels for `cpu` (with `--cfg cfg`) in `target_dir`; returns the PTX's path.
fn build_ptx(kernels: &Path, target_dir: &Path, cpu: &str, cfg: Option<&str>) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(kernels)
        .args([
            "rustc",
            "--release",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
        ])
        .arg("--target-dir")
        .arg(target_dir)
        .args([
            "--",
            "-C",
            &format!("target-cpu={cpu}"),
            "--emit=asm",
            "-Zno-link",
        ]);
    if let Some(cfg) = cfg {
        cmd.args(["--cfg", cfg]);
    }
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
        panic!("gpu-kernels failed to compile to PTX for {cpu} (see rustc's errors above)");
    }
    let ptx = target_dir.join("nvptx64-nvidia-cuda/release/deps/gpu_kernels.s");
    assert!(ptx.exists(), "build.rs: no PTX at {}", ptx.display());
    ptx
}
