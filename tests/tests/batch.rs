//! The continuous-batching engine on the CPU backend, on the real model: what a request gets
//! does not depend on what else runs (batching, chunked prefill, preemption), cancelled
//! requests give their KV blocks back, stop strings are never emitted, and bad requests are
//! refused at `submit`.
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use orcd::batch::backend::{Backend, Row, RowOutput};
use orcd::batch::cpu::CpuBackend;
use orcd::batch::{
    BatchEngine, BatchOptions, EngineStatus, FinishReason, Request, RequestHandle, Sampling,
    SeqEvent, SubmitError, TokenLogprob, Usage,
};
use orcd::cpu::model::{CpuModel, KvCache};
use orcd::engine::{DeviceChoice, Engine, Event, GenerateOptions, LoadOptions};
use orcd::sampling::SamplingParams;
use orcd::tokenizer::Tokenizer;
use orcd_tests::{Rng, gguf, model_path, ref_prompts};

/// The context of these tests' engines: small, so a too-long prompt is cheap to make.
const CTX: usize = 512;

/// The CPU weights (~2.5 GB), loaded once per test process and shared by every engine here.
fn model() -> Arc<CpuModel> {
    static M: OnceLock<Arc<CpuModel>> = OnceLock::new();
    M.get_or_init(|| Arc::new(CpuModel::load(gguf(), CTX).expect("loading the CPU model")))
        .clone()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(gguf()).expect("building the tokenizer")
}

/// An engine on the shared weights with `opts`; its pool holds `opts.kv_tokens` positions, or
/// four contexts.
fn engine(opts: BatchOptions) -> BatchEngine {
    let kv_tokens = opts.kv_tokens.unwrap_or(4 * CTX);
    let backend = CpuBackend::new(model(), kv_tokens);
    BatchEngine::with_backend(Box::new(backend), tokenizer(), &opts).expect("starting")
}

pub(super) fn greedy(prompt: &[u32], max_tokens: usize) -> Request {
    Request {
        prompt: prompt.to_vec(),
        sampling: Sampling {
            params: SamplingParams::greedy(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        },
        max_tokens,
        stop_ids: Vec::new(),
        stop_strings: Vec::new(),
        ignore_eos: false,
        logprobs: None,
    }
}

/// Short prompts of different lengths: the reference prompts' and two of raw text.
pub(super) fn prompts() -> Vec<Vec<u32>> {
    let tok = tokenizer();
    let mut p: Vec<Vec<u32>> = ref_prompts().into_iter().map(|p| p.ids).collect();
    for text in ["def fibonacci(n):", "The three primary colours are"] {
        p.push(tok.encode(text).unwrap());
    }
    p
}

/// Everything a request's stream carried.
pub(super) struct Outcome {
    pub(super) ids: Vec<u32>,
    /// The text of every event, `Done`'s included.
    text: String,
    /// Each token event's text, in order.
    pieces: Vec<String>,
    logprobs: Vec<(TokenLogprob, Vec<TokenLogprob>)>,
    reason: FinishReason,
    usage: Usage,
}

pub(super) fn collect(mut h: RequestHandle) -> Outcome {
    let (mut ids, mut text, mut pieces, mut logprobs) = (vec![], String::new(), vec![], vec![]);
    loop {
        match h
            .events
            .blocking_recv()
            .expect("the stream ended without Done")
        {
            SeqEvent::Token {
                id,
                text: t,
                piece,
                logprob,
            } => {
                ids.push(id);
                text.push_str(&t);
                pieces.push(piece);
                logprobs.extend(logprob);
            }
            SeqEvent::Done {
                reason,
                usage,
                text: t,
            } => {
                text.push_str(&t);
                return Outcome {
                    ids,
                    text,
                    pieces,
                    logprobs,
                    reason,
                    usage,
                };
            }
            SeqEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
}

/// Polls the engine's status until `done` holds (panics after a minute).
pub(super) fn wait_for(e: &BatchEngine, done: impl Fn(&EngineStatus) -> bool) -> EngineStatus {
    let t0 = Instant::now();
    loop {
        let st = e.status();
        if done(&st) {
            return st;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "still {st:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each prompt alone, one after another.
pub(super) fn alone(e: &BatchEngine, reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| collect(e.submit(r.clone()).unwrap()).ids)
        .collect()
}

/// All prompts at once.
pub(super) fn together(e: &BatchEngine, reqs: &[Request]) -> Vec<Vec<u32>> {
    let handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    handles.into_iter().map(|h| collect(h).ids).collect()
}

#[test]
fn batched_tokens_equal_alone_and_engine_generate() {
    let reqs: Vec<Request> = prompts().iter().map(|p| greedy(p, 6)).collect();
    let solo = alone(&engine(BatchOptions::default()), &reqs);
    // Small prefill chunks: the long prompts are prefilled over several steps, next to the
    // decode rows of the others.
    let e = engine(BatchOptions {
        step_tokens: 16,
        ..BatchOptions::default()
    });
    let batch = together(&e, &reqs);
    assert!(e.status().steps > 6, "{:?}", e.status());
    let load = LoadOptions {
        device: DeviceChoice::Cpu,
        ctx: Some(CTX),
        ..LoadOptions::default()
    };
    let mut engine = Engine::load(&model_path(), &load).unwrap();
    for ((r, solo), batch) in reqs.iter().zip(&solo).zip(&batch) {
        let opts = GenerateOptions {
            sampling: SamplingParams::greedy(),
            max_tokens: 6,
            ..GenerateOptions::default()
        };
        let mut want = Vec::new();
        for ev in engine.generate(r.prompt.clone(), opts).unwrap() {
            if let Event::Token { id, .. } = ev.unwrap() {
                want.push(id);
            }
        }
        assert!(!want.is_empty());
        assert_eq!(
            solo, &want,
            "alone vs Engine::generate, prompt {:?}",
            r.prompt
        );
        assert_eq!(
            batch, &want,
            "batched vs Engine::generate, prompt {:?}",
            r.prompt
        );
    }
}

#[test]
fn a_tiny_pool_preempts_and_outputs_do_not_change() {
    let mut reqs: Vec<Request> = prompts().iter().map(|p| greedy(p, 8)).collect();
    for r in &mut reqs {
        r.ignore_eos = true;
    }
    let solo = alone(&engine(BatchOptions::default()), &reqs);
    // Five blocks of 16: the 47-token prompt and two short ones fill it, and the long one's
    // next block must come from a preempted sequence.
    let e = engine(BatchOptions {
        kv_tokens: Some(80),
        ..BatchOptions::default()
    });
    let batch = together(&e, &reqs);
    let st = wait_for(&e, |s| s.running == 0);
    assert!(st.preemptions > 0, "no preemption: {st:?}");
    assert_eq!((st.kv_blocks_used, st.kv_blocks_total), (0, 5));
    assert_eq!(batch, solo);
}

#[test]
fn cancel_and_dropped_receivers_free_their_blocks() {
    let e = engine(BatchOptions {
        max_running: 2,
        ..BatchOptions::default()
    });
    let p = prompts();
    let long = |p: &[u32]| Request {
        ignore_eos: true,
        ..greedy(p, 400)
    };
    let mut a = e.submit(long(&p[0])).unwrap();
    let mut b = e.submit(long(&p[1])).unwrap();
    // Third in line behind two running: cancelled while it waits.
    let c = e.submit(long(&p[2])).unwrap();
    c.cancel.cancel();
    assert!(matches!(
        a.events.blocking_recv(),
        Some(SeqEvent::Token { .. })
    ));
    assert!(matches!(
        b.events.blocking_recv(),
        Some(SeqEvent::Token { .. })
    ));
    assert!(e.status().kv_blocks_used > 0);
    a.cancel.cancel();
    drop(b);
    let a = collect(a);
    assert_eq!(a.reason, FinishReason::Cancelled);
    assert!(
        a.usage.completion_tokens < 400,
        "{}",
        a.usage.completion_tokens
    );
    let c = collect(c);
    assert_eq!(
        (c.reason, c.usage.completion_tokens),
        (FinishReason::Cancelled, 0)
    );
    let st = wait_for(&e, |s| s.running == 0 && s.waiting == 0);
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
}

#[test]
fn stop_strings_across_tokens_are_never_emitted() {
    let e = engine(BatchOptions::default());
    let prompt = &prompts()[1];
    let free = collect(e.submit(greedy(prompt, 12)).unwrap());
    // A stop string made of the end of token 2 and the start of token 3.
    let tok = tokenizer();
    let piece = |i: usize| tok.decode(&free.ids[i..=i]).unwrap();
    let (a, b) = (piece(2), piece(3));
    assert!(
        a.chars().count() >= 2 && b.chars().count() >= 2,
        "{a:?} {b:?}"
    );
    let stop: String = a
        .chars()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let stop = stop + &b.chars().take(2).collect::<String>();
    let want = &free.text[..free.text.find(&stop).unwrap()];
    // A second stop string that begins in the text but never completes: its held text is
    // released.
    let never = free.text.chars().skip(1).take(8).collect::<String>() + "never";
    let mut req = greedy(prompt, 12);
    req.stop_strings = vec![never, stop.clone()];
    let out = collect(e.submit(req).unwrap());
    println!("{:?} cut by {stop:?}: {:?}", free.text, out.text);
    assert_eq!(out.reason, FinishReason::Stop);
    assert_eq!(out.text, want);
    assert_eq!(out.ids, free.ids[..out.ids.len()]);
    assert!(out.ids.len() <= 4, "went on after the stop: {:?}", out.ids);
    // Without the stop string, the same request runs to max_tokens.
    assert_eq!((free.reason, free.ids.len()), (FinishReason::Length, 12));
    assert_eq!(free.pieces.concat(), free.text);
}

#[test]
fn logprobs_are_the_log_softmax_of_the_cpu_logits() {
    let e = engine(BatchOptions::default());
    let prompt = &prompts()[1];
    let mut req = greedy(prompt, 3);
    req.logprobs = Some(5);
    let out = collect(e.submit(req).unwrap());
    assert_eq!(out.logprobs.len(), 3);
    // Teacher-forced logits of prompt and output, through a cache of our own.
    let m = model();
    let seq: Vec<u32> = prompt.iter().chain(&out.ids).copied().collect();
    let mut kv = KvCache::new(&m.cfg, 16);
    let table: Vec<u32> = (0..seq.len().div_ceil(16) as u32).collect();
    let logits = m.forward_paged(&seq, 0, &mut kv, &table, true).unwrap();
    let vocab = m.cfg.vocab;
    for (i, (chosen, top)) in out.logprobs.iter().enumerate() {
        let row = &logits[(prompt.len() - 1 + i) * vocab..][..vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = f64::from(max)
            + row
                .iter()
                .map(|&l| f64::from(l - max).exp())
                .sum::<f64>()
                .ln();
        let log_softmax = |id: u32| f64::from(row[id as usize]) - lse;
        assert_eq!(chosen.id, out.ids[i]);
        assert!((f64::from(chosen.logprob) - log_softmax(chosen.id)).abs() < 1e-4);
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let ids: Vec<u32> = top.iter().map(|t| t.id).collect();
        assert_eq!(ids, order[..5], "position {i}");
        assert_eq!(ids[0], chosen.id, "greedy picks the most likely");
        for t in top {
            assert!(
                (f64::from(t.logprob) - log_softmax(t.id)).abs() < 1e-4,
                "position {i}: {t:?} vs {}",
                log_softmax(t.id)
            );
        }
    }
}

#[test]
fn full_queue_long_prompts_and_shutdown_are_refused() {
    let e = engine(BatchOptions {
        max_running: 1,
        max_queue: 1,
        ..BatchOptions::default()
    });
    // The CPU has no device memory to count.
    assert_eq!(e.device_memory_used(), None);
    let p = prompts();
    let long = Request {
        ignore_eos: true,
        ..greedy(&p[1], 400)
    };
    let a = e.submit(long.clone()).unwrap();
    wait_for(&e, |s| s.running == 1);
    let b = e.submit(long.clone()).unwrap();
    match e.submit(long.clone()) {
        Err(SubmitError::QueueFull(1)) => {}
        other => panic!("expected QueueFull(1), got {:?}", other.err()),
    }
    a.cancel.cancel();
    b.cancel.cancel();
    assert_eq!(collect(a).reason, FinishReason::Cancelled);
    assert_eq!(collect(b).reason, FinishReason::Cancelled);

    let too_long = greedy(&vec![p[1][0]; CTX + 1], 1);
    match e.submit(too_long) {
        Err(SubmitError::Invalid(msg)) => assert_eq!(
            msg,
            format!(
                "the prompt has {} tokens but the context holds {CTX}",
                CTX + 1
            )
        ),
        other => panic!("expected Invalid, got {:?}", other.err()),
    }
    // A pool of 4 blocks of 16 cannot hold a 64-token prompt and one more token.
    let small = engine(BatchOptions {
        kv_tokens: Some(64),
        ..BatchOptions::default()
    });
    match small.submit(greedy(&vec![p[1][0]; 64], 1)) {
        Err(SubmitError::Invalid(msg)) => assert!(
            msg.contains("64 tokens") && msg.contains("5 KV blocks") && msg.ends_with("holds 4"),
            "{msg}"
        ),
        other => panic!("expected Invalid, got {:?}", other.err()),
    }
    // Shut down: new requests are refused, those already in go on to their end.
    let last = small.submit(greedy(&p[1], 2)).unwrap();
    small.shutdown();
    assert!(matches!(
        small.submit(greedy(&p[1], 1)),
        Err(SubmitError::ShuttingDown)
    ));
    let last = collect(last);
    assert_eq!((last.reason, last.ids.len()), (FinishReason::Length, 2));
}

/// A stand-in for the model, for the scheduler alone: its "KV cache" holds the token at each
/// position, every row must read back exactly its sequence through its block table (a block
/// shared by mistake, reused while still held, or not re-prefilled after a preemption fails
/// this), and the next token is a hash of that sequence and the draw number.
struct TokenCache {
    slots: Vec<Option<u32>>,
    ctx: usize,
}

const FAKE_BLOCK: usize = 16;

/// The fake model's next token: one of 5000 ordinary ones.
fn fake_next(seq: &[u32], draw: u64) -> u32 {
    let h = seq.iter().fold(draw + 1, |h, &t| {
        h.wrapping_mul(0x100_0000_01b3).wrapping_add(u64::from(t))
    });
    1000 + (h >> 20) as u32 % 5000
}

impl Backend for TokenCache {
    fn step(&mut self, rows: &[Row]) -> orcd::Result<Vec<RowOutput>> {
        let slot = |blocks: &[u32], p: usize| {
            blocks[p / FAKE_BLOCK] as usize * FAKE_BLOCK + p % FAKE_BLOCK
        };
        let mut out = Vec::new();
        for row in rows {
            let end = row.start + row.tokens.len();
            assert!(
                row.blocks.len() * FAKE_BLOCK >= end,
                "the block table is short"
            );
            for (i, &t) in row.tokens.iter().enumerate() {
                self.slots[slot(row.blocks, row.start + i)] = Some(t);
            }
            if let Some(s) = &row.sample {
                let seq: Vec<u32> = (0..end)
                    .map(|p| self.slots[slot(row.blocks, p)].expect("a position never written"))
                    .collect();
                assert_eq!(seq, s.history, "the cache holds another sequence");
                let token = fake_next(&seq, s.draw);
                out.push(RowOutput {
                    token,
                    logprob: None,
                });
            }
        }
        Ok(out)
    }

    fn kv_block_tokens(&self) -> usize {
        FAKE_BLOCK
    }

    fn kv_blocks(&self) -> usize {
        self.slots.len() / FAKE_BLOCK
    }

    fn ctx_len(&self) -> usize {
        self.ctx
    }

    fn device(&self) -> String {
        "fake".into()
    }
}

/// Many requests through a small pool, small prefill chunks and few running slots: every one
/// gets what it would get alone, ending at `max_tokens` or where the pool (smaller than the
/// context) is full, and the pool is empty at the end.
#[test]
fn the_scheduler_under_pressure_gives_each_request_its_own_tokens() {
    let (blocks, ctx) = (6, 200);
    let backend = TokenCache {
        slots: vec![None; blocks * FAKE_BLOCK],
        ctx,
    };
    let opts = BatchOptions {
        max_running: 4,
        step_tokens: 24,
        ..BatchOptions::default()
    };
    let e = BatchEngine::with_backend(Box::new(backend), tokenizer(), &opts).unwrap();
    let limit = blocks * FAKE_BLOCK;
    let mut rng = Rng::new(3);
    let mut uniform = |n: usize| ((rng.next_f32() + 1.0) / 2.0 * n as f32) as usize;
    let reqs: Vec<Request> = (0..16)
        .map(|_| {
            let prompt: Vec<u32> = (0..1 + uniform(70))
                .map(|_| 1000 + uniform(5000) as u32)
                .collect();
            greedy(&prompt, 1 + uniform(80))
        })
        .collect();
    let handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let (mut at_max, mut at_pool) = (0, 0);
    for (r, h) in reqs.iter().zip(handles) {
        let mut seq = r.prompt.clone();
        while seq.len() - r.prompt.len() < r.max_tokens && seq.len() <= limit {
            seq.push(fake_next(&seq, (seq.len() - r.prompt.len()) as u64));
        }
        let out = collect(h);
        assert_eq!(
            out.ids,
            seq[r.prompt.len()..],
            "prompt of {}",
            r.prompt.len()
        );
        assert_eq!(out.reason, FinishReason::Length);
        if out.ids.len() == r.max_tokens {
            at_max += 1;
        } else {
            at_pool += 1;
        }
    }
    let st = wait_for(&e, |s| s.running == 0);
    println!("{at_max} at max_tokens, {at_pool} at the pool's end; {st:?}");
    assert!(at_max > 0 && at_pool > 0);
    assert!(st.preemptions > 0);
    assert_eq!(st.kv_blocks_used, 0);
}
