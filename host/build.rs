//! Compiles `gpu-kernels/` to PTX with rustc's NVPTX backend, once for sm_80 and once for
//! sm_90, and hands the paths of their deflated text to the library
//! (`include_bytes!(env!("ORCD_PTX"))`, `ORCD_PTX_SM90`). Needs no GPU and no CUDA: only the
//! pinned nightly with `rust-src` (for `-Zbuild-std=core`).
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest_dir.join("../gpu-kernels");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    // The kernels and the declarations of their parameters, which they build against.
    for dir in [kernels.clone(), manifest_dir.join("../kernel-abi")] {
        println!("cargo:rerun-if-changed={}", dir.join("src").display());
        println!(
            "cargo:rerun-if-changed={}",
            dir.join("Cargo.toml").display()
        );
    }

    // sm_80 runs on every GPU from the A100 on; the sm_90 build adds Hopper's programmatic
    // dependent launch (`util::wait_prior_grids`), which PTX for sm_80 cannot name. The two
    // builds run side by side, each in its own target dir (the outer cargo holds the lock on
    // its own).
    let builds = [("sm_80", "ORCD_PTX"), ("sm_90", "ORCD_PTX_SM90")].map(|(cpu, var)| {
        let dir = out_dir.join(format!("ptx-{cpu}"));
        (cpu, var, dir.clone(), start_ptx_build(&kernels, &dir, cpu))
    });
    for (cpu, var, dir, mut child) in builds {
        let status = child
            .wait()
            .expect("build.rs: could not wait for the gpu-kernels build");
        if !status.success() {
            // rustc's own errors are printed above; fail the build with them.
            panic!("gpu-kernels failed to compile to PTX for {cpu} (see rustc's errors above)");
        }
        let ptx = dir.join("nvptx64-nvidia-cuda/release/deps/gpu_kernels.s");
        let text = std::fs::read_to_string(&ptx)
            .unwrap_or_else(|e| panic!("build.rs: no PTX at {}: {e}", ptx.display()));
        let out = out_dir.join(format!("orcd-{cpu}.ptx.deflate"));
        let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut z, text.as_bytes()).unwrap();
        std::fs::write(&out, z.finish().unwrap())
            .unwrap_or_else(|e| panic!("build.rs: writing {}: {e}", out.display()));
        println!("cargo:rustc-env={var}={}", out.display());
    }
}

/// Starts building the kernels for `target-cpu` `cpu` in `target_dir`.
fn start_ptx_build(kernels: &Path, target_dir: &Path, cpu: &str) -> Child {
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
        .args(["--", "-C", &format!("target-cpu={cpu}")])
        .args(["--emit=asm", "-Zno-link"]);
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
    cmd.spawn()
        .expect("build.rs: could not start cargo to build gpu-kernels")
}
