//! `orcd`: the command line (see `orcd --help`).
use clap::Parser;

#[derive(Parser)]
#[command(name = "orcd", version, about = orcd_cli::ABOUT, after_help = orcd_cli::AFTER_HELP)]
struct Cli {
    /// Print only results and errors: no notes, progress or statistics.
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    cmd: orcd_cli::Cmd,
}

fn main() {
    let cli = Cli::parse();
    orcd_cli::main(cli.quiet, || orcd_cli::run(cli.cmd))
}
