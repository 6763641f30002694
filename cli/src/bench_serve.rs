//! `orcd bench-serve`: load on an OpenAI-compatible server (orcd, llama-server, vLLM, …) from
//! N streaming clients in a closed loop (each sends its next request when its last one
//! ends), for each N of a list. Every client makes one warm-up request, not counted; the
//! timed rounds start together. Reports aggregate output tokens per second, time to first
//! token and inter-token latency (p50, p99) and errors.
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

#[derive(clap::Args)]
pub struct Args {
    /// The server's base URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The model to ask for (default: the first one the server's /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Bearer token to send (default: none).
    #[arg(long, env = "ORCD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Concurrent clients, one run per number.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    clients: Vec<usize>,
    /// Prompt length in words (each one token in common vocabularies).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens generated per request (`max_tokens`, with `ignore_eos`).
    #[arg(long = "gen", default_value_t = 128)]
    gen_tokens: usize,
    /// Timed requests per client, after its warm-up request.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Seconds one request may take before it counts as an error.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one request measured.
#[derive(Default)]
struct Sample {
    ok: bool,
    tokens: usize,
    ttft: Option<Duration>,
    itl: Vec<Duration>,
}

pub fn main(a: Args) -> Result<()> {
    if a.clients.contains(&0) || a.rounds == 0 || a.gen_tokens == 0 || a.prompt_len == 0 {
        bail!("--clients, --rounds, --gen and --prompt-len must be at least 1");
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(a.timeout)))
        .max_idle_connections(1024)
        .max_idle_connections_per_host(1024)
        .build()
        .into();
    let url = a.url.trim_end_matches('/').to_string();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model(&agent, &url, a.api_key.as_deref())?,
    };
    let mut results = Vec::new();
    for &n in &a.clients {
        let r = run(&agent, &url, &model, &a, n);
        if !a.json {
            if results.is_empty() {
                println!(
                    "{:>7} {:>8} {:>6} {:>12} {:>10} {:>10} {:>9} {:>9}",
                    "clients",
                    "requests",
                    "errors",
                    "output tok/s",
                    "TTFT p50",
                    "TTFT p99",
                    "ITL p50",
                    "ITL p99"
                );
            }
            let ms = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1} ms"));
            let n = |v: &Value| v.as_u64().unwrap_or(0);
            println!(
                "{:>7} {:>8} {:>6} {:>12.1} {:>10} {:>10} {:>9} {:>9}",
                n(&r["clients"]),
                n(&r["requests"]),
                n(&r["errors"]),
                r["output_tok_per_s"].as_f64().unwrap_or(0.0),
                ms(&r["ttft_ms"]["p50"]),
                ms(&r["ttft_ms"]["p99"]),
                ms(&r["itl_ms"]["p50"]),
                ms(&r["itl_ms"]["p99"]),
            );
        }
        results.push(r);
    }
    if a.json {
        let report = json!({
            "url": url,
            "model": model,
            "prompt_words": a.prompt_len,
            "gen": a.gen_tokens,
            "rounds": a.rounds,
            "results": results,
        });
        println!("{report}");
    }
    Ok(())
}

fn first_model(agent: &ureq::Agent, url: &str, key: Option<&str>) -> Result<String> {
    let mut req = agent.get(format!("{url}/v1/models"));
    if let Some(key) = key {
        req = req.header("Authorization", &format!("Bearer {key}"));
    }
    let mut resp = req.call().with_context(|| format!("{url}/v1/models"))?;
    let body: Value = resp
        .body_mut()
        .read_json()
        .with_context(|| format!("{url}/v1/models: not JSON"))?;
    body["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{url}/v1/models lists no model; pass --model"))
}

/// `n` clients: a warm-up request each, then `rounds` timed requests each, all at once.
fn run(agent: &ureq::Agent, url: &str, model: &str, a: &Args, n: usize) -> Value {
    let barrier = Arc::new(Barrier::new(n + 1));
    let clients: Vec<_> = (0..n)
        .map(|c| {
            let (agent, barrier) = (agent.clone(), barrier.clone());
            let body = |round: usize| {
                json!({
                    "model": model,
                    "prompt": prompt(c, round, a.prompt_len),
                    "max_tokens": a.gen_tokens,
                    "ignore_eos": true,
                    "temperature": 0,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                })
            };
            let bodies: Vec<Value> = (0..=a.rounds).map(body).collect();
            let (url, key) = (format!("{url}/v1/completions"), a.api_key.clone());
            std::thread::spawn(move || {
                request(&agent, &url, key.as_deref(), &bodies[0]);
                barrier.wait();
                bodies[1..]
                    .iter()
                    .map(|b| request(&agent, &url, key.as_deref(), b))
                    .collect::<Vec<Sample>>()
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let samples: Vec<Sample> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap_or_default())
        .collect();
    let wall = t0.elapsed().as_secs_f64();
    let errors = samples.iter().filter(|s| !s.ok).count();
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().filter_map(|s| s.ttft).map(ms).collect();
    let mut itl: Vec<f64> = samples
        .iter()
        .flat_map(|s| &s.itl)
        .copied()
        .map(ms)
        .collect();
    json!({
        "clients": n,
        "requests": samples.len(),
        "errors": errors,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens as f64 / wall,
        "ttft_ms": {"p50": percentile(&mut ttft, 50.0), "p99": percentile(&mut ttft, 99.0)},
        "itl_ms": {"p50": percentile(&mut itl, 50.0), "p99": percentile(&mut itl, 99.0)},
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p`-th percentile (nearest rank); `None` without samples.
fn percentile(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// A prompt of `words` words; its first words differ from client to client and round to
/// round, so that no server can reuse another request's prefix.
fn prompt(client: usize, round: usize, words: usize) -> String {
    const WORDS: [&str; 8] = [
        "river", "stone", "cloud", "maple", "ember", "harbor", "lantern", "meadow",
    ];
    let mut text = format!("{client} {round}");
    for i in 2..words {
        text.push(' ');
        text.push_str(WORDS[(i * 7 + client + round) % WORDS.len()]);
    }
    text
}

/// One streamed completion: the time to its first text, the gaps between later chunks, and
/// its token count (the server's usage, else one per chunk).
fn request(agent: &ureq::Agent, url: &str, key: Option<&str>, body: &Value) -> Sample {
    let mut sample = Sample::default();
    let t0 = Instant::now();
    let mut req = agent.post(url);
    if let Some(key) = key {
        req = req.header("Authorization", &format!("Bearer {key}"));
    }
    let resp = match req.send_json(body) {
        Ok(r) if r.status() == 200 => r,
        Ok(r) => {
            tracing::warn!("{url}: HTTP {}", r.status());
            return sample;
        }
        Err(e) => {
            tracing::warn!("{url}: {e}");
            return sample;
        }
    };
    let mut last = None;
    let mut chunks = 0;
    let mut usage = None;
    let mut done = false;
    for line in BufReader::new(resp.into_body().into_reader()).lines() {
        let Ok(line) = line else { break };
        let Some(data) = line.strip_prefix("data:").map(str::trim) else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            break;
        };
        if chunk.get("error").is_some() {
            tracing::warn!("{url}: {chunk}");
            break;
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            usage = Some(n as usize);
        }
        let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
        if !text.is_empty() {
            let now = Instant::now();
            match last {
                None => sample.ttft = Some(now - t0),
                Some(prev) => sample.itl.push(now - prev),
            }
            last = Some(now);
            chunks += 1;
        }
    }
    sample.tokens = usage.unwrap_or(chunks);
    sample.ok = done && sample.ttft.is_some();
    sample
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), Some(50.0));
        assert_eq!(percentile(&mut v, 99.0), Some(99.0));
        assert_eq!(percentile(&mut [7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&mut [], 50.0), None);
    }

    #[test]
    fn prompts_have_their_length_and_differ() {
        let p = prompt(3, 1, 128);
        assert_eq!(p.split(' ').count(), 128);
        assert_ne!(prompt(3, 1, 128), prompt(4, 1, 128));
        assert_ne!(prompt(3, 1, 128), prompt(3, 2, 128));
    }
}
