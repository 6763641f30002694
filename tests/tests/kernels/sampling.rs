//! `Device::sample` against its CPU twin `orcd::sampling::sample`: greedy, top-k with
//! temperature, top-p, min-p and repetition penalty over a grid of params and draws, ties,
//! and the params the GPU refuses. `Device::sample_dev` (position and draw in device memory)
//! against `Device::sample` over sequences of decode steps. The sampler's first kernel cuts the
//! vocabulary into 256 slices and keeps each slice's top k: odd sizes, slices with fewer valid
//! logits than k, a top k all in one slice, ties across slices and a window that repeats ids,
//! and a CPU simulation of that slice-then-merge.
use std::time::Instant;

use orcd::cuda::Device;
use orcd::sampling::{self, SamplingParams};
use orcd_tests::{Rng, gpu};

const VOCAB: usize = 151936;

/// How far (absolute on u and top-p, relative on min-p) a draw may be from a boundary for a
/// GPU/CPU difference to count as rounding. Their probabilities differ by a few ulp
/// (`ex2.approx`, and the sums see those inputs), ~1e-6 at most: 1e-5 leaves a margin, and a
/// random draw lands this close to a given boundary once in 1e5.
const NEAR: f32 = 1e-5;

/// The GPU's token; `logits` become the GPU's penalised logits. The tokens so far are
/// `recent`, uploaded with junk after them, which the penalty must not look at.
fn gpu_sample(
    dev: &Device,
    logits: &mut [f32],
    recent: &[u32],
    p: &SamplingParams,
    step: u64,
) -> u32 {
    let mut l = dev.upload(logits).unwrap();
    let mut buf = recent.to_vec();
    buf.extend([0, 1, 2, 3]);
    let r = dev.upload(&buf).unwrap();
    let mut out = dev.zeros::<u32>(1).unwrap();
    let mut scratch = dev.sample_scratch(logits.len()).unwrap();
    dev.sample(&mut out, &mut l, &r, recent.len(), p, step, &mut scratch)
        .unwrap();
    logits.copy_from_slice(&dev.download(&l).unwrap());
    dev.download(&out).unwrap()[0]
}

/// Logits like a model's: most in [-6, 6), a few peaks up to 16, so that top-p and min-p cut
/// inside the top k.
pub(super) fn model_like(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = rng.vec(n).iter().map(|v| 6.0 * v).collect();
    for j in 0..8.min(n) {
        let i = ((rng.next_f32() + 1.0) / 2.0 * n as f32) as usize % n;
        x[i] = 8.0 + j as f32;
    }
    x
}

/// Ids sorted best first: higher logit, then lower id; NaN and -inf left out.
pub(super) fn ranking(logits: &[f32]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize] > f32::NEG_INFINITY)
        .collect();
    ids.sort_by(|&a, &b| {
        (logits[b as usize] + 0.0)
            .total_cmp(&(logits[a as usize] + 0.0))
            .then(a.cmp(&b))
    });
    ids
}

/// Recent tokens: the 6 best ids of `logits` (each twice, so the penalty changes the top k),
/// random ids, and one outside the vocabulary (ignored).
pub(super) fn recent_for(rng: &mut Rng, logits: &[f32]) -> Vec<u32> {
    let n = logits.len();
    let best: Vec<u32> = ranking(logits).into_iter().take(6).collect();
    let mut r: Vec<u32> = (0..40)
        .map(|_| ((rng.next_f32() + 1.0) / 2.0 * n as f32) as u32 % n as u32)
        .collect();
    r.extend(&best);
    r.push(n as u32 + 5);
    r.extend(&best);
    r
}

/// Whether the CPU's steps pick `token` from the penalised `logits` when the draw, top-p or
/// min-p move by up to `NEAR`: then a GPU/CPU difference is rounding at a boundary.
pub(super) fn near_boundary(logits: &[f32], p: &SamplingParams, step: u64, token: u32) -> bool {
    let u = sampling::uniform(p.seed, step);
    let moves = [-NEAR, 0.0, NEAR];
    let top_ps: Vec<f32> = if p.top_p < 1.0 {
        moves.iter().map(|d| p.top_p + d).collect()
    } else {
        vec![p.top_p]
    };
    let min_ps: Vec<f32> = moves.iter().map(|d| p.min_p * (1.0 + d)).collect();
    for &du in &moves {
        for &top_p in &top_ps {
            for &min_p in &min_ps {
                let mut c = sampling::top_k(logits, p.temperature, p.top_k);
                sampling::softmax(&mut c);
                sampling::top_p(&mut c, top_p);
                sampling::min_p(&mut c, min_p);
                if !c.is_empty() && sampling::pick(&mut c, (u + du).clamp(0.0, 0.9999999)) == token
                {
                    return true;
                }
            }
        }
    }
    false
}

/// One draw of the GPU against the CPU for these logits, recent tokens, params and step: the
/// same penalised logits, bit for bit; a token in the top k; the CPU's token unless the draw is
/// near a boundary. Returns whether the tokens differ (rounding at a boundary).
fn check_draw(dev: &Device, logits: &[f32], recent: &[u32], p: &SamplingParams, step: u64) -> bool {
    let n = logits.len();
    let mut want_logits = logits.to_vec();
    let want = sampling::sample(&mut want_logits, recent, p, step);
    let mut got_logits = logits.to_vec();
    let got = gpu_sample(dev, &mut got_logits, recent, p, step);
    // The penalty is one IEEE multiply or divide: bit for bit (a NaN stays a NaN, whose bits
    // the GPU does not keep).
    let differ = got_logits
        .iter()
        .zip(&want_logits)
        .position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()));
    if let Some(i) = differ {
        panic!(
            "penalised logits differ: n={n} {p:?}: [{i}] {} vs the CPU's {}",
            got_logits[i], want_logits[i]
        );
    }
    // Top-k is exact: fewer than k valid logits beat the token (greedy: none does).
    let top_k = if p.temperature == 0.0 { 1 } else { p.top_k };
    let g = got as usize;
    assert!(g < n.max(1), "token {got} of {n}");
    if n > 0 && want_logits[g] > f32::NEG_INFINITY {
        let beaten_by = want_logits
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v > want_logits[g] || (v == want_logits[g] && i < g))
            .count();
        assert!(
            beaten_by < top_k,
            "token {got} is not in the top {top_k}: n={n} {p:?}"
        );
    }
    if got == want {
        return false;
    }
    let near = p.temperature > 0.0 && near_boundary(&want_logits, p, step, got);
    println!("mismatch n={n} step={step} {p:?}: gpu {got} cpu {want}, near a boundary: {near}");
    assert!(near, "a mismatch that is not rounding at a boundary");
    true
}

/// GPU draws that differ from the CPU's (each at a boundary, `check_draw` made sure) are rare:
/// a draw lands within NEAR of a boundary with probability ~1e-5, so at most one in 1,000 may
/// differ (none in a test of fewer draws).
pub(super) fn few_mismatches(what: &str, mismatches: usize, cases: usize) {
    println!("{what}: {mismatches} mismatches in {cases} draws");
    assert!(
        mismatches * 1000 <= cases,
        "{what}: {mismatches} mismatches in {cases} draws"
    );
}

#[test]
fn sample_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(10);
    let (mut cases, mut mismatches) = (0, 0);
    for (n, draws) in [(VOCAB, 2), (1000, 8), (10, 8)] {
        let logits = model_like(&mut rng, n);
        let recent = recent_for(&mut rng, &logits);
        let mut combo = 0u64;
        for temperature in [0.3, 0.7, 1.5] {
            for top_k in [1, 5, 20, 1024] {
                for top_p in [0.5, 0.8, 1.0] {
                    for min_p in [0.0, 0.05] {
                        for repeat_penalty in [1.0, 1.05, 1.3] {
                            combo += 1;
                            let p = SamplingParams {
                                temperature,
                                top_k,
                                top_p,
                                min_p,
                                repeat_penalty,
                                repeat_last_n: [64, 16, 1000][combo as usize % 3],
                                seed: combo * 7919 + n as u64,
                            };
                            for d in 0..draws {
                                let step = d * d * 37;
                                cases += 1;
                                mismatches += check_draw(&dev, &logits, &recent, &p, step) as usize;
                            }
                        }
                    }
                }
            }
        }
    }
    few_mismatches("sample", mismatches, cases);

    // Time per token at the model's vocabulary, for the record: the defaults (top_k 20), a
    // larger k, greedy with a penalty (k = 1) and the largest k.
    let logits = model_like(&mut rng, VOCAB);
    let recent = recent_for(&mut rng, &logits);
    let mut l = dev.upload(&logits).unwrap();
    let r = dev.upload(&recent).unwrap();
    let mut out = dev.zeros::<u32>(1).unwrap();
    let mut scratch = dev.sample_scratch(VOCAB).unwrap();
    for p in [
        SamplingParams::default(),
        sampled(64),
        SamplingParams {
            repeat_penalty: 1.05,
            ..SamplingParams::greedy()
        },
        sampled(Device::MAX_TOP_K),
    ] {
        let runs = 200;
        dev.sample(&mut out, &mut l, &r, recent.len(), &p, 0, &mut scratch)
            .unwrap();
        dev.synchronize().unwrap();
        let t = Instant::now();
        for step in 0..runs {
            dev.sample(&mut out, &mut l, &r, recent.len(), &p, step, &mut scratch)
                .unwrap();
        }
        dev.synchronize().unwrap();
        let us = t.elapsed().as_secs_f64() * 1e6 / runs as f64;
        println!(
            "sample vocab {VOCAB} temperature {} top_k {}: {us:.1} us per token (launches included)",
            p.temperature, p.top_k
        );
    }
}

#[test]
fn greedy_matches_cpu_argmax() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(11);
    let mut inputs: Vec<Vec<f32>> = [VOCAB, 4097, 1000, 33, 10, 1]
        .iter()
        .map(|&n| model_like(&mut rng, n))
        .collect();
    let mut tie = rng.vec(1000);
    (tie[700], tie[300]) = (5.0, 5.0);
    inputs.push(tie);
    inputs.push(vec![f32::NEG_INFINITY; 1000]);
    inputs.push(vec![f32::NAN; 1000]);
    inputs.push(vec![f32::NAN, f32::NEG_INFINITY, f32::NAN]);
    inputs.push(vec![f32::NAN, 1.0, f32::NAN, 0.5]);
    for logits in &inputs {
        let recent = recent_for(&mut rng, logits);
        for repeat_penalty in [1.0, 1.3] {
            let p = SamplingParams {
                repeat_penalty,
                ..SamplingParams::greedy()
            };
            let mut want_logits = logits.clone();
            let want = sampling::sample(&mut want_logits, &recent, &p, 0);
            let mut got_logits = logits.clone();
            let got = gpu_sample(&dev, &mut got_logits, &recent, &p, 0);
            assert_eq!(
                got,
                want,
                "greedy n={} penalty {repeat_penalty}",
                logits.len()
            );
            // Greedy is the argmax of the penalised logits (and never u32::MAX).
            let first_best = orcd::cpu::argmax(&want_logits);
            assert_eq!(
                got,
                if first_best == u32::MAX {
                    0
                } else {
                    first_best
                }
            );
        }
    }
    // The tie goes to the lower id; all -inf or all NaN gives 0; NaN never wins, not even
    // over -inf.
    let p = SamplingParams {
        repeat_penalty: 1.0,
        ..SamplingParams::greedy()
    };
    for (logits, want) in [
        (&inputs[6], 300),
        (&inputs[7], 0),
        (&inputs[8], 0),
        (&inputs[9], 1),
        (&inputs[10], 1),
    ] {
        assert_eq!(gpu_sample(&dev, &mut logits.clone(), &[], &p, 0), want);
    }
}

/// Top-k alone at temperature 1: no penalty, top-p or min-p.
fn plain(top_k: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed,
    }
}

#[test]
fn ties_resolve_by_lowest_id() {
    let Some(dev) = gpu() else { return };
    // Equal logits: every weight is exp(0) / k on both sides, bit for bit, and the running
    // sums add the same numbers in the same order, so the GPU must agree with the CPU on
    // every draw; the candidates are ids 0..k.
    let flat = vec![0.5f32; 2000];
    for top_k in [1, 5, 1000, 1024] {
        for step in 0..100 {
            let p = plain(top_k, 3);
            let want = sampling::sample(&mut flat.clone(), &[], &p, step);
            let got = gpu_sample(&dev, &mut flat.clone(), &[], &p, step);
            assert_eq!(got, want, "flat top_k {top_k} step {step}");
            assert!((got as usize) < top_k);
        }
    }
    // Ties at the top-k boundary: ids 1 and 2 (2.0 beats 2.0 at id 3), and -0 ties +0.
    let cases: [(&[f32], usize, &[u32]); 3] = [
        (&[1.0, 2.0, 2.0, 2.0, 0.0], 2, &[1, 2]),
        (&[2.0, 2.0, 2.0, 3.0], 3, &[0, 1, 3]),
        (&[-1.0, -0.0, 0.0, 0.0], 2, &[1, 2]),
    ];
    for (logits, top_k, allowed) in cases {
        let mut seen = vec![false; logits.len()];
        for step in 0..200 {
            let p = plain(top_k, 5);
            let want = sampling::sample(&mut logits.to_vec(), &[], &p, step);
            let got = gpu_sample(&dev, &mut logits.to_vec(), &[], &p, step);
            assert_eq!(got, want, "{logits:?} top_k {top_k} step {step}");
            seen[got as usize] = true;
        }
        let drawn: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| seen[i as usize])
            .collect();
        assert_eq!(drawn, allowed, "{logits:?} top_k {top_k}");
    }
    // Many ties among random logits (few distinct values), at the model's vocabulary too.
    let mut rng = Rng::new(12);
    for n in [VOCAB, 1000] {
        let logits: Vec<f32> = rng.vec(n).iter().map(|v| (4.0 * v).floor()).collect();
        let best = ranking(&logits);
        for top_k in [1, 5, 20, 1024] {
            for step in 0..20 {
                let p = plain(top_k, 9);
                let want = sampling::sample(&mut logits.clone(), &[], &p, step);
                let got = gpu_sample(&dev, &mut logits.clone(), &[], &p, step);
                assert!(
                    best[..top_k.min(n)].contains(&got),
                    "n={n} top_k {top_k}: {got}"
                );
                if got != want {
                    let near = near_boundary(&logits, &p, step, got);
                    println!(
                        "tie mismatch n={n} top_k {top_k} step {step}: gpu {got} cpu {want}, near: {near}"
                    );
                    assert!(near);
                }
            }
        }
    }
}

fn sampled(top_k: usize) -> SamplingParams {
    SamplingParams {
        top_k,
        ..SamplingParams::default()
    }
}

#[test]
fn can_sample_greedy_and_top_k() {
    assert!(Device::can_sample(&SamplingParams::greedy()));
    assert!(Device::can_sample(&SamplingParams {
        top_k: 0,
        ..SamplingParams::greedy()
    }));
    assert!(Device::can_sample(&sampled(1)));
    assert!(Device::can_sample(&sampled(Device::MAX_TOP_K)));
    assert!(!Device::can_sample(&sampled(0)));
    assert!(!Device::can_sample(&sampled(Device::MAX_TOP_K + 1)));
}

#[test]
fn refuses_what_it_cannot_sample() {
    let Some(dev) = gpu() else { return };
    let mut l = dev.upload(&[1.0f32, 2.0]).unwrap();
    let r = dev.upload(&[0u32]).unwrap();
    let mut out = dev.zeros::<u32>(1).unwrap();
    let mut scratch = dev.sample_scratch(2).unwrap();
    let err = dev
        .sample(&mut out, &mut l, &r, 1, &sampled(0), 0, &mut scratch)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sample on the GPU needs temperature 0 or top_k in 1..=1024, got temperature 0.7 and top_k 0"
    );
    let err = dev
        .sample(&mut out, &mut l, &r, 2, &sampled(5), 0, &mut scratch)
        .unwrap_err();
    assert_eq!(err.to_string(), "sample: shapes do not match");
    // A scratch for 2 logits: 256 slices of one candidate. 400,000 logits make slices of
    // ceil(400000 / 256) = 1563, each with 5 candidates for top_k 5: 1280.
    let mut big = vec![0.0f32; 400_000];
    big[299_999] = 1.0;
    let mut big = dev.upload(&big).unwrap();
    let want = "sample: the scratch holds 256 candidates, these logits and top_k need 1280 \
                (allocate it with sample_scratch for 400000 logits)";
    let err = dev
        .sample(&mut out, &mut big, &r, 1, &sampled(5), 0, &mut scratch)
        .unwrap_err();
    assert_eq!(err.to_string(), want);
    let (mut tokens, mut pos, mut step) = (
        dev.upload(&[0u32, 0]).unwrap(),
        dev.zeros::<u32>(1).unwrap(),
        dev.zeros::<u64>(1).unwrap(),
    );
    let err = dev
        .sample_dev(
            &mut out,
            &mut big,
            &mut tokens,
            &mut pos,
            &mut step,
            &sampled(5),
            &mut scratch,
        )
        .unwrap_err();
    assert_eq!(err.to_string(), want);
    // The same scratch serves 400,000 logits when greedy: one candidate per slice.
    dev.sample(
        &mut out,
        &mut big,
        &r,
        1,
        &SamplingParams::greedy(),
        0,
        &mut scratch,
    )
    .unwrap();
    assert_eq!(dev.download(&out).unwrap(), [299_999]);
}

/// `sample_dev` over a sequence of decode steps, its state (tokens, pos, step) only on the
/// device, against `sample` given the same tokens, count and draw from the host: the same
/// token and the same penalised logits (bit for bit: the same kernel body on the same inputs,
/// the launch of the same block size), the token in `out[0]` and in `tokens[pos + 1]`, and
/// `pos` and `step` one further after each call. The window of 16 recent tokens slides over
/// tokens the kernel wrote itself; the last step, at the buffer's end, writes no token.
#[test]
fn sample_dev_matches_sample_over_steps() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(13);
    let params = [
        SamplingParams::greedy(),
        SamplingParams {
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            ..SamplingParams::greedy()
        },
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.5,
            top_k: 1024,
            top_p: 0.8,
            min_p: 0.05,
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            seed: 99,
        },
        SamplingParams {
            top_k: 1,
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            ..SamplingParams::default()
        },
    ];
    for n in [VOCAB, 1000] {
        for p in &params {
            let (cap, first_pos, first_step) = (40usize, 9usize, 5u64);
            // A prompt of first_pos + 1 tokens; junk after it, which must be overwritten.
            let mut want_tokens: Vec<u32> = (0..=first_pos)
                .map(|_| ((rng.next_f32() + 1.0) / 2.0 * n as f32) as u32 % n as u32)
                .collect();
            let mut buf = want_tokens.clone();
            buf.resize(cap, 7);
            let mut tokens = dev.upload(&buf).unwrap();
            let mut pos = dev.upload(&[first_pos as u32]).unwrap();
            let mut step = dev.upload(&[first_step]).unwrap();
            let mut out = dev.zeros::<u32>(1).unwrap();
            let mut scratch = dev.sample_scratch(n).unwrap();
            for i in 0..cap - first_pos {
                let (at, draw) = (first_pos + i, first_step + i as u64);
                // The last tokens lead the logits (model_like's peaks reach 15), so that the
                // penalty of 1.3 changes the choice.
                let mut logits = model_like(&mut rng, n);
                for (j, &t) in want_tokens.iter().rev().take(4).enumerate() {
                    logits[t as usize] = 16.0 + j as f32 / 4.0;
                }
                let mut want_logits = dev.upload(&logits).unwrap();
                let recent = dev.upload(&want_tokens).unwrap();
                let mut want_out = dev.zeros::<u32>(1).unwrap();
                dev.sample(
                    &mut want_out,
                    &mut want_logits,
                    &recent,
                    at + 1,
                    p,
                    draw,
                    &mut scratch,
                )
                .unwrap();
                let want = dev.download(&want_out).unwrap()[0];

                let mut got_logits = dev.upload(&logits).unwrap();
                dev.sample_dev(
                    &mut out,
                    &mut got_logits,
                    &mut tokens,
                    &mut pos,
                    &mut step,
                    p,
                    &mut scratch,
                )
                .unwrap();
                let got = dev.download(&out).unwrap()[0];
                assert_eq!(got, want, "n={n} {p:?} position {at}");
                let (gl, wl) = (
                    dev.download(&got_logits).unwrap(),
                    dev.download(&want_logits).unwrap(),
                );
                assert!(
                    gl.iter().zip(&wl).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} {p:?} position {at}: penalised logits differ"
                );
                assert_eq!(dev.download(&pos).unwrap(), [at as u32 + 1]);
                assert_eq!(dev.download(&step).unwrap(), [draw + 1]);
                if at + 1 < cap {
                    want_tokens.push(want);
                }
                let mut want_buf = want_tokens.clone();
                want_buf.resize(cap, 7);
                assert_eq!(
                    dev.download(&tokens).unwrap(),
                    want_buf,
                    "n={n} {p:?} position {at}"
                );
            }
            println!(
                "sample_dev n={n} {p:?}: {} steps equal, last tokens {:?}",
                cap - first_pos,
                &want_tokens[want_tokens.len() - 5..]
            );
        }
    }
}

/// The slices the sampler's first kernel cuts the vocabulary into.
const SLICES: usize = Device::SAMPLE_SLICES;

/// Logits for the slicing cases, each with the top-k values and recent tokens to try.
struct SliceCase {
    what: &'static str,
    logits: Vec<f32>,
    recent: Vec<u32>,
    top_ks: Vec<usize>,
}

/// Inputs that the slicing must get right (`slice` = ceil(n / 256) logits per block):
fn slice_cases(rng: &mut Rng) -> Vec<SliceCase> {
    let mut cases = Vec::new();
    let all_k = vec![1, 2, 20, 64, 100, Device::MAX_TOP_K];
    // Sizes that do not divide into 256 slices, some with empty slices at the end (257: 129
    // slices of 2), and sizes around the slices' capacity of k candidates.
    for n in [1, 3, 255, 257, 1000, 4097, 256 * 20 + 1, VOCAB + 1] {
        let logits = model_like(rng, n);
        let recent = recent_for(rng, &logits);
        cases.push(SliceCase {
            what: "odd size",
            logits,
            recent,
            top_ks: all_k.clone(),
        });
    }
    // Fewer valid logits than k in (almost) every slice: 50 valid among NaN and -inf, and
    // every other logit -inf at n = 1000 (slices of 4 with 2 valid each).
    let mut sparse = vec![f32::NAN; VOCAB];
    for x in sparse.iter_mut().step_by(3) {
        *x = f32::NEG_INFINITY;
    }
    for _ in 0..50 {
        let i = ((rng.next_f32() + 1.0) / 2.0 * VOCAB as f32) as usize % VOCAB;
        sparse[i] = 4.0 * rng.next_f32();
    }
    let recent = recent_for(rng, &sparse);
    cases.push(SliceCase {
        what: "50 valid",
        logits: sparse,
        recent,
        top_ks: all_k.clone(),
    });
    let mut half = model_like(rng, 1000);
    for x in half.iter_mut().step_by(2) {
        *x = f32::NEG_INFINITY;
    }
    let recent = recent_for(rng, &half);
    cases.push(SliceCase {
        what: "half -inf",
        logits: half,
        recent,
        top_ks: all_k.clone(),
    });
    // The 64 best in one slice (slices of 594 at the model's vocabulary: ids 5000..5064 are
    // in slice 8, [4752, 5346)), so that top_k 64 takes all of one block's candidates and
    // top_k 100 adds 36 from others.
    let mut one = model_like(rng, VOCAB);
    for j in 0..64 {
        one[5000 + j] = 20.0 + j as f32 / 8.0;
    }
    cases.push(SliceCase {
        what: "top 64 in one slice",
        logits: one,
        recent: vec![5010, 5063, 4751, 5346],
        top_ks: vec![1, 20, 64, 65, 100],
    });
    // Ties across slices: 40 equal best logits in ids 580..600 (slices 0 and 1) and in
    // 151900..151920 (the last slice, which is short); the lowest ids win.
    let mut ties = model_like(rng, VOCAB);
    for i in (580..600).chain(151_900..151_920) {
        ties[i] = 30.0;
    }
    cases.push(SliceCase {
        what: "ties across slices",
        logits: ties,
        recent: vec![],
        top_ks: vec![1, 10, 14, 20, 25, 40, 64],
    });
    // A window that repeats ids: the best one 50 times, the next twice, and ids at the edges
    // of slices 0 and 1 (593, 594) and of the last (151935) twice each: each penalised once.
    let mut rep = model_like(rng, VOCAB);
    let best = ranking(&rep);
    rep[593] = 15.5;
    rep[594] = 15.25;
    rep[VOCAB - 1] = 15.75;
    let mut recent = vec![best[0]; 50];
    recent.extend([best[1], 593, 594, VOCAB as u32 - 1, best[1], 593, 594]);
    recent.push(VOCAB as u32 - 1);
    cases.push(SliceCase {
        what: "repeated ids",
        logits: rep,
        recent,
        top_ks: vec![1, 5, 20],
    });
    cases
}

#[test]
fn slices_match_cpu() {
    let Some(dev) = gpu() else { return };
    let mut rng = Rng::new(14);
    let (mut cases, mut mismatches) = (0, 0);
    for case in slice_cases(&mut rng) {
        let n = case.logits.len();
        let mut params = vec![SamplingParams {
            repeat_penalty: 1.3,
            ..SamplingParams::greedy()
        }];
        for &top_k in &case.top_ks {
            for (temperature, top_p, repeat_penalty) in [(0.7, 0.8, 1.05), (1.5, 1.0, 1.3)] {
                params.push(SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p: 0.0,
                    repeat_penalty,
                    repeat_last_n: 64,
                    seed: 17 * top_k as u64 + n as u64,
                });
            }
        }
        for p in &params {
            for step in [0, 5, 1000] {
                cases += 1;
                mismatches += check_draw(&dev, &case.logits, &case.recent, p, step) as usize;
            }
        }
        println!("{} n={n}: {} params", case.what, params.len());
    }
    few_mismatches("slices", mismatches, cases);

    // The ties exactly: with no penalty, temperature 1 and no top-p the k tied logits all
    // weigh exp(0) / k, the same on both sides, so every draw agrees, from the lowest k ids.
    let mut ties = vec![0.0f32; VOCAB];
    let tied: Vec<u32> = (580..600).chain(151_900..151_920).collect();
    for &i in &tied {
        ties[i as usize] = 30.0;
    }
    for top_k in [1, 14, 20, 25, 40] {
        let p = plain(top_k, 21);
        for step in 0..100 {
            let want = sampling::sample(&mut ties.clone(), &[], &p, step);
            let got = gpu_sample(&dev, &mut ties.clone(), &[], &p, step);
            assert_eq!(got, want, "ties top_k {top_k} step {step}");
            assert!(
                tied[..top_k].contains(&got),
                "ties top_k {top_k} step {step}: {got}"
            );
        }
    }
}

/// The scheme of the sampler's two kernels, simulated with the CPU's own top-k: each of 256
/// slices keeps its top `min(k, slice)` in id order (padded with NaN), and the top k of those
/// candidates, ties to the earlier position, are the top k of all the logits.
#[test]
fn slice_then_merge_is_the_top_k() {
    let mut rng = Rng::new(15);
    let mut inputs: Vec<Vec<f32>> = Vec::new();
    for n in [1, 5, 256, 257, 1000, 5121, 20_000] {
        inputs.push(model_like(&mut rng, n));
        // Few distinct values: ties everywhere, across slices too.
        inputs.push(rng.vec(n).iter().map(|v| (3.0 * v).floor()).collect());
        // Rising: the best all in the last slices.
        inputs.push((0..n).map(|i| (i / 7) as f32).collect());
        let mut holes = model_like(&mut rng, n);
        for x in holes.iter_mut().step_by(3) {
            *x = f32::NAN;
        }
        inputs.push(holes);
    }
    for logits in &inputs {
        let n = logits.len();
        let slice = n.div_ceil(SLICES).max(1);
        for k in [1, 2, 3, 20, 64, 1024] {
            let cap = k.min(slice);
            let mut cands: Vec<(u32, f32)> = Vec::new();
            for b in 0..SLICES {
                let (lo, hi) = ((b * slice).min(n), ((b + 1) * slice).min(n));
                let mut ids: Vec<u32> = sampling::top_k(&logits[lo..hi], 1.0, k)
                    .iter()
                    .map(|x| lo as u32 + x.0)
                    .collect();
                assert!(ids.len() <= cap);
                ids.sort();
                cands.extend(ids.iter().map(|&i| (i, logits[i as usize])));
                cands.resize(cands.len() + cap - ids.len(), (u32::MAX, f32::NAN));
            }
            assert_eq!(cands.len(), SLICES * cap);
            let mut order: Vec<usize> = (0..cands.len())
                .filter(|&j| cands[j].1 > f32::NEG_INFINITY)
                .collect();
            order.sort_by(|&a, &b| {
                (cands[b].1 + 0.0)
                    .total_cmp(&(cands[a].1 + 0.0))
                    .then(a.cmp(&b))
            });
            let mut got: Vec<u32> = order.iter().take(k).map(|&j| cands[j].0).collect();
            let mut want = ranking(logits);
            want.truncate(k);
            got.sort();
            want.sort();
            assert_eq!(got, want, "n={n} k={k}");
        }
    }
}
