//! `orcd logits`: the top logits after every token of a prompt, as JSON lines. The tool
//! that compares an engine's numbers with a reference in minutes.
use anyhow::{Context, Result};

use crate::common::{ModelArgs, write_or_exit};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids, run as one prompt.
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// How many of the largest logits to print per position.
    #[arg(long, default_value_t = 5)]
    top: usize,
}

pub fn main(a: Args) -> Result<()> {
    let mut engine = a.model.load()?;
    let logits = engine.logits(&a.ids).context("running the prompt")?;
    let mut out = std::io::stdout().lock();
    for (pos, row) in logits.iter().enumerate() {
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        let k = a.top.min(order.len());
        // Largest first; equal logits in id order, as argmax breaks ties.
        let better =
            |x: &u32, y: &u32| row[*y as usize].total_cmp(&row[*x as usize]).then(x.cmp(y));
        if k < order.len() {
            order.select_nth_unstable_by(k, better);
        }
        order[..k].sort_by(better);
        let top: Vec<(u32, f32)> = order[..k].iter().map(|&i| (i, row[i as usize])).collect();
        let line = serde_json::json!({ "pos": pos, "top": top });
        write_or_exit(&mut out, format!("{line}\n").as_bytes());
    }
    Ok(())
}
