//! `orcd bench`: load time (cold and warm page cache), prefill and decode speed on a
//! fixed prompt, GPU memory, and the weight bandwidth decoding achieves.
use std::time::Instant;

use anyhow::{Result, bail};
use orcd::engine::{Engine, Event, GenerateOptions, Stats};
use orcd::sampling::SamplingParams;

use crate::common::ModelArgs;

/// The H100's memory bandwidth, the ceiling for decoding at batch 1.
const PEAK_BYTES_PER_S: f64 = 3.0e12;

/// The prompt's source: plain English, repeated and cut to `--prompt-len` tokens, so every run
/// and every engine sees the same ids.
const PROMPT_TEXT: &str = "The history of computing is a story of ever smaller and faster \
machines. Early computers filled whole rooms and used vacuum tubes; transistors, integrated \
circuits and microprocessors followed, each multiplying speed while cutting cost and power. \
Graphics processors, built to shade millions of pixels in parallel, turned out to suit the \
matrix arithmetic of neural networks, and today they train and serve language models. ";

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length in tokens (default: 512; 128 with --concurrency).
    #[arg(long)]
    prompt_len: Option<usize>,
    /// Tokens generated per run (end-of-sequence tokens do not stop a run) (default: 256; 128
    /// with --concurrency).
    #[arg(long = "gen")]
    gen_tokens: Option<usize>,
    /// Sequences at once through the batching engine, e.g. 1,8,32,64,128,256: one round per
    /// number, each reporting aggregate and decode-only throughput (default: none, one stream
    /// through the single-sequence engine).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    concurrency: Vec<u64>,
    /// With --concurrency: a lone sequence stays on the batched pass (tokens independent of
    /// the batch) instead of the single-sequence kernels.
    #[arg(long)]
    batch_invariant: bool,
    /// Timed runs, after one warm-up run.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let batched = !a.concurrency.is_empty();
    let (prompt_len, gen_tokens) = match batched {
        true => (a.prompt_len.unwrap_or(128), a.gen_tokens.unwrap_or(128)),
        false => (a.prompt_len.unwrap_or(512), a.gen_tokens.unwrap_or(256)),
    };
    if a.runs == 0 || gen_tokens < 2 || prompt_len == 0 {
        bail!("--runs must be at least 1, --gen at least 2 and --prompt-len at least 1");
    }
    if batched {
        let levels: Vec<usize> = a.concurrency.iter().map(|&n| n as usize).collect();
        let engine = crate::bench_batch::engine(&a.model, &levels, a.batch_invariant)?;
        let prompt = prompt_ids(engine.tokenizer(), prompt_len)?;
        return crate::bench_batch::main(&engine, &prompt, &levels, gen_tokens, a.json);
    }
    let path = a.model.path()?;
    // Cold: the file's pages dropped from the page cache first. Warm: loaded again at once.
    evict_page_cache(&path)?;
    let cold_load_s = a.model.load()?.load_s();
    let mut engine = a.model.load()?;
    let warm_load_s = engine.load_s();

    let prompt = prompt_ids(engine.tokenizer(), prompt_len)?;
    let opts = GenerateOptions {
        sampling: SamplingParams::greedy(),
        max_tokens: gen_tokens,
        ignore_eos: true,
        ..GenerateOptions::default()
    };
    run_once(&mut engine, &prompt, &opts)?; // warm-up
    let runs: Vec<Stats> = (0..a.runs)
        .map(|_| run_once(&mut engine, &prompt, &opts))
        .collect::<Result<_>>()?;

    let decode: Vec<f64> = runs.iter().map(Stats::decode_tok_per_s).collect();
    let prefill: Vec<f64> = runs.iter().map(Stats::prefill_tok_per_s).collect();
    let ttft: Vec<f64> = runs.iter().map(|s| s.ttft_s).collect();
    let bytes = engine.weight_bytes_per_token();
    let bandwidth = bytes as f64 * mean(&decode) / PEAK_BYTES_PER_S;
    let gpu_mem = engine.gpu_memory_used();
    let report = serde_json::json!({
        "model": path.display().to_string(),
        "device": engine.device(),
        "weights": a.model.weights,
        "prompt_len": prompt_len,
        "gen": gen_tokens,
        "runs": a.runs,
        "decode_tok_per_s": { "mean": mean(&decode), "min": min(&decode), "max": max(&decode) },
        "prefill_tok_per_s": { "mean": mean(&prefill), "min": min(&prefill), "max": max(&prefill) },
        "ttft_s": mean(&ttft),
        "load_s": { "cold": cold_load_s, "warm": warm_load_s },
        "gpu_memory_bytes": gpu_mem,
        "weight_bytes_per_token": bytes,
        "bandwidth_fraction_of_3tb_s": bandwidth,
    });
    if a.json {
        println!("{report}");
        return Ok(());
    }
    println!("model            {}", path.display());
    println!(
        "device           {} (weights {})",
        engine.device(),
        a.model.weights
    );
    println!(
        "decode           {:.1} tok/s (min {:.1}, max {:.1}) over {} runs of {} tokens",
        mean(&decode),
        min(&decode),
        max(&decode),
        a.runs,
        gen_tokens
    );
    println!(
        "prefill          {:.0} tok/s (min {:.0}, max {:.0}) for {} tokens",
        mean(&prefill),
        min(&prefill),
        max(&prefill),
        prompt_len
    );
    println!("first token      {:.2} ms", mean(&ttft) * 1e3);
    println!("load             {cold_load_s:.2} s cold, {warm_load_s:.2} s warm");
    if let Some(m) = gpu_mem {
        println!("GPU memory       {:.2} GiB", m as f64 / (1u64 << 30) as f64);
    }
    println!(
        "weights/token    {:.1} MB, {:.1}% of 3 TB/s",
        bytes as f64 / 1e6,
        bandwidth * 100.0
    );
    Ok(())
}

/// `len` token ids of the fixed prompt text.
fn prompt_ids(tokenizer: &orcd::tokenizer::Tokenizer, len: usize) -> Result<Vec<u32>> {
    let ids = tokenizer.encode(PROMPT_TEXT)?;
    Ok(ids.iter().copied().cycle().take(len).collect())
}

fn run_once(engine: &mut Engine, prompt: &[u32], opts: &GenerateOptions) -> Result<Stats> {
    let t = Instant::now();
    for event in engine.generate(prompt.to_vec(), opts.clone())? {
        if let Event::Done(stats) = event? {
            if stats.tokens.len() != opts.max_tokens {
                bail!(
                    "a bench run generated {} tokens, not {}",
                    stats.tokens.len(),
                    opts.max_tokens
                );
            }
            return Ok(stats);
        }
    }
    bail!("generation ended without its stats after {:?}", t.elapsed())
}

/// Drops the file's pages from the page cache, so that the next load reads the disk.
fn evict_page_cache(path: &std::path::Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path)?;
    file.sync_all().ok();
    // SAFETY: a valid open descriptor; POSIX_FADV_DONTNEED only drops clean cached pages.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!(
            "{}: could not drop it from the page cache (posix_fadvise error {rc})",
            path.display()
        );
    }
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}
