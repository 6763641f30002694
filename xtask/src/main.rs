//! `cargo xtask …`: orcd's command line from a checkout. Every user command is orcd-cli's (`cargo
//! xtask serve` is `orcd serve`); `gpu-bundle`, a task of the repository, is xtask's own.
use clap::{Parser, Subcommand};

mod gpu_bundle;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    version,
    about = orcd_cli::ABOUT,
    after_help = orcd_cli::AFTER_HELP
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
    #[command(flatten)]
    Orcd(orcd_cli::Cmd),
    /// Build the CLI, the test executables and the PTX into bundle/ for a GPU runner.
    GpuBundle(gpu_bundle::Args),
}

fn main() {
    let cli = Cli::parse();
    orcd_cli::main(cli.quiet, || match cli.cmd {
        Cmd::Orcd(cmd) => orcd_cli::run(cmd),
        Cmd::GpuBundle(a) => gpu_bundle::main(a),
    })
}
