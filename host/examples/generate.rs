//! Generate a reply with the library API: `cargo run --release -p orcd --example generate -- "Why is the sky blue?"`
//! Runs on the GPU when one is present, else on the CPU; Ctrl-C is not handled here (see xtask).
use std::io::Write;

use orcd::engine::{Engine, Event, GenerateOptions, LoadOptions, Prompt};

fn main() -> orcd::Result<()> {
    let question = std::env::args()
        .nth(1)
        .unwrap_or("Write a haiku about the sea.".into());
    let path = orcd::models::resolve(orcd::models::default_model())?;
    let mut engine = Engine::load(&path, &LoadOptions::default())?;
    let prompt = engine.prompt_ids(&Prompt::user(&question))?;
    let device = engine.device().to_string();
    let opts = GenerateOptions {
        max_tokens: 128,
        ..GenerateOptions::default()
    };
    for event in engine.generate(prompt, opts)? {
        match event? {
            Event::Token { text, .. } => {
                print!("{text}");
                std::io::stdout().flush().ok();
            }
            Event::Done(stats) => {
                println!();
                eprintln!(
                    "[{}] {} tokens, {:.1} tok/s, stop: {}",
                    device,
                    stats.tokens.len(),
                    stats.decode_tok_per_s(),
                    stats.stop.as_str()
                );
            }
        }
    }
    Ok(())
}
