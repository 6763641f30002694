//! `GET /metrics`: Prometheus' text format (version 0.0.4) from a small registry of counters
//! and histograms the request path updates, plus the engine's gauges read at scrape time.
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use orcd::batch::EngineStatus;

/// How a request that reached the engine ended, or why it never started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// `/cancel`, a client that went away, or a drain that ran out of time.
    Cancelled,
    /// The per-request timeout.
    Timeout,
    /// The engine failed the request.
    Error,
    /// Refused before it started: the queue was full or the server was shutting down.
    Rejected,
}

impl Outcome {
    const ALL: [Outcome; 6] = [
        Outcome::Stop,
        Outcome::Length,
        Outcome::Cancelled,
        Outcome::Timeout,
        Outcome::Error,
        Outcome::Rejected,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
            Outcome::Rejected => "rejected",
        }
    }
}

/// A histogram of durations with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then the sum of all observations.
    state: Mutex<(Vec<u64>, f64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            state: Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    pub fn observe(&self, d: Duration) {
        let x = d.as_secs_f64();
        let i = self.bounds.partition_point(|&b| b < x);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.0[i] += 1;
        state.1 += x;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let (counts, sum) = self.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
const E2E_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0,
];

/// Everything the request path counts.
pub struct Metrics {
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    outcomes: [AtomicU64; Outcome::ALL.len()],
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            outcomes: Default::default(),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
            e2e: Histogram::new(E2E_BOUNDS),
        }
    }
}

impl Metrics {
    pub fn prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn generated_token(&self) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
    }

    pub fn outcome(&self, o: Outcome) {
        let i = Outcome::ALL.iter().position(|&x| x == o).unwrap_or(0);
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The text format: the engine's gauges (while it runs) and the GPU memory in use (on a
    /// GPU), then the counters and histograms.
    pub fn render(&self, engine: Option<&EngineStatus>, gpu_memory: Option<u64>) -> String {
        let mut out = String::new();
        if let Some(bytes) = gpu_memory {
            gauge(
                &mut out,
                "orcd_gpu_memory_used_bytes",
                "GPU memory in use, as the driver counts it (total less free).",
                bytes as f64,
            );
        }
        if let Some(s) = engine {
            let gauges = [
                (
                    "orcd_requests_running",
                    "Requests in the running batch.",
                    s.running,
                ),
                (
                    "orcd_requests_waiting",
                    "Requests queued to start.",
                    s.waiting,
                ),
                (
                    "orcd_kv_blocks_used",
                    "KV cache blocks in use.",
                    s.kv_blocks_used,
                ),
                (
                    "orcd_kv_blocks_total",
                    "KV cache blocks in the pool.",
                    s.kv_blocks_total,
                ),
                (
                    "orcd_kv_block_tokens",
                    "Tokens one KV block holds.",
                    s.kv_block_tokens,
                ),
            ];
            for (name, help, value) in gauges {
                header(&mut out, name, help, "gauge");
                let _ = writeln!(out, "{name} {value}");
            }
            let usage = s.kv_blocks_used as f64 / s.kv_blocks_total.max(1) as f64;
            gauge(
                &mut out,
                "orcd_kv_usage_ratio",
                "Fraction of the KV pool in use.",
                usage,
            );
            counter(
                &mut out,
                "orcd_engine_steps_total",
                "Forward steps run.",
                s.steps,
            );
            counter(
                &mut out,
                "orcd_preemptions_total",
                "Requests sent back to the queue because the KV pool ran out.",
                s.preemptions,
            );
        }
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        counter(
            &mut out,
            "orcd_prompt_tokens_total",
            "Prompt tokens of requests submitted.",
            load(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "orcd_generation_tokens_total",
            "Tokens generated.",
            load(&self.generation_tokens),
        );
        header(
            &mut out,
            "orcd_requests_total",
            "Requests by how they ended (rejected: queue full or shutting down).",
            "counter",
        );
        for (o, c) in Outcome::ALL.iter().zip(&self.outcomes) {
            let _ = writeln!(
                out,
                "orcd_requests_total{{outcome=\"{}\"}} {}",
                o.as_str(),
                load(c)
            );
        }
        self.ttft.render(
            &mut out,
            "orcd_time_to_first_token_seconds",
            "From the request's arrival to its first token.",
        );
        self.itl.render(
            &mut out,
            "orcd_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
        );
        self.e2e.render(
            &mut out,
            "orcd_e2e_request_latency_seconds",
            "From the request's arrival to its last token, for requests that finished.",
        );
        out
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn counter(out: &mut String, name: &str, help: &str, value: u64) {
    header(out, name, help, "counter");
    let _ = writeln!(out, "{name} {value}");
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    header(out, name, help, "gauge");
    let _ = writeln!(out, "{name} {value}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let m = Metrics::default();
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_secs(100));
        let text = m.render(None, None);
        for line in [
            "orcd_time_to_first_token_seconds_bucket{le=\"0.001\"} 0",
            "orcd_time_to_first_token_seconds_bucket{le=\"0.005\"} 2",
            "orcd_time_to_first_token_seconds_bucket{le=\"80\"} 2",
            "orcd_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3",
            "orcd_time_to_first_token_seconds_sum 100.006",
            "orcd_time_to_first_token_seconds_count 3",
            "# TYPE orcd_time_to_first_token_seconds histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn counters_and_engine_gauges() {
        let m = Metrics::default();
        m.prompt_tokens(7);
        m.generated_token();
        m.outcome(Outcome::Timeout);
        let status = EngineStatus {
            running: 2,
            waiting: 1,
            kv_blocks_used: 4,
            kv_blocks_total: 16,
            kv_block_tokens: 16,
            steps: 9,
            preemptions: 3,
        };
        let text = m.render(Some(&status), Some(3 << 30));
        for line in [
            "orcd_prompt_tokens_total 7",
            "orcd_generation_tokens_total 1",
            "orcd_requests_total{outcome=\"timeout\"} 1",
            "orcd_requests_total{outcome=\"stop\"} 0",
            "orcd_requests_running 2",
            "orcd_requests_waiting 1",
            "orcd_kv_blocks_used 4",
            "orcd_kv_usage_ratio 0.25",
            "orcd_engine_steps_total 9",
            "orcd_preemptions_total 3",
            "orcd_gpu_memory_used_bytes 3221225472",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        // Every sample line belongs to a declared metric.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                text.contains(&format!("# TYPE {name} "))
                    || text.contains(&format!("# TYPE {base} ")),
                "{line}"
            );
        }
    }
}
