//! `orcd tokenize`: the token ids of texts, as the model's tokenizer encodes them.
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use orcd::chat::Message;
use orcd::gguf::Gguf;
use orcd::tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// A model name from models.lock or a path to a GGUF file
    #[arg(long, default_value = orcd::models::default_model())]
    model: String,
    /// A text to tokenize; may be repeated (at least one --text or a --file is required)
    #[arg(long, required_unless_present = "file")]
    text: Vec<String>,
    /// A file of texts, one JSON string per line, tokenized after the --text ones (default: none)
    #[arg(long)]
    file: Option<PathBuf>,
    /// Render the chat template first, with the text as the user's message
    #[arg(long)]
    chat: bool,
}

/// Prints one JSON array of ids per input: the `--text`s first, then the lines of `--file`.
pub fn main(args: Args) -> anyhow::Result<()> {
    let mut texts = args.text;
    if let Some(file) = &args.file {
        let content =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for (i, line) in content
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let text: String = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not a JSON string", file.display(), i + 1))?;
            texts.push(text);
        }
    }
    let path = orcd::models::resolve_with(&args.model, &mut crate::fetch_model::progress())?;
    let tok = Tokenizer::from_gguf(&Gguf::open(&path)?)?;
    let mut out = BufWriter::new(std::io::stdout().lock());
    for text in &texts {
        let ids = if args.chat {
            tok.chat_prompt(&[Message::new("user", text)])?
        } else {
            tok.encode(text)?
        };
        writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    }
    out.flush()?;
    Ok(())
}
