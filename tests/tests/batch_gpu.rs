//! The batching engine on the GPU backend, on the real model: teacher-forced top-1 of the
//! paged (f16 KV) forward pass against the references, on both weight paths; a request's tokens
//! do not depend on the batch it runs in; they are `Engine::generate`'s wherever the
//! reference's margin is clear; and the pool is empty after every test.
use orcd::batch::backend::{Backend, Row, SampleSpec};
use orcd::batch::{BatchEngine, BatchOptions, Request, Sampling};
use orcd::cuda::batch::CudaBatch;
use orcd::cuda::model::{CudaModel, WeightFormat};
use orcd::engine::{DeviceChoice, Engine, Event, GenerateOptions, LoadOptions};
use orcd::sampling::SamplingParams;
use orcd_tests::{gguf, gpu, model_path, ref_prompts};

use super::batch::{alone, collect, greedy, prompts, together, wait_for};

const CTX: usize = 1024;
/// The reference's top-1 must be ours wherever its margin over the top-2 is at least this.
const CLEAR: f32 = 0.05;

fn greedy_sampling() -> Sampling {
    Sampling {
        params: SamplingParams::greedy(),
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
    }
}

/// Teacher forcing through the backend: each reference prompt prefilled as one row, then its
/// reference generation fed back one decode row a step, all prompts' rows in the same steps.
/// Returns (clear positions that agree, clear positions, all positions that agree, all).
fn teacher_forced(format: WeightFormat) -> (usize, usize, usize, usize) {
    let dev = gpu().expect("checked by the caller");
    let model = CudaModel::load(dev, gguf(), CTX, format, &mut |_| {}).unwrap();
    let mut b = CudaBatch::new(model, Some(4 * CTX), 0, true).unwrap();
    let bt = b.kv_block_tokens();
    let refs = ref_prompts();
    let sampling = greedy_sampling();
    // Each sequence its own run of blocks, far apart in the pool.
    let tables: Vec<Vec<u32>> = (0..refs.len())
        .map(|s| {
            let first = (s * CTX / bt) as u32;
            (first..first + (CTX / bt) as u32).rev().collect()
        })
        .collect();
    let mut got: Vec<Vec<u32>> = vec![vec![]; refs.len()];
    let steps = refs.iter().map(|r| r.generated.len()).max().unwrap();
    for step in 0..steps {
        let histories: Vec<Vec<u32>> = refs.iter().map(|r| r.sequence()).collect();
        let rows: Vec<Row> = refs
            .iter()
            .zip(&tables)
            .zip(&histories)
            .filter(|((r, _), _)| step < r.generated.len())
            .map(|((r, table), history)| {
                let (start, tokens) = if step == 0 {
                    (0, &r.ids[..])
                } else {
                    let p = r.ids.len() + step - 1;
                    (p, &history[p..p + 1])
                };
                Row {
                    tokens,
                    start,
                    blocks: table,
                    sample: Some(SampleSpec {
                        sampling: &sampling,
                        draw: step as u64,
                        history: &history[..start + tokens.len()],
                        prompt_len: r.ids.len(),
                        logprobs: None,
                        more: 0,
                    }),
                }
            })
            .collect();
        let out = b.step(&rows).unwrap();
        let live = refs
            .iter()
            .enumerate()
            .filter(|(_, r)| step < r.generated.len());
        for ((i, _), o) in live.zip(out) {
            got[i].push(o.token);
        }
    }
    let (mut clear_ok, mut clear, mut ok, mut all) = (0, 0, 0, 0);
    for (r, got) in refs.iter().zip(&got) {
        for (i, &t) in got.iter().enumerate() {
            let agree = t == r.top5_ids[i][0];
            all += 1;
            ok += agree as usize;
            if r.margin(i) >= CLEAR {
                clear += 1;
                clear_ok += agree as usize;
                assert!(
                    agree,
                    "{format:?} {:?} position {i}: {t} but the reference's top-1 is {} (margin {})",
                    r.kind,
                    r.top5_ids[i][0],
                    r.margin(i)
                );
            }
        }
    }
    (clear_ok, clear, ok, all)
}

#[test]
fn paged_f16_kv_teacher_forced_top1_matches_the_references() {
    if gpu().is_none() {
        return;
    }
    for format in [WeightFormat::Native, WeightFormat::F16] {
        let (clear_ok, clear, ok, all) = teacher_forced(format);
        println!(
            "{format:?}: top-1 agrees at {clear_ok}/{clear} clear positions, {ok}/{all} in all"
        );
        // The batched products round their operands to f16, as the f16 weight path: the same
        // bar (cuda_model's), 98% of all positions or all but the near ties.
        let floor = (all * 98).div_ceil(100).min(clear);
        assert!(clear > 0 && ok >= floor, "{format:?}: {ok}/{all} < {floor}");
    }
}

fn gpu_engine(weights: WeightFormat, opts: BatchOptions) -> BatchEngine {
    let load = LoadOptions {
        device: DeviceChoice::Cuda,
        ctx: Some(CTX),
        weights,
    };
    BatchEngine::start(&model_path(), &load, &opts).expect("starting the GPU batch engine")
}

#[test]
fn a_request_gets_the_same_tokens_alone_and_among_63_others() {
    if gpu().is_none() {
        return;
    }
    let prompts = prompts();
    for weights in [WeightFormat::Native, WeightFormat::F16] {
        // Batch-invariant: a lone request's decode stays on the batched pass.
        let opts = BatchOptions {
            batch_invariant: true,
            ..BatchOptions::default()
        };
        let e = gpu_engine(weights, opts);
        let reqs: Vec<Request> = prompts.iter().map(|p| greedy(p, 32)).collect();
        let solo = alone(&e, &reqs);
        // 64 requests: every prompt several times, at different lengths, so the batch mixes
        // decode rows and prefill chunks of other sequences in every step.
        let crowd: Vec<Request> = (0..64)
            .map(|i| greedy(&prompts[i % prompts.len()], 8 + i % 24))
            .collect();
        let all = together(&e, &crowd);
        for (i, got) in all.iter().enumerate() {
            let want = &solo[i % prompts.len()];
            assert_eq!(got[..], want[..got.len()], "{weights:?}: request {i}");
        }
        let st = wait_for(&e, |s| s.running == 0 && s.waiting == 0);
        assert_eq!(st.kv_blocks_used, 0, "{weights:?}: {st:?}");
    }
}

#[test]
fn greedy_tokens_are_engine_generates_where_the_reference_is_clear() {
    if gpu().is_none() {
        return;
    }
    let e = gpu_engine(WeightFormat::Native, BatchOptions::default());
    // The driver's count: the weights and the KV pool at least.
    assert!(e.device_memory_used().is_some_and(|b| b > 0));
    let load = LoadOptions {
        device: DeviceChoice::Cuda,
        ctx: Some(CTX),
        weights: WeightFormat::Native,
    };
    let mut single = Engine::load(&model_path(), &load).unwrap();
    for r in ref_prompts() {
        let n = r.generated.len();
        // Past end-of-sequence too: both generate exactly the reference's length.
        let req = Request {
            ignore_eos: true,
            ..greedy(&r.ids, n)
        };
        let batch = alone(&e, &[req]).remove(0);
        let opts = GenerateOptions {
            sampling: SamplingParams::greedy(),
            max_tokens: n,
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let mut want = Vec::new();
        for ev in single.generate(r.ids.clone(), opts).unwrap() {
            if let Event::Token { id, .. } = ev.unwrap() {
                want.push(id);
            }
        }
        // Both follow the reference up to its first unclear position (after it, either may
        // take the other branch of a near tie).
        let clear = (0..n).take_while(|&i| r.margin(i) >= CLEAR).count();
        println!("{}: {clear} clear positions of {n}", r.kind);
        assert_eq!(batch[..clear], r.generated[..clear], "batch, {}", r.kind);
        assert_eq!(
            want[..clear],
            r.generated[..clear],
            "Engine::generate, {}",
            r.kind
        );
    }
    assert_eq!(e.status().kv_blocks_used, 0);
}

/// A request decoding alone runs on the single-sequence pipeline; when a second joins, the
/// keys and values the pipeline added go back into the first's blocks and both go on in the
/// batched pass. Both follow the reference wherever it is clear, and the pool ends empty.
#[test]
fn a_lone_sequence_hands_its_cache_back_when_another_joins() {
    if gpu().is_none() {
        return;
    }
    let refs = ref_prompts();
    let clear = |r: &orcd_tests::RefPrompt| {
        (0..r.generated.len())
            .take_while(|&i| r.margin(i) >= CLEAR)
            .count()
    };
    // The first: the reference with the longest clear run, generating on well past it so
    // that it is still running when the second joins half-way through that run.
    let a = refs.iter().max_by_key(|r| clear(r)).unwrap();
    let b = refs.iter().find(|r| r.text != a.text).unwrap();
    let e = gpu_engine(WeightFormat::Native, BatchOptions::default());
    let long = Request {
        ignore_eos: true,
        ..greedy(&a.ids, CTX - a.ids.len())
    };
    let mut first = e.submit(long).unwrap();
    let mut got_a = Vec::new();
    while got_a.len() < clear(a).div_ceil(2) {
        if let Some(orcd::batch::SeqEvent::Token { id, .. }) = first.events.blocking_recv() {
            got_a.push(id);
        }
    }
    let short = Request {
        ignore_eos: true,
        ..greedy(&b.ids, b.generated.len())
    };
    let got_b = collect(e.submit(short).unwrap()).ids;
    got_a.extend(collect(first).ids);
    for (r, got) in [(a, &got_a), (b, &got_b)] {
        let n = clear(r);
        println!("{}: {n} clear positions of {}", r.kind, r.generated.len());
        assert_eq!(got[..n], r.generated[..n], "{}", r.kind);
    }
    let st = wait_for(&e, |s| s.running == 0 && s.waiting == 0);
    assert!(st.steps > 0, "{st:?}");
    assert_eq!(st.kv_blocks_used, 0, "{st:?}");
}
