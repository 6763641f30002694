//! `cargo xtask …`: orcd's command line. Each subcommand lives in its own module.
use clap::{Parser, Subcommand};

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
    about = "orcd: a pure-Rust LLM inference engine for NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text for a prompt (chat template applied), streamed to stdout.
    Run(run::Args),
    /// Print the top logits after every token of a prompt, one JSON line per position.
    Logits(logits::Args),
    /// Download, verify and cache a model listed in models.lock; prints its path.
    FetchModel(fetch_model::Args),
    /// Build the CLI, the test executables and the PTX into bundle/ for a GPU runner.
    GpuBundle(gpu_bundle::Args),
    /// Print a GGUF file's metadata summary and tensor table.
    Inspect(inspect::Args),
    /// Print token ids for text, one JSON array per input.
    Tokenize(tokenize::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run(a) => run::main(a),
        Cmd::Logits(a) => logits::main(a),
        Cmd::FetchModel(a) => fetch_model::main(a),
        Cmd::GpuBundle(a) => gpu_bundle::main(a),
        Cmd::Inspect(a) => inspect::main(a),
        Cmd::Tokenize(a) => tokenize::main(a),
    };
    if let Err(e) = result {
        // One line, no backtrace: the library's errors already name the file and the problem.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
