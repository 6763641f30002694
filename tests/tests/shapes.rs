//! No kernel assumes a shape: models of random weights in the shapes of Qwen2.5 3B, 7B and 14B
//! (`orcd_tests::synthetic`, two layers each) run on the GPU, single-sequence and batched, on
//! both weight paths, and agree with the CPU reference. The CPU test runs everywhere; the GPU
//! tests print `skipped: no CUDA device` without a GPU and fail under `REQUIRE_GPU=1`.
use orcd::batch::Sampling;
use orcd::batch::backend::{Backend, Row, SampleSpec};
use orcd::batch::cpu::logprobs;
use orcd::cpu::argmax;
use orcd::cpu::model::CpuModel;
use orcd::cuda::batch::CudaBatch;
use orcd::cuda::decode_pipeline::DecodePipeline;
use orcd::cuda::model::{CudaModel, WeightFormat};
use orcd::gguf::Gguf;
use orcd::sampling::SamplingParams;
use orcd_tests::synthetic::{
    Q4_K_M, Q5_0_Q8_0, QWEN2_5_3B, QWEN2_5_7B, QWEN2_5_14B, Shape, TempFile, Types, random_qwen2,
    rounded_to_f16,
};
use orcd_tests::{Rng, gpu};

const LAYERS: usize = 2;
const CTX: usize = 256;
/// Prompt lengths: past a 64-row tile of the prefill GEMM, a short one (split in two chunks in
/// the batched test), and one between.
const PROMPTS: [usize; 3] = [70, 9, 33];
/// Tokens generated after each prompt: more than a CUDA graph's run of decode steps.
const DECODE: usize = 10;
/// Largest |GPU - CPU| of a logit where everything is f32 on both sides but the order of the
/// sums (the single-sequence path with the file's weights).
const TOL: f32 = 0.02;
/// Largest |GPU - CPU| of a logit where the GPU rounds to f16 what the CPU keeps in f32 (the
/// weights with `WeightFormat::F16`, the batched path's KV cache). The CPU test checks that
/// rounding the weights moves the CPU's own logits by less than a quarter of it.
const TOL_F16: f32 = 0.1;

/// One model of each shape, and the 7B in the default model's types too.
const CASES: [(&Shape, &Types, u64); 4] = [
    (&QWEN2_5_3B, &Q4_K_M, 3),
    (&QWEN2_5_7B, &Q4_K_M, 7),
    (&QWEN2_5_7B, &Q5_0_Q8_0, 8),
    (&QWEN2_5_14B, &Q4_K_M, 14),
];

/// The file of a case's model.
fn model_file(shape: &Shape, types: &Types, seed: u64) -> TempFile {
    let f = random_qwen2(shape, types, LAYERS, seed);
    TempFile::write(&f, &format!("{}-{}", shape.name, types.name))
}

/// The CPU reference of one sequence: its tokens (a random prompt, then the CPU's greedy
/// continuation) and the logits after each of them.
struct Reference {
    tokens: Vec<u32>,
    prompt_len: usize,
    logits: Vec<Vec<f32>>,
}

fn reference(cpu: &mut CpuModel, prompt_len: usize, decode: usize, rng: &mut Rng) -> Reference {
    let vocab = cpu.cfg.vocab;
    let mut tokens: Vec<u32> = (0..prompt_len)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    cpu.reset();
    let prefill = cpu.forward(&tokens, true).unwrap();
    let mut logits: Vec<Vec<f32>> = prefill.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    for _ in 0..decode {
        let t = argmax(logits.last().unwrap());
        tokens.push(t);
        logits.push(cpu.forward(&[t], false).unwrap());
    }
    Reference {
        tokens,
        prompt_len,
        logits,
    }
}

/// The worst |got - want|; NaN (a logit never written) counts as infinite.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).fold(0.0, |w, (g, v)| {
        let e = (g - v).abs();
        if e.is_nan() { f32::INFINITY } else { w.max(e) }
    })
}

fn check_logits(got: &[f32], want: &[f32], tol: f32, what: &str) -> f32 {
    let w = worst(got, want);
    assert!(
        w <= tol,
        "{what}: a logit is {w} off the CPU's (tolerance {tol})"
    );
    w
}

/// The GPU's greedy token `got` where the CPU's logits are `want`: the CPU's top-1, or one of
/// its top two where they are within twice the logits' tolerance (which may swap them).
fn check_token(got: u32, want: &[f32], tol: f32, what: &str) {
    let top = argmax(want);
    let mut rest = want.to_vec();
    rest[top as usize] = f32::NEG_INFINITY;
    let second = argmax(&rest);
    let margin = want[top as usize] - want[second as usize];
    let ok = got == top || (got == second && margin < 2.0 * tol);
    assert!(
        ok,
        "{what}: GPU token {got}, CPU top two {top} and {second} (margin {margin})"
    );
}

/// The spread (standard deviation) of a row of logits.
fn spread(row: &[f32]) -> f32 {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    (row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n).sqrt()
}

/// The CPU reference on every shape: the config read as the shape's, finite logits with a
/// spread like a real model's, prefill and decode agreeing, and rounding the weights to f16
/// moving the logits well within `TOL_F16` (the GPU's f16 paths are held to it).
#[test]
fn cpu_reference_on_every_shape() {
    for &(shape, types, seed) in &CASES {
        let what = format!("{} {}", shape.name, types.name);
        let f = random_qwen2(shape, types, LAYERS, seed);
        let file = TempFile::write(&f, &format!("cpu-{}-{}", shape.name, types.name));
        let g = Gguf::open(file.path()).unwrap();
        let mut cpu = CpuModel::load(&g, CTX).unwrap();
        let c = &cpu.cfg;
        assert_eq!(
            (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn),
            (
                shape.hidden,
                shape.n_heads,
                shape.n_kv_heads,
                128,
                shape.ffn
            ),
            "{what}"
        );
        assert_eq!(
            (c.vocab, c.tied_output),
            (shape.vocab, shape.tied),
            "{what}"
        );

        let r = reference(&mut cpu, 12, 3, &mut Rng::new(seed));
        for row in &r.logits {
            let s = spread(row);
            assert!(row.iter().all(|v| v.is_finite()), "{what}: logits {row:?}");
            assert!((1.0..10.0).contains(&s), "{what}: logits spread {s}");
        }
        // One token at a time gives what the prefill gave (the same sums, other batches).
        cpu.reset();
        for (i, &t) in r.tokens.iter().enumerate() {
            let got = cpu.forward(&[t], false).unwrap();
            check_logits(&got, &r.logits[i], 1e-4, &format!("{what} token {i}"));
        }
        drop((cpu, g));

        let rounded = TempFile::write(
            &rounded_to_f16(f),
            &format!("cpu-f16-{}-{}", shape.name, types.name),
        );
        let g16 = Gguf::open(rounded.path()).unwrap();
        let mut cpu16 = CpuModel::load(&g16, CTX).unwrap();
        let all = cpu16.forward(&r.tokens, true).unwrap();
        let vocab = shape.vocab;
        let moved = (0..r.tokens.len())
            .map(|i| worst(&all[i * vocab..][..vocab], &r.logits[i]))
            .fold(0.0, f32::max);
        println!(
            "{what}: logits spread {:.2}; weights rounded to f16 move them by up to {moved:.4}",
            spread(&r.logits[0])
        );
        assert!(
            moved < TOL_F16 / 4.0,
            "{what}: f16 weights move a logit {moved}"
        );
    }
}

/// The single-sequence path on `format`: the prefill's logits at every position (the
/// tensor-core GEMM), one token at a time (the GEMV), and the greedy tokens of the fused decode
/// steps (CUDA graphs, run ahead), fed the CPU's tokens. Returns the worst logit difference.
fn single_sequence(g: &Gguf, format: WeightFormat, refs: &[Reference], tol: f32) -> f32 {
    let dev = gpu().expect("checked by the caller");
    let mut m = DecodePipeline::load(dev, g, CTX, format, &mut |_| {}).unwrap();
    let vocab = m.model().cfg.vocab;
    let mut w = 0.0f32;
    for (s, r) in refs.iter().enumerate() {
        let what = |step: &str, i: usize| format!("{format:?} single sequence {s}: {step} {i}");
        let prompt = &r.tokens[..r.prompt_len];
        m.reset();
        let got = m.forward(prompt, true).unwrap();
        for (i, row) in got.chunks_exact(vocab).enumerate() {
            w = w.max(check_logits(row, &r.logits[i], tol, &what("prefill", i)));
        }
        for i in r.prompt_len..r.tokens.len() {
            let got = m.forward(&r.tokens[i..=i], false).unwrap();
            w = w.max(check_logits(&got, &r.logits[i], tol, &what("token", i)));
        }

        m.reset();
        let greedy = SamplingParams::greedy();
        let n = r.tokens.len() - r.prompt_len;
        for i in 0..=n {
            let feed = match i {
                0 => prompt,
                _ => &r.tokens[r.prompt_len + i - 1..][..1],
            };
            let t = m.next_token(feed, &greedy, i as u64, n - i).unwrap();
            let pos = r.prompt_len - 1 + i;
            check_token(t, &r.logits[pos], tol, &what("decode step at", pos));
        }
    }
    w
}

/// The batched path (`CudaBatch`) on `format`: every sequence in the same steps, each through
/// its own blocks (in reverse order, far apart); sequence 1's prompt in two chunks, the second
/// beside the others' decode rows. Steps with a prefill, and every other step, read the raw
/// logits (as log-probabilities); the decode-only steps between replay a CUDA graph, whose
/// greedy tokens are checked. Returns the worst logit difference.
fn batched(g: &Gguf, format: WeightFormat, refs: &[Reference], tol: f32) -> f32 {
    let dev = gpu().expect("checked by the caller");
    let model = CudaModel::load(dev, g, CTX, format, &mut |_| {}).unwrap();
    let vocab = model.cfg.vocab;
    // Batch-invariant: the steps of one row stay on the batched pass under test.
    let mut b = CudaBatch::new(model, Some(refs.len() * CTX), 0, true).unwrap();
    let per_seq = CTX / b.kv_block_tokens();
    let tables: Vec<Vec<u32>> = (0..refs.len())
        .map(|s| {
            let first = (s * per_seq) as u32;
            (first..first + per_seq as u32).rev().collect()
        })
        .collect();
    let sampling = Sampling {
        params: SamplingParams::greedy(),
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
    };
    let (mut fed, mut w) = (vec![0; refs.len()], 0.0f32);
    for step in 0.. {
        let prefill = refs.iter().zip(&fed).any(|(r, &f)| f < r.prompt_len);
        let read_logits = prefill || step % 2 == 0;
        let (mut rows, mut sampled) = (Vec::new(), Vec::new());
        for (s, r) in refs.iter().enumerate() {
            let start = fed[s];
            let end = match start {
                _ if start == r.tokens.len() => continue,
                0 if s == 1 => r.prompt_len / 2,
                _ if start < r.prompt_len => r.prompt_len,
                _ => start + 1,
            };
            let sample = (end >= r.prompt_len).then(|| SampleSpec {
                sampling: &sampling,
                draw: (end - r.prompt_len) as u64,
                history: &r.tokens[..end],
                prompt_len: r.prompt_len,
                logprobs: read_logits.then_some(vocab),
                more: 0,
            });
            if sample.is_some() {
                sampled.push((s, end - 1));
            }
            rows.push(Row {
                tokens: &r.tokens[start..end],
                start,
                blocks: &tables[s],
                sample,
            });
            fed[s] = end;
        }
        if rows.is_empty() {
            break;
        }
        let out = b.step(&rows).unwrap();
        assert_eq!(out.len(), sampled.len());
        for (&(s, pos), o) in sampled.iter().zip(out) {
            let what = format!("{format:?} batched step {step}: sequence {s} position {pos}");
            let want = &refs[s].logits[pos];
            check_token(o.token, want, tol, &what);
            if let Some((_, top)) = o.logprob {
                let mut got = vec![f32::NAN; vocab];
                for t in top {
                    got[t.id as usize] = t.logprob;
                }
                let mut want_lp = vec![f32::NAN; vocab];
                for t in logprobs(want, 0, vocab).1 {
                    want_lp[t.id as usize] = t.logprob;
                }
                w = w.max(check_logits(&got, &want_lp, tol, &what));
            }
        }
    }
    w
}

/// A case's model on the GPU, both paths on both weight formats, against the CPU reference.
fn gpu_matches_cpu(shape: &Shape, types: &Types, seed: u64) {
    if gpu().is_none() {
        return;
    }
    let file = model_file(shape, types, seed);
    let g = Gguf::open(file.path()).unwrap();
    let refs: Vec<Reference> = {
        let mut cpu = CpuModel::load(&g, CTX).unwrap();
        let mut rng = Rng::new(seed);
        PROMPTS
            .iter()
            .map(|&n| reference(&mut cpu, n, DECODE, &mut rng))
            .collect()
    };
    for format in [WeightFormat::Native, WeightFormat::F16] {
        let tol = match format {
            WeightFormat::Native => TOL,
            WeightFormat::F16 => TOL_F16,
        };
        let single = single_sequence(&g, format, &refs, tol);
        // The batched path keeps its KV cache in f16.
        let batch = batched(&g, format, &refs, TOL_F16);
        println!(
            "{} {} {format:?}: worst logit difference single {single:.4}, batched {batch:.4}",
            shape.name, types.name
        );
    }
}

#[test]
fn qwen2_5_3b_q4_k_m_gpu_matches_cpu() {
    let (shape, types, seed) = CASES[0];
    gpu_matches_cpu(shape, types, seed);
}

#[test]
fn qwen2_5_7b_q4_k_m_gpu_matches_cpu() {
    let (shape, types, seed) = CASES[1];
    gpu_matches_cpu(shape, types, seed);
}

#[test]
fn qwen2_5_7b_q5_0_q8_0_gpu_matches_cpu() {
    let (shape, types, seed) = CASES[2];
    gpu_matches_cpu(shape, types, seed);
}

#[test]
fn qwen2_5_14b_q4_k_m_gpu_matches_cpu() {
    let (shape, types, seed) = CASES[3];
    gpu_matches_cpu(shape, types, seed);
}
