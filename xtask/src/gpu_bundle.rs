//! `cargo xtask gpu-bundle [--out bundle]`: everything a GPU machine without Rust or network
//! needs to run orcd's tests, in one folder: the CLI (`bin/orcd`), every test executable
//! (`tests/`), built in release and stripped (each embeds the PTX it loads), the reference
//! outputs (`refs/`) and `run-gpu-tests.sh` / `memcheck.sh` to run them.
use anyhow::{Context, Result, bail, ensure};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(clap::Args)]
pub struct Args {
    /// The folder to write, relative to the workspace root; an earlier bundle there is replaced.
    #[arg(long, default_value = "bundle")]
    out: PathBuf,
}

/// The bundle must travel to the GPU machine in one go (64 MiB a call), with room to spare.
const MAX_BYTES: u64 = 60_000_000;
/// The reference outputs, relative to the workspace root (every JSON file there is bundled).
const REFS: &str = "tests/refs";

pub fn main(args: Args) -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask has no parent folder")?;
    let out = root.join(&args.out);
    if out.exists() {
        // Never delete a folder that is not a bundle (a mistyped --out).
        ensure!(
            out.join("run-gpu-tests.sh").exists() || fs::read_dir(&out)?.next().is_none(),
            "{}: exists and is not a bundle; remove it or pick another --out",
            out.display()
        );
        fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }

    let cli = cargo_executables(root, &["build", "--release", "-p", "orcd-cli"])?
        .into_iter()
        .find(|a| a.name == "orcd" && !a.test)
        .context("cargo build printed no orcd executable")?;
    let tests: Vec<Executable> =
        cargo_executables(root, &["test", "--release", "--workspace", "--no-run"])?
            .into_iter()
            .filter(|a| a.test)
            .collect();
    ensure!(
        !tests.is_empty(),
        "cargo test --no-run built no test executable"
    );

    for dir in ["bin", "tests", "refs"] {
        fs::create_dir_all(out.join(dir))?;
    }
    copy_stripped(&cli.path, &out.join("bin/orcd"))?;
    for test in &tests {
        let dest = out.join("tests").join(&test.name);
        ensure!(
            !dest.exists(),
            "two test executables are named {}",
            test.name
        );
        copy_stripped(&test.path, &dest)?;
    }
    for entry in fs::read_dir(root.join(REFS))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let dest = out.join("refs").join(path.file_name().unwrap_or_default());
            fs::copy(&path, dest).with_context(|| format!("copying {}", path.display()))?;
        }
    }
    write_script(&out.join("run-gpu-tests.sh"), RUN_GPU_TESTS)?;
    write_script(&out.join("memcheck.sh"), MEMCHECK)?;

    let bytes = folder_bytes(&out)?;
    eprintln!(
        "{}: {} test executables, {:.1} MB",
        out.display(),
        tests.len(),
        bytes as f64 / 1e6
    );
    ensure!(
        bytes <= MAX_BYTES,
        "{}: {bytes} bytes, over the {MAX_BYTES} limit",
        out.display()
    );
    println!("{}", out.display());
    Ok(())
}

/// An executable cargo built: the target's name, and whether it is a test harness.
struct Executable {
    name: String,
    test: bool,
    path: PathBuf,
}

/// Runs `cargo <args>` in `root` and collects the executables its JSON messages name.
fn cargo_executables(root: &Path, args: &[&str]) -> Result<Vec<Executable>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(name), Some(path)) =
            (msg["target"]["name"].as_str(), msg["executable"].as_str())
        {
            found.push(Executable {
                name: name.to_string(),
                test: msg["profile"]["test"].as_bool() == Some(true),
                path: path.into(),
            });
        }
    }
    Ok(found)
}

fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg(to)
        .status()
        .context("running strip (binutils)")?;
    ensure!(status.success(), "strip {} failed", to.display());
    Ok(())
}

fn write_script(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, text)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn folder_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            folder_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

const RUN_GPU_TESTS: &str = r#"#!/usr/bin/env bash
# Runs every test executable of this bundle, one test at a time, on this machine's GPU.
# REQUIRE_GPU=1: a missing GPU fails the GPU tests instead of skipping them.
# --memcheck runs each executable under compute-sanitizer's memcheck (what memcheck.sh does).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() {
    echo "usage: $0 --model /path/model.gguf [--memcheck] [test-harness args, e.g. a filter]" >&2
    exit 2
}
model= memcheck=0 args=()
while [ $# -gt 0 ]; do
    case $1 in
        --model) [ $# -ge 2 ] || usage; model=$2; shift 2 ;;
        --model=*) model=${1#--model=}; shift ;;
        --memcheck) memcheck=1; shift ;;
        -h | --help) usage ;;
        *) args+=("$1"); shift ;;
    esac
done
[ -n "$model" ] || usage
[ -f "$model" ] || { echo "$model: no such file" >&2; exit 2; }
export REQUIRE_GPU=1
export ORCD_MODEL="$(cd "$(dirname "$model")" && pwd)/$(basename "$model")"
export ORCD_REFS="${ORCD_REFS:-$here/refs}"
wrapper=()
if [ "$memcheck" = 1 ]; then
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    # Executables that never touch CUDA are not an error.
    wrapper=("$sanitizer" --tool memcheck --error-exitcode 3 --require-cuda-init no)
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
total_passed=0 total_failed=0 status=0 summary=()
for exe in "$here"/tests/*; do
    name=$(basename "$exe")
    echo "=== $name"
    "${wrapper[@]}" "$exe" --test-threads=1 "${args[@]}" 2>&1 | tee "$log"
    code=${PIPESTATUS[0]}
    # libtest's closing line: "test result: ok. 3 passed; 0 failed; ..."
    counts=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed;.*/\1 \2/p' "$log")
    read -r passed failed <<<"${counts:-0 0}"
    if [ "$code" != 0 ]; then
        status=1
        # A crash or a memcheck error fails the executable even where no test failed.
        [ "$failed" != 0 ] || failed=1
    fi
    line="$name: $passed passed, $failed failed"
    [ "$code" = 0 ] || line="$line (exit code $code)"
    errors=$(grep -o 'ERROR SUMMARY: .*' "$log" | tail -n 1)
    [ -z "$errors" ] || line="$line, memcheck $errors"
    summary+=("$line")
    total_passed=$((total_passed + passed)) total_failed=$((total_failed + failed))
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
echo "total: $total_passed passed, $total_failed failed"
exit "$status"
"#;

const MEMCHECK: &str = r#"#!/usr/bin/env bash
# Runs every test executable of this bundle under compute-sanitizer's memcheck; same arguments
# as run-gpu-tests.sh (a test-name filter keeps it short: memcheck slows kernels a lot).
exec "$(dirname "${BASH_SOURCE[0]}")/run-gpu-tests.sh" --memcheck "$@"
"#;
