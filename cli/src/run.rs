//! `orcd run`: generate text for a prompt, streamed to stdout.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use orcd::chat::Message;
use orcd::engine::{Engine, Event, GenerateOptions, Prompt, Stats, StopReason};
use orcd::sampling::SamplingParams;

use crate::common::{ModelArgs, write_or_exit};

#[derive(clap::Args)]
pub struct Args {
    /// The user's message (or, with --raw, the whole prompt).
    #[arg(long)]
    prompt: String,
    #[command(flatten)]
    model: ModelArgs,
    /// Generate at most this many tokens (0: only check that the prompt fits).
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.7, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 20)]
    top_k: usize,
    /// Keep the most likely tokens up to this total probability (1 = off).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalise tokens seen in the last 64 (1 = off).
    #[arg(long, default_value_t = 1.05, allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// Seed of the sampler: the same seed gives the same answer.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// System message (default: the chat template's own).
    #[arg(long)]
    system: Option<String>,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Print one JSON object (ids, text, stop reason, timings) at the end instead of streaming.
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed: a.seed,
        ..SamplingParams::default()
    };
    sampling.validate()?;
    let mut engine: Engine = a.model.load()?;
    let prompt = if a.raw {
        Prompt::Raw(a.prompt.clone())
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &a.system {
            messages.push(Message::new("system", system));
        }
        messages.push(Message::new("user", &a.prompt));
        Prompt::Chat(messages)
    };
    let ids = engine.prompt_ids(&prompt)?;
    let (device, load_s) = (engine.device().to_string(), engine.load_s());
    tracing::info!(
        "loaded on {device} in {load_s:.2} s; the prompt has {} tokens",
        ids.len()
    );
    // Ctrl-C stops the generation before its next token and the answer so far stands; a second
    // Ctrl-C ends the program at once. Before this point the default (end at once) applies.
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::Relaxed) {
            std::process::exit(130);
        }
    })?;
    let opts = GenerateOptions {
        sampling,
        max_tokens: a.max_tokens,
        cancel: Some(cancel),
        ..GenerateOptions::default()
    };
    let mut stats: Option<Stats> = None;
    let mut streamed = false;
    let mut out = std::io::stdout().lock();
    for event in engine.generate(ids.clone(), opts)? {
        match event? {
            Event::Token { text, .. } if !a.json => {
                write_or_exit(&mut out, text.as_bytes());
                streamed |= !text.is_empty();
            }
            Event::Token { .. } => {}
            Event::Done(s) => stats = Some(s),
        }
    }
    let s = stats.expect("a generation ends with Done");
    if a.json {
        let json = serde_json::json!({
            "prompt_tokens": ids,
            "tokens": s.tokens,
            "text": s.text,
            "stop_reason": s.stop.as_str(),
            "device": device,
            "timings": {
                "load_s": load_s,
                "prefill_tok_per_s": s.prefill_tok_per_s(),
                "decode_tok_per_s": s.decode_tok_per_s(),
                "ttft_s": s.ttft_s,
            },
        });
        write_or_exit(&mut out, format!("{json}\n").as_bytes());
    } else if streamed {
        write_or_exit(&mut out, b"\n");
    }
    if !a.json && !crate::quiet() {
        eprintln!("{}", stats_line(&device, &s));
    }
    if s.stop == StopReason::Cancelled {
        std::process::exit(130);
    }
    Ok(())
}

/// `[cpu] 20 prompt tokens, 64 generated, stop: max_tokens; prefill 151.0 tok/s, first token
/// after 0.132 s, decode 14.8 tok/s`, leaving out figures that were not measured.
fn stats_line(device: &str, s: &Stats) -> String {
    let mut line = format!(
        "[{device}] {} prompt tokens, {} generated, stop: {}",
        s.prompt_tokens,
        s.tokens.len(),
        s.stop.as_str()
    );
    if s.prefill_s > 0.0 {
        line += &format!(
            "; prefill {:.1} tok/s, first token after {:.3} s",
            s.prefill_tok_per_s(),
            s.ttft_s
        );
    }
    if s.decode_steps > 0 {
        line += &format!(", decode {:.1} tok/s", s.decode_tok_per_s());
    }
    line
}
