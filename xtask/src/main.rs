//! `cargo xtask …`: orcd's command line. Each subcommand lives in its own module.
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

mod bench;
mod common;
mod fetch_model;
mod gpu_bundle;
mod inspect;
mod logits;
mod run;
mod tokenize;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    version,
    about = "orcd: a pure-Rust LLM inference engine for NVIDIA GPUs",
    after_help = "Logs go to stderr, filtered by RUST_LOG (default: warn; e.g. RUST_LOG=debug)."
)]
struct Cli {
    /// Print only results and errors: no notes, progress or statistics.
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for a prompt (chat template applied), streamed to stdout.
    Run(run::Args),
    /// Print the top logits after every token of a prompt, one JSON line per position.
    Logits(logits::Args),
    /// Measure load time, prefill and decode speed on a fixed prompt.
    Bench(bench::Args),
    /// Download, verify and cache a model listed in models.lock; prints its path.
    FetchModel(fetch_model::Args),
    /// Build the CLI, the test executables and the PTX into bundle/ for a GPU runner.
    GpuBundle(gpu_bundle::Args),
    /// Print a GGUF file's metadata summary and tensor table.
    Inspect(inspect::Args),
    /// Print token ids for text, one JSON array per input.
    Tokenize(tokenize::Args),
}

static QUIET: AtomicBool = AtomicBool::new(false);

/// Whether `--quiet` was given.
pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// Prints `note: <msg>` on stderr, unless `--quiet`.
pub fn note(msg: &str) {
    if !quiet() {
        eprintln!("note: {msg}");
    }
}

fn main() {
    let cli = Cli::parse();
    QUIET.store(cli.quiet, Ordering::Relaxed);
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::WARN.into())
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let result = match cli.cmd {
        Cmd::Run(a) => run::main(a),
        Cmd::Logits(a) => logits::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::FetchModel(a) => fetch_model::main(a),
        Cmd::GpuBundle(a) => gpu_bundle::main(a),
        Cmd::Inspect(a) => inspect::main(a),
        Cmd::Tokenize(a) => tokenize::main(a),
    };
    if let Err(e) = result {
        // `… | head` closed stdout early: not a failure.
        let closed_pipe = e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        });
        if closed_pipe {
            std::process::exit(0);
        }
        // One line, no backtrace: the library's errors already name the file and the problem.
        // Causes join the line unless the message already says them (orcd's I/O errors do).
        let mut line = String::new();
        for cause in e.chain().map(|c| c.to_string()) {
            if !line.contains(&cause) {
                line += if line.is_empty() { "" } else { ": " };
                line += &cause;
            }
        }
        eprintln!("error: {line}");
        std::process::exit(1);
    }
}
