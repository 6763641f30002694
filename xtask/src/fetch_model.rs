//! `cargo xtask fetch-model [NAME]`: download, verify and cache a model of models.lock.
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    /// A model name from models.lock (default: the lock's default model).
    name: Option<String>,
}

pub fn main(args: Args) -> anyhow::Result<()> {
    let name = args
        .name
        .as_deref()
        .unwrap_or(orcd::models::default_model());
    // Progress on stderr, the path alone on stdout: `$(cargo xtask fetch-model)` works.
    let path = orcd::models::fetch(name, &mut |line| eprintln!("{line}"))?;
    writeln!(std::io::stdout(), "{}", path.display())?;
    Ok(())
}
