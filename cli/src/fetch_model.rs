//! `orcd fetch-model [NAME]`: download, verify and cache a model of models.lock; and the
//! progress display of every subcommand that may fetch one.
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use orcd::models::Progress;

use crate::common::write_or_exit;

#[derive(clap::Args)]
pub struct Args {
    /// A model name from models.lock
    #[arg(default_value = orcd::models::default_model())]
    name: String,
}

pub fn main(args: Args) -> anyhow::Result<()> {
    // Progress on stderr, the path alone on stdout: `$(orcd fetch-model)` works.
    let path = orcd::models::fetch(&args.name, &mut progress())?;
    write_or_exit(
        &mut std::io::stdout(),
        format!("{}\n", path.display()).as_bytes(),
    );
    Ok(())
}

/// Shows a fetch's progress on stderr: each step as a line and, when stderr is a terminal, a
/// bar of the bytes done; nothing with `--quiet`.
pub fn progress() -> impl FnMut(Progress) {
    let tty = std::io::stderr().is_terminal();
    let mut bar: Option<ProgressBar> = None;
    move |p| {
        if crate::quiet() {
            return;
        }
        match p {
            Progress::Step(line) => match &bar {
                Some(b) => b.println(line),
                None => eprintln!("{line}"),
            },
            Progress::Bytes { done, total } if tty => {
                let b = bar.get_or_insert_with(|| ProgressBar::new(total).with_style(bar_style()));
                b.set_length(total);
                b.set_position(done);
                if done >= total {
                    b.finish_and_clear();
                    bar = None;
                }
            }
            Progress::Bytes { .. } => {}
        }
    }
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}, {eta} left",
    )
    .expect("a valid template")
}
