//! `Device::sample` against its CPU twin `orcd::sampling::sample`: greedy, top-k with
//! temperature, top-p, min-p and repetition penalty over a grid of params and draws, ties,
//! and the params the GPU refuses. `Device::sample_dev` (position and draw in device memory)
//! against `Device::sample` over sequences of decode steps.
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
    dev.sample(&mut out, &mut l, &r, recent.len(), p, step)
        .unwrap();
    logits.copy_from_slice(&dev.download(&l).unwrap());
    dev.download(&out).unwrap()[0]
}

/// Logits like a model's: most in [-6, 6), a few peaks up to 16, so that top-p and min-p cut
/// inside the top k.
fn model_like(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = rng.vec(n).iter().map(|v| 6.0 * v).collect();
    for j in 0..8.min(n) {
        let i = ((rng.next_f32() + 1.0) / 2.0 * n as f32) as usize % n;
        x[i] = 8.0 + j as f32;
    }
    x
}

/// Ids sorted best first: higher logit, then lower id; NaN and -inf left out.
fn ranking(logits: &[f32]) -> Vec<u32> {
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
fn recent_for(rng: &mut Rng, logits: &[f32]) -> Vec<u32> {
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
fn near_boundary(logits: &[f32], p: &SamplingParams, step: u64, token: u32) -> bool {
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
                                let mut want_logits = logits.clone();
                                let want = sampling::sample(&mut want_logits, &recent, &p, step);
                                let mut got_logits = logits.clone();
                                let got = gpu_sample(&dev, &mut got_logits, &recent, &p, step);
                                // The penalty is one IEEE multiply or divide: bit for bit.
                                assert!(
                                    got_logits
                                        .iter()
                                        .zip(&want_logits)
                                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                                    "penalised logits differ: n={n} {p:?}"
                                );
                                // Top-k is exact: fewer than k valid logits beat the token.
                                let g = got as usize;
                                let beaten_by = want_logits
                                    .iter()
                                    .enumerate()
                                    .filter(|&(i, &v)| {
                                        v > want_logits[g] || (v == want_logits[g] && i < g)
                                    })
                                    .count();
                                assert!(
                                    beaten_by < top_k,
                                    "token {got} is not in the top {top_k}: n={n} {p:?}"
                                );
                                cases += 1;
                                if got != want {
                                    mismatches += 1;
                                    let near = near_boundary(&want_logits, &p, step, got);
                                    println!(
                                        "mismatch n={n} step={step} {p:?}: gpu {got} cpu {want}, near a boundary: {near}"
                                    );
                                    assert!(near, "a mismatch that is not rounding at a boundary");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    println!("sample: {mismatches} mismatches in {cases} draws");
    // Draws that land within NEAR of a boundary: ~1e-5 each, so 0.1% is a wide margin.
    assert!(
        mismatches * 1000 <= cases,
        "{mismatches} mismatches in {cases} draws"
    );

    // Time per token at the model's vocabulary with the default params, for the record.
    let p = SamplingParams::default();
    let logits = model_like(&mut rng, VOCAB);
    let recent = recent_for(&mut rng, &logits);
    let mut l = dev.upload(&logits).unwrap();
    let r = dev.upload(&recent).unwrap();
    let mut out = dev.zeros::<u32>(1).unwrap();
    let runs = 200;
    dev.sample(&mut out, &mut l, &r, recent.len(), &p, 0)
        .unwrap();
    dev.synchronize().unwrap();
    let t = Instant::now();
    for step in 0..runs {
        dev.sample(&mut out, &mut l, &r, recent.len(), &p, step)
            .unwrap();
    }
    dev.synchronize().unwrap();
    let us = t.elapsed().as_secs_f64() * 1e6 / runs as f64;
    println!("sample vocab {VOCAB} defaults: {us:.1} us per token (launch included)");
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

#[test]
fn ties_resolve_by_lowest_id() {
    let Some(dev) = gpu() else { return };
    let plain = |top_k, seed| SamplingParams {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed,
    };
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
    let err = dev
        .sample(&mut out, &mut l, &r, 1, &sampled(0), 0)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sample on the GPU needs temperature 0 or top_k in 1..=1024, got temperature 0.7 and top_k 0"
    );
    let err = dev
        .sample(&mut out, &mut l, &r, 2, &sampled(5), 0)
        .unwrap_err();
    assert_eq!(err.to_string(), "sample: shapes do not match");
    let mut big = dev.zeros::<f32>(400_000).unwrap();
    let err = dev
        .sample(&mut out, &mut big, &r, 1, &sampled(5), 0)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "sample on the GPU handles vocabularies up to 393216 tokens, got 400000"
    );
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
                dev.sample(&mut want_out, &mut want_logits, &recent, at + 1, p, draw)
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
