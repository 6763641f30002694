//! orcd's command line: every user command (`orcd run`, `serve`, …), one module each. The
//! `orcd` binary and `cargo xtask` both parse `Cmd` and hand it to `run`.
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Subcommand;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

mod bench;
mod bench_batch;
mod bench_serve;
mod common;
mod fetch_model;
mod inspect;
mod logits;
mod run;
mod serve;
mod tokenize;

/// What `orcd --help` says about itself, shared with `cargo xtask`.
pub const ABOUT: &str = "orcd: a pure-Rust LLM inference engine for NVIDIA GPUs";
pub const AFTER_HELP: &str =
    "Logs go to stderr, filtered by RUST_LOG (default: warn; e.g. RUST_LOG=debug).";

#[derive(Subcommand)]
pub enum Cmd {
    /// Generate text for a prompt (chat template applied), streamed to stdout.
    Run(run::Args),
    /// Serve the model over HTTP: the OpenAI API, the worker API and Prometheus metrics.
    Serve(serve::Args),
    /// Print the top logits after every token of a prompt, one JSON line per position.
    Logits(logits::Args),
    /// Measure load time, prefill and decode speed on a fixed prompt.
    Bench(bench::Args),
    /// Load-test an OpenAI-compatible server: N streaming clients in a closed loop.
    BenchServe(bench_serve::Args),
    /// Download, verify and cache a model listed in models.lock; prints its path.
    FetchModel(fetch_model::Args),
    /// Print a GGUF file's metadata summary and tensor table.
    Inspect(inspect::Args),
    /// Print token ids for text, one JSON array per input.
    Tokenize(tokenize::Args),
}

/// Runs one command.
pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Run(a) => run::main(a),
        Cmd::Serve(a) => serve::main(a),
        Cmd::Logits(a) => logits::main(a),
        Cmd::Bench(a) => bench::main(a),
        Cmd::BenchServe(a) => bench_serve::main(a),
        Cmd::FetchModel(a) => fetch_model::main(a),
        Cmd::Inspect(a) => inspect::main(a),
        Cmd::Tokenize(a) => tokenize::main(a),
    }
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

/// A program's whole life: sets `--quiet`, starts the logs, runs `body` and exits. An error
/// becomes one line on stderr and exit status 1; a closed stdout ends quietly with 0.
pub fn main(quiet: bool, body: impl FnOnce() -> anyhow::Result<()>) -> ! {
    QUIET.store(quiet, Ordering::Relaxed);
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::WARN.into())
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let Err(e) = body() else {
        std::process::exit(0)
    };
    // `… | head` closed stdout early: not a failure.
    let closed_pipe = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    });
    if closed_pipe {
        std::process::exit(0);
    }
    eprintln!("error: {}", one_line(&e));
    std::process::exit(1);
}

/// One line, no backtrace: the library's errors already name the file and the problem.
/// Causes join the line unless the message already says them (orcd's I/O errors do).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if !line.contains(&cause) {
            line += if line.is_empty() { "" } else { ": " };
            line += &cause;
        }
    }
    line
}
