//! `orcd inspect`: a GGUF file's summary, metadata and tensor table, then whether orcd
//! can run it.
use std::collections::BTreeMap;
use std::io::{BufWriter, Write};

use orcd::config::Config;
use orcd::gguf::{Gguf, Value};
use orcd::tokenizer::Tokenizer;

/// Arrays longer than this print as `[N items]`; strings longer than this are cut.
const SHORT: usize = 16;
const SHORT_STR: usize = 72;

#[derive(clap::Args)]
pub struct Args {
    /// A model name from models.lock or a path to any GGUF file
    #[arg(long, default_value = orcd::models::default_model())]
    model: String,
}

/// Prints what the file holds, even a GGUF that is not a model orcd runs; that one then ends
/// with its error, as `run` would report it.
pub fn main(args: Args) -> anyhow::Result<()> {
    let path = orcd::models::resolve_with(&args.model, &mut crate::fetch_model::progress())?;
    let g = Gguf::open(&path)?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    print(&mut out, &g)?;
    out.flush()?;
    Config::from_gguf(&g)?.check_tensors(&g)?;
    Tokenizer::from_gguf(&g)?;
    Ok(())
}

fn print(out: &mut impl Write, g: &Gguf) -> anyhow::Result<()> {
    summary(out, g)?;
    writeln!(out, "\nmetadata ({} keys)", g.metadata().len())?;
    for (key, value) in g.metadata() {
        writeln!(out, "  {key} = {}", show(value))?;
    }
    tensor_table(out, g)
}

fn summary(out: &mut impl Write, g: &Gguf) -> anyhow::Result<()> {
    let text = |key: &str| g.get_str(key).unwrap_or("-");
    writeln!(
        out,
        "file          {} ({} bytes)",
        g.path().display(),
        g.file_size()
    )?;
    writeln!(
        out,
        "GGUF version  {}, alignment {}",
        g.version(),
        g.alignment()
    )?;
    writeln!(out, "architecture  {}", text("general.architecture"))?;
    writeln!(out, "name          {}", text("general.name"))?;
    // Any GGUF may be inspected: a file this engine cannot run still gets its table printed.
    match Config::from_gguf(g) {
        Ok(c) => {
            let output = if c.tied_output {
                "tied to token_embd"
            } else {
                "separate"
            };
            writeln!(
                out,
                "config        {} layers, hidden {}, {} heads, {} kv heads, head dim {}, FFN {}, vocab {}, context {}, rope theta {}, rms eps {:e}, output {output}",
                c.n_layers,
                c.hidden,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.ffn,
                c.vocab,
                c.ctx_len,
                c.rope_theta,
                c.rms_eps
            )?;
            match c.check_tensors(g) {
                Ok(()) => writeln!(
                    out,
                    "tensors       all present with the expected shapes and types"
                )?,
                Err(e) => writeln!(out, "tensors       {e}")?,
            }
        }
        Err(e) => writeln!(out, "config        {e}")?,
    }
    let vocab = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .map_or(0, <[_]>::len);
    writeln!(
        out,
        "tokenizer     {} (pre {}), {vocab} tokens",
        text("tokenizer.ggml.model"),
        text("tokenizer.ggml.pre")
    )?;
    let template = g.get_str("tokenizer.chat_template").map(str::len);
    writeln!(
        out,
        "chat template {}",
        template.map_or("absent".into(), |n| format!("present ({n} bytes)"))
    )?;
    Ok(())
}

fn tensor_table(out: &mut impl Write, g: &Gguf) -> anyhow::Result<()> {
    let width = g
        .tensors()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(0)
        .max(4);
    writeln!(out, "\ntensors ({})", g.tensors().len())?;
    writeln!(
        out,
        "  {:width$}  {:5}  {:>16}  {:>12}",
        "name", "type", "shape", "bytes"
    )?;
    let mut totals: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in g.tensors() {
        let shape = t
            .shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" x ");
        writeln!(
            out,
            "  {:width$}  {:5}  {shape:>16}  {:>12}",
            t.name,
            t.ty.name(),
            t.bytes
        )?;
        let total = totals.entry(t.ty.name()).or_default();
        *total = (total.0 + 1, total.1 + t.bytes);
    }
    writeln!(out, "\ntotals")?;
    for (ty, (count, bytes)) in &totals {
        writeln!(out, "  {ty:5}  {count:4} tensors  {bytes:>12} bytes")?;
    }
    let (count, bytes) = totals
        .values()
        .fold((0, 0), |(c, b), &(tc, tb)| (c + tc, b + tb));
    writeln!(out, "  {:5}  {count:4} tensors  {bytes:>12} bytes", "all")?;
    Ok(())
}

/// A metadata value on one line: long arrays as `[N items]`, long strings cut.
fn show(value: &Value) -> String {
    match value {
        Value::String(s) => match s.chars().count() {
            n if n > SHORT_STR => format!(
                "{:?}… ({n} chars)",
                s.chars().take(SHORT_STR).collect::<String>()
            ),
            _ => format!("{s:?}"),
        },
        Value::Array(items) if items.len() > SHORT => {
            let ty = items.first().map_or("", Value::type_name);
            format!("[{} items of {ty}]", items.len())
        }
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(show).collect::<Vec<_>>().join(", ")
        ),
        Value::U8(v) => v.to_string(),
        Value::I8(v) => v.to_string(),
        Value::U16(v) => v.to_string(),
        Value::I16(v) => v.to_string(),
        Value::U32(v) => v.to_string(),
        Value::I32(v) => v.to_string(),
        Value::U64(v) => v.to_string(),
        Value::I64(v) => v.to_string(),
        Value::F32(v) => v.to_string(),
        Value::F64(v) => v.to_string(),
        Value::Bool(v) => v.to_string(),
    }
}
