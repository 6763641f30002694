//! `orcd bench --concurrency 1,8,32,…`: the batching engine in process (no HTTP). For each N,
//! N sequences with fixed prompts, submitted at once, each generating `--gen` tokens greedily
//! past end-of-sequence; aggregate and decode-only throughput, step latency, prefill speed,
//! peak KV pool use and GPU memory.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use orcd::batch::{BatchEngine, BatchOptions, Request, Sampling, SeqEvent};
use orcd::sampling::SamplingParams;

/// What one N gave.
struct Round {
    n: usize,
    /// Every request's token arrival times, from the first submission.
    times: Vec<Vec<f64>>,
    wall_s: f64,
    peak_kv_tokens: usize,
}

/// Runs the rounds and prints them (a table, or one JSON object per line).
pub fn main(
    engine: &BatchEngine,
    prompt: &[u32],
    levels: &[usize],
    gen_tokens: usize,
    json: bool,
) -> Result<()> {
    // Warm-up: the kernels' first launches and the pool's first blocks.
    run(engine, prompt, levels[0].min(8), gen_tokens.min(16))?;
    for &n in levels {
        let r = run(engine, prompt, n, gen_tokens)?;
        let st = engine.status();
        if st.kv_blocks_used != 0 {
            bail!(
                "after {n} sequences the KV pool still holds {} blocks",
                st.kv_blocks_used
            );
        }
        report(&r, prompt.len(), gen_tokens, engine, json);
    }
    Ok(())
}

/// Sequence `i`'s prompt: the fixed prompt rotated by `i` tokens, so no two are the same.
fn prompt_of(prompt: &[u32], i: usize) -> Vec<u32> {
    let k = i % prompt.len();
    prompt[k..].iter().chain(&prompt[..k]).copied().collect()
}

fn run(engine: &BatchEngine, prompt: &[u32], n: usize, gen_tokens: usize) -> Result<Round> {
    let peak = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (e, peak, done) = (engine.clone(), peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let st = e.status();
                peak.fetch_max(st.kv_blocks_used * st.kv_block_tokens, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let t0 = Instant::now();
    let handles = (0..n)
        .map(|i| {
            let req = Request {
                prompt: prompt_of(prompt, i),
                sampling: Sampling {
                    params: SamplingParams::greedy(),
                    frequency_penalty: 0.0,
                    presence_penalty: 0.0,
                },
                max_tokens: gen_tokens,
                stop_ids: Vec::new(),
                stop_strings: Vec::new(),
                ignore_eos: true,
                logprobs: None,
            };
            Ok(engine.submit(req)?)
        })
        .collect::<Result<Vec<_>>>()?;
    // One reader a request, so each token's time is when the engine sent it.
    let readers: Vec<_> = handles
        .into_iter()
        .map(|mut h| {
            std::thread::spawn(move || -> Result<Vec<f64>, String> {
                let mut times = Vec::new();
                loop {
                    match h.events.blocking_recv() {
                        Some(SeqEvent::Token { .. }) => times.push(t0.elapsed().as_secs_f64()),
                        Some(SeqEvent::Done { .. }) => return Ok(times),
                        Some(SeqEvent::Error(e)) => return Err(e),
                        None => return Err("the stream ended without Done".into()),
                    }
                }
            })
        })
        .collect();
    let mut times = Vec::with_capacity(n);
    for r in readers {
        let t = r.join().expect("a reader thread panicked");
        times.push(t.map_err(anyhow::Error::msg)?);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    watcher.join().expect("the watcher thread panicked");
    if let Some(t) = times.iter().find(|t| t.len() != gen_tokens) {
        bail!("a sequence generated {} tokens, not {gen_tokens}", t.len());
    }
    Ok(Round {
        n,
        times,
        wall_s,
        peak_kv_tokens: peak.load(Ordering::Relaxed),
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(r: &Round, prompt_len: usize, gen_tokens: usize, engine: &BatchEngine, json: bool) {
    let generated = r.n * gen_tokens;
    // Decode only: from the moment every sequence has its first token (all prompts are in)
    // to the end, the tokens that came in that span, as llama-batched-bench's S_TG counts.
    let all_started = r.times.iter().map(|t| t[0]).fold(0.0, f64::max);
    let decode_tokens = r
        .times
        .iter()
        .flatten()
        .filter(|&&t| t > all_started)
        .count();
    let decode_s = r.wall_s - all_started;
    // A sequence's gaps between tokens after its first: each is one engine step it was in.
    let mut gaps: Vec<f64> = r
        .times
        .iter()
        .flat_map(|t| t.windows(2).map(|w| w[1] - w[0]))
        .collect();
    gaps.sort_by(f64::total_cmp);
    let gpu_memory = orcd::cuda::Device::open(0)
        .and_then(|d| d.memory())
        .ok()
        .map(|(free, total)| total - free);
    let out = serde_json::json!({
        "concurrency": r.n,
        "device": engine.device(),
        "prompt_len": prompt_len,
        "gen": gen_tokens,
        "wall_s": r.wall_s,
        "output_tok_per_s": generated as f64 / r.wall_s,
        "decode_tok_per_s": decode_tokens as f64 / decode_s,
        "prefill_tok_per_s": (r.n * prompt_len) as f64 / all_started,
        "step_latency_ms": { "p50": percentile(&gaps, 0.5) * 1e3, "p99": percentile(&gaps, 0.99) * 1e3 },
        "peak_kv_tokens": r.peak_kv_tokens,
        "gpu_memory_bytes": gpu_memory,
    });
    if json {
        println!("{out}");
    } else {
        println!(
            "N {:>4}: {:>9.1} tok/s output, {:>9.1} tok/s decode, step p50 {:.2} ms p99 {:.2} ms, prefill {:.0} tok/s, peak KV {} tokens",
            r.n,
            generated as f64 / r.wall_s,
            decode_tokens as f64 / decode_s,
            percentile(&gaps, 0.5) * 1e3,
            percentile(&gaps, 0.99) * 1e3,
            (r.n * prompt_len) as f64 / all_started,
            r.peak_kv_tokens
        );
    }
}

/// The engine the rounds run on: room for the largest N at once.
pub fn engine(
    model: &crate::common::ModelArgs,
    levels: &[usize],
    batch_invariant: bool,
) -> Result<BatchEngine> {
    let most = levels.iter().copied().max().unwrap_or(1);
    let opts = BatchOptions {
        max_running: most,
        max_queue: most,
        batch_invariant,
        ..BatchOptions::default()
    };
    Ok(BatchEngine::start(
        &model.path()?,
        &model.load_options(),
        &opts,
    )?)
}
