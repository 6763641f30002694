//! Picking the next token from the logits on the CPU: repetition penalty, temperature, top-k,
//! top-p, min-p and a seeded draw, in the order of HF transformers and llama.cpp.
//!
//! A GPU twin must pick the same token for the same logits and seed, so every step is a public
//! function it can be tested against, and the random number depends only on (seed, step).
//! Candidates are `(token id, value)` pairs; "better" means a higher value, then a lower id.

use std::cmp::Ordering;

use crate::{Error, Result, cpu};

/// How to pick a token. `Default` is what Qwen recommends for its instruct models.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `top_k` best tokens; 0 = off.
    pub top_k: usize,
    /// Keep the fewest best tokens whose probabilities add up to `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Makes tokens seen in the last `repeat_last_n` less likely; 1 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.0,
            repeat_penalty: 1.05,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Always the most likely token: no temperature, no repetition penalty.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            repeat_penalty: 1.0,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Invalid(msg));
        let (t, p, m, r) = (
            self.temperature,
            self.top_p,
            self.min_p,
            self.repeat_penalty,
        );
        if !(t >= 0.0 && t.is_finite()) {
            return bad(format!(
                "--temperature must be a finite number >= 0, got {t}"
            ));
        }
        if !(p > 0.0 && p <= 1.0) {
            return bad(format!("--top-p must be in (0, 1], got {p}"));
        }
        if !(0.0..=1.0).contains(&m) {
            return bad(format!("--min-p must be in [0, 1], got {m}"));
        }
        if !(r > 0.0 && r.is_finite()) {
            return bad(format!(
                "--repeat-penalty must be a finite number > 0, got {r}"
            ));
        }
        Ok(())
    }
}

/// The increment of SplitMix64's Weyl sequence: 2^64 / golden ratio.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// A number in [0, 1) that depends on nothing but `(seed, step)`, so the GPU can draw the same
/// one without carrying generator state. The GPU reimplements it bit for bit:
///
/// ```text
/// z = seed + (step + 1) * 0x9E3779B97F4A7C15      (u64, wrapping)
/// z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9         (u64, wrapping)
/// z = (z ^ (z >> 27)) * 0x94D049BB133111EB         (u64, wrapping)
/// z =  z ^ (z >> 31)
/// u = (z >> 40) as f32 / 16777216.0                (exact: 24 bits fit an f32)
/// ```
///
/// `z` is output number `step` (from 0) of the standard SplitMix64 generator seeded with `seed`.
pub fn uniform(seed: u64, step: u64) -> f32 {
    let z = splitmix64(seed.wrapping_add(step.wrapping_add(1).wrapping_mul(GOLDEN)));
    (z >> 40) as f32 / 16_777_216.0
}

/// SplitMix64's output function (Steele, Lea & Flood 2014) of the state `z`.
fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The next token for `logits` (penalised in place), given the tokens so far (`recent`) and
/// the index of this draw (`step`). `p` should have passed `validate`. NaN logits count as
/// -inf; if every logit is NaN or -inf the answer is token 0.
pub fn sample(logits: &mut [f32], recent: &[u32], p: &SamplingParams, step: u64) -> u32 {
    apply_repeat_penalty(logits, recent, p.repeat_penalty, p.repeat_last_n);
    if p.temperature == 0.0 {
        // `argmax` skips NaN and answers u32::MAX when nothing beats -inf.
        return match cpu::argmax(logits) {
            u32::MAX => 0,
            t => t,
        };
    }
    let mut c = top_k(logits, p.temperature, p.top_k);
    softmax(&mut c);
    top_p(&mut c, p.top_p);
    min_p(&mut c, p.min_p);
    if c.is_empty() {
        return 0;
    }
    pick(&mut c, uniform(p.seed, step))
}

/// Step 1 (CTRL, as HF transformers and llama.cpp do it): every distinct token among the last
/// `last_n` of `recent` gets its logit divided by `penalty` if it is >= 0, multiplied if it is
/// negative. Ids outside the vocabulary are ignored.
pub fn apply_repeat_penalty(logits: &mut [f32], recent: &[u32], penalty: f32, last_n: usize) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = recent[recent.len().saturating_sub(last_n)..].to_vec();
    seen.sort_unstable();
    seen.dedup();
    for id in seen {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
        }
    }
}

/// OpenAI's additive penalties (`frequency_penalty`, `presence_penalty`), applied after the
/// repetition penalty as vLLM does: a token that occurs `c` times in `output` (the generated
/// tokens, not the prompt) loses `c * frequency + presence` from its logit. Negative values
/// favour repeats. Ids outside the vocabulary are ignored.
pub fn apply_frequency_presence(logits: &mut [f32], output: &[u32], frequency: f32, presence: f32) {
    if frequency == 0.0 && presence == 0.0 {
        return;
    }
    let mut ids = output.to_vec();
    ids.sort_unstable();
    for run in ids.chunk_by(|a, b| a == b) {
        if let Some(l) = logits.get_mut(run[0] as usize) {
            *l -= run.len() as f32 * frequency + presence;
        }
    }
}

/// Steps 3 and 4: the candidates `(id, (logit - max) / temperature)`, only those with the `k`
/// best logits (ties to the lower id) unless `k` is 0, in no particular order. NaN and -inf
/// logits are never candidates. Dividing keeps the order, so top-k is done on the logits and
/// only the kept are divided. Subtracting the max first keeps the best at exactly 0 and nothing
/// overflows, however small the temperature.
pub fn top_k(logits: &[f32], temperature: f32, k: usize) -> Vec<(u32, f32)> {
    let finite = logits.iter().enumerate().map(|(i, &l)| (i as u32, l));
    let finite = finite.filter(|x| x.1 > f32::NEG_INFINITY);
    let mut c: Vec<(u32, f32)> = Vec::new();
    if k == 0 {
        c.extend(finite);
    } else {
        // A logit that does not beat the k-th best so far (`floor`) can never be in: k others
        // are at least as high and have lower ids. The rest go into a buffer that is cut back
        // to its k best whenever it holds 2k, so this is O(n) whatever the order of the logits.
        let mut floor = f32::NEG_INFINITY;
        for x in finite {
            if x.1 > floor {
                c.push(x);
                if c.len() == k.saturating_mul(2) {
                    c.select_nth_unstable_by(k - 1, better);
                    c.truncate(k);
                    floor = c[k - 1].1;
                }
            }
        }
        if c.len() > k {
            c.select_nth_unstable_by(k - 1, better);
            c.truncate(k);
        }
    }
    let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
    for x in c.iter_mut() {
        x.1 = if x.1 == max {
            0.0
        } else {
            (x.1 - max) / temperature
        };
    }
    c
}

/// Step 5: values to probabilities.
pub fn softmax(c: &mut [(u32, f32)]) {
    let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
    let mut sum = 0.0;
    for x in c.iter_mut() {
        x.1 = (x.1 - max).exp();
        sum += x.1;
    }
    for x in c.iter_mut() {
        x.1 /= sum;
    }
}

/// Step 6: keep the fewest best candidates whose probabilities add up to at least `top_p`
/// (at least one), sorted best first. 1 (or more) keeps everything as it is.
pub fn top_p(c: &mut Vec<(u32, f32)>, top_p: f32) {
    if top_p < 1.0 && !c.is_empty() {
        let last = head_until(c, top_p);
        c.truncate(last + 1);
    }
}

/// Step 7: drop the candidates less likely than `min_p` times the most likely one.
pub fn min_p(c: &mut Vec<(u32, f32)>, min_p: f32) {
    if min_p > 0.0 {
        let floor = min_p * c.iter().fold(0.0f32, |m, x| m.max(x.1));
        c.retain(|x| x.1 >= floor);
    }
}

/// Step 8: walking the candidates best first, the first at which the running sum of weights
/// reaches `u` (in [0, 1)) times their total; the last one if rounding leaves the sum short.
/// `c` must not be empty; the weights need not add up to 1.
pub fn pick(c: &mut [(u32, f32)], u: f32) -> u32 {
    let total: f32 = c.iter().map(|x| x.1).sum();
    c[head_until(c, u * total)].0
}

/// Sorts the head of `c` (not empty) best first, up to the first candidate at which the running
/// sum of weights reaches `mass`, and returns that one's index (the last if the sum never gets
/// there). The answer is the same as after sorting all of `c`, but only the head is sorted:
/// candidates are taken in bands of weight [max / 64^b, max / 64^(b-1)) from the top down and a
/// vocabulary's long tail is rarely reached. The 9th band takes all that is left (NaN too).
fn head_until(c: &mut [(u32, f32)], mass: f32) -> usize {
    let max = c.iter().fold(0.0f32, |m, x| m.max(x.1));
    let (mut band, mut done, mut sum) = (0, 0, 0.0f32);
    loop {
        band += 1;
        let t = max / 64f32.powi(band);
        let mut end = done;
        for j in done..c.len() {
            if band > 8 || c[j].1 >= t {
                c.swap(end, j);
                end += 1;
            }
        }
        c[done..end].sort_unstable_by(better);
        for (i, x) in c.iter().enumerate().take(end).skip(done) {
            sum += x.1;
            if sum >= mass {
                return i;
            }
        }
        if end == c.len() {
            return end - 1;
        }
        done = end;
    }
}

/// Candidate order: higher value first, then lower id. `+ 0.0` turns -0 into +0 so the two
/// tie, as `>` has them; `total_cmp` keeps the order total (no panic in the sorts) should a NaN
/// get in through an invalid temperature.
fn better(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    (b.1 + 0.0).total_cmp(&(a.1 + 0.0)).then(a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sampling with only temperature on (no penalty, top-k, top-p or min-p).
    fn plain(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed,
        }
    }

    /// Draws `n` tokens for fixed logits, steps 0..n.
    fn draws(logits: &[f32], p: &SamplingParams, n: u64) -> Vec<u32> {
        (0..n)
            .map(|step| sample(&mut logits.to_vec(), &[], p, step))
            .collect()
    }

    fn counts(tokens: &[u32], vocab: usize) -> Vec<usize> {
        let mut c = vec![0; vocab];
        for &t in tokens {
            c[t as usize] += 1;
        }
        c
    }

    fn ln(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn uniform_is_splitmix64() {
        // The first five outputs of SplitMix64 seeded with 1234567 (Rosetta Code's task).
        let want: [u64; 5] = [
            6457827717110365317,
            3203168211198807973,
            9817491932198370423,
            4593380528125082431,
            16408922859458223821,
        ];
        for (step, &w) in want.iter().enumerate() {
            let z = splitmix64(1234567u64.wrapping_add((step as u64 + 1).wrapping_mul(GOLDEN)));
            assert_eq!(z, w, "output {step}");
            assert_eq!(
                uniform(1234567, step as u64),
                (w >> 40) as f32 / 16_777_216.0
            );
        }
    }

    #[test]
    fn uniform_range_and_moments() {
        for seed in [0, 1, u64::MAX] {
            let n = 100_000;
            let (mut sum, mut sq) = (0.0f64, 0.0f64);
            for step in 0..n {
                let u = uniform(seed, step);
                assert!((0.0..1.0).contains(&u), "seed {seed} step {step}: {u}");
                sum += u as f64;
                sq += (u as f64) * (u as f64);
            }
            let mean = sum / n as f64;
            let var = sq / n as f64 - mean * mean;
            // The mean's standard deviation is sqrt(1/12 / 1e5) = 0.0009: allow 5 of them.
            assert!((mean - 0.5).abs() < 0.0046, "seed {seed}: mean {mean}");
            assert!(
                (var - 1.0 / 12.0).abs() < 0.002,
                "seed {seed}: variance {var}"
            );
        }
        assert!(uniform(u64::MAX, u64::MAX) < 1.0);
    }

    #[test]
    fn defaults_and_validation() {
        let d = SamplingParams::default();
        assert_eq!(
            (
                d.temperature,
                d.top_k,
                d.top_p,
                d.min_p,
                d.repeat_penalty,
                d.repeat_last_n,
                d.seed
            ),
            (0.7, 20, 0.8, 0.0, 1.05, 64, 0)
        );
        assert!(d.validate().is_ok());
        assert_eq!(SamplingParams::greedy().temperature, 0.0);
        assert!(SamplingParams::greedy().validate().is_ok());

        let msg = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p.validate().unwrap_err().to_string()
        };
        assert_eq!(
            msg(&|p| p.temperature = -0.5),
            "--temperature must be a finite number >= 0, got -0.5"
        );
        assert_eq!(
            msg(&|p| p.temperature = f32::NAN),
            "--temperature must be a finite number >= 0, got NaN"
        );
        assert_eq!(
            msg(&|p| p.temperature = f32::INFINITY),
            "--temperature must be a finite number >= 0, got inf"
        );
        assert_eq!(
            msg(&|p| p.top_p = 1.5),
            "--top-p must be in (0, 1], got 1.5"
        );
        assert_eq!(msg(&|p| p.top_p = 0.0), "--top-p must be in (0, 1], got 0");
        assert_eq!(
            msg(&|p| p.min_p = -0.1),
            "--min-p must be in [0, 1], got -0.1"
        );
        assert_eq!(msg(&|p| p.min_p = 2.0), "--min-p must be in [0, 1], got 2");
        assert_eq!(
            msg(&|p| p.repeat_penalty = 0.0),
            "--repeat-penalty must be a finite number > 0, got 0"
        );
    }

    #[test]
    fn repeat_penalty_formula() {
        let mut logits = [2.0, -1.0, 0.5, 3.0, 0.0];
        // The last 4 are [1, 1, 4, 3] (id 0 has left the window, 99 is outside the vocab):
        // ids 1, 3 and 4 are penalised once each.
        apply_repeat_penalty(&mut logits, &[0, 1, 1, 4, 99, 3], 2.0, 5);
        assert_eq!(logits, [2.0, -2.0, 0.5, 1.5, 0.0]);

        let mut logits = [3.0, -3.0];
        apply_repeat_penalty(&mut logits, &[0, 1], 1.5, 64);
        assert_eq!(logits, [2.0, -4.5]);
        apply_repeat_penalty(&mut logits, &[0, 1], 1.5, 0);
        assert_eq!(logits, [2.0, -4.5]);

        // Through `sample`: 3 / 2 = 1.5 falls below 2, so greedy switches to token 1.
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&mut [3.0, 2.0], &[0], &p, 0), 1);
        assert_eq!(sample(&mut [3.0, 2.0], &[1], &p, 0), 0);
    }

    #[test]
    fn frequency_and_presence_penalties() {
        // Token 1 occurs three times, 3 once, 0 never; 9 is outside the vocabulary.
        let output = [1, 3, 1, 9, 1];
        let mut logits = [1.0, 2.0, -1.0, 0.5];
        apply_frequency_presence(&mut logits, &output, 0.5, 0.0);
        assert_eq!(logits, [1.0, 0.5, -1.0, 0.0]);
        let mut logits = [1.0, 2.0, -1.0, 0.5];
        apply_frequency_presence(&mut logits, &output, 0.0, 0.25);
        assert_eq!(logits, [1.0, 1.75, -1.0, 0.25]);
        // Both, and negative: repeats favoured.
        let mut logits = [1.0, 2.0, -1.0, 0.5];
        apply_frequency_presence(&mut logits, &output, -1.0, 1.0);
        assert_eq!(logits, [1.0, 4.0, -1.0, 0.5]);
        // Greedy switches away from a token once it has been generated enough.
        let p = SamplingParams::greedy();
        let mut logits = [3.0, 2.0];
        apply_frequency_presence(&mut logits, &[0, 0], 0.6, 0.0);
        assert_eq!(sample(&mut logits, &[], &p, 0), 1);
        let mut logits = [3.0, 2.0];
        apply_frequency_presence(&mut logits, &[0], 0.6, 0.0);
        assert_eq!(sample(&mut logits, &[], &p, 0), 0);
    }

    #[test]
    fn greedy_ties_and_nan() {
        let p = SamplingParams {
            repeat_penalty: 1.0,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&mut [1.0, 5.0, 5.0, 2.0], &[], &p, 0), 1);
        assert_eq!(sample(&mut [f32::NAN, 1.0, f32::NAN, 0.5], &[], &p, 0), 1);
        assert_eq!(sample(&mut [f32::NAN; 4], &[], &p, 0), 0);
        // Sampled, NaN and -inf tokens are never drawn; all NaN gives token 0.
        let logits = [f32::NAN, 1.0, f32::NAN, 0.5, f32::NEG_INFINITY];
        let c = counts(&draws(&logits, &plain(1.0, 3), 2000), 5);
        assert_eq!((c[0], c[2], c[4]), (0, 0, 0));
        assert!(c[1] > c[3] && c[3] > 0, "{c:?}");
        assert_eq!(
            draws(&[f32::NAN, f32::NEG_INFINITY], &plain(1.0, 3), 10),
            vec![0; 10]
        );
    }

    #[test]
    fn top_k_keeps_the_k_best() {
        // 1000 logits in [0, 10) and their 5 best, found by a full sort.
        let logits: Vec<f32> = (0..1000).map(|i| 10.0 * uniform(99, i)).collect();
        let mut order: Vec<u32> = (0..1000).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let best = &order[..5];

        let p = SamplingParams {
            temperature: 1.5,
            top_k: 5,
            ..plain(1.0, 11)
        };
        let tokens = draws(&logits, &p, 5000);
        let c = counts(&tokens, 1000);
        for (id, &n) in c.iter().enumerate() {
            assert_eq!(
                n > 0,
                best.contains(&(id as u32)),
                "token {id} drawn {n} times"
            );
        }

        // The selection against a full sort, on logits with many ties, rising and shuffled.
        let rising: Vec<f32> = (0..1000).map(|i| (i / 10) as f32).collect();
        let shuffled: Vec<f32> = (0..1000).map(|i| (10.0 * uniform(4, i)).floor()).collect();
        for logits in [&rising, &shuffled] {
            let mut order: Vec<u32> = (0..1000).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            for k in [1, 2, 7, 15, 999, 1000, 5000] {
                let mut ids: Vec<u32> = top_k(logits, 1.0, k).iter().map(|x| x.0).collect();
                let mut want = order[..k.min(1000)].to_vec();
                ids.sort();
                want.sort();
                assert_eq!(ids, want, "k {k}");
            }
        }

        // Ties at the boundary go to the lower id.
        let mut ids: Vec<u32> = top_k(&[1.0, 2.0, 2.0, 2.0, 0.0], 1.0, 2)
            .iter()
            .map(|x| x.0)
            .collect();
        ids.sort();
        assert_eq!(ids, [1, 2]);
        let mut ids: Vec<u32> = top_k(&[2.0, 2.0, 2.0, 3.0], 1.0, 3)
            .iter()
            .map(|x| x.0)
            .collect();
        ids.sort();
        assert_eq!(ids, [0, 1, 3]);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let logits = ln(&[0.25, 0.6, 0.15]);
        let p = SamplingParams {
            top_p: 0.5,
            ..plain(1.0, 5)
        };
        assert_eq!(draws(&logits, &p, 2000), vec![1; 2000]);

        // 0.6 < 0.7 <= 0.6 + 0.25: two tokens, best first.
        let mut c = top_k(&logits, 1.0, 0);
        softmax(&mut c);
        top_p(&mut c, 0.7);
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 0]);

        // Sampled: token 0 with probability 0.25 / 0.85 = 0.294.
        let p = SamplingParams {
            top_p: 0.7,
            ..plain(1.0, 5)
        };
        let c = counts(&draws(&logits, &p, 10_000), 3);
        assert_eq!(c[2], 0);
        let f = c[0] as f64 / 10_000.0;
        assert!((f - 0.294).abs() < 0.025, "{f}");
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        // The floor is 0.2 * 0.5 = 0.1: token 3 (0.08) goes, token 2 (0.12) stays.
        let logits = ln(&[0.5, 0.3, 0.12, 0.08]);
        let mut c = top_k(&logits, 1.0, 0);
        softmax(&mut c);
        min_p(&mut c, 0.2);
        let mut ids: Vec<u32> = c.iter().map(|x| x.0).collect();
        ids.sort();
        assert_eq!(ids, [0, 1, 2]);

        let p = SamplingParams {
            min_p: 0.2,
            ..plain(1.0, 8)
        };
        let c = counts(&draws(&logits, &p, 5000), 4);
        assert_eq!(c[3], 0);
        assert!(c[2] > 0, "{c:?}");
    }

    #[test]
    fn low_temperature_is_greedy() {
        let logits = [1.0, 3.0, 2.9, -1.0];
        let greedy = SamplingParams {
            repeat_penalty: 1.0,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&mut logits.to_vec(), &[], &greedy, 0), 1);
        // Token 2 is 0.1 / 1e-3 = 100 nats behind: probability e^-100.
        assert_eq!(draws(&logits, &plain(1e-3, 1), 2000), vec![1; 2000]);
        // Temperatures small enough to overflow logit / temperature still work.
        let huge = [1e30, 3e30, 2e30];
        assert_eq!(draws(&huge, &plain(1e-30, 1), 100), vec![1; 100]);
        // At temperature 1 token 2 does come up (probability 0.45).
        assert!(draws(&logits, &plain(1.0, 1), 100).contains(&2));
    }

    #[test]
    fn temperature_one_matches_probabilities() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let n = 20_000;
        let c = counts(&draws(&ln(&probs), &plain(1.0, 7), n), 4);
        let chi2: f64 = (0..4)
            .map(|i| {
                let e = probs[i] as f64 * n as f64;
                (c[i] as f64 - e).powi(2) / e
            })
            .sum();
        // The 99.9% point of chi-square with 3 degrees of freedom.
        assert!(chi2 < 16.27, "chi2 {chi2}, counts {c:?}");

        // Temperature 2 flattens to probabilities proportional to sqrt(p): 0.1 -> 0.1429.
        let c = counts(&draws(&ln(&probs), &plain(2.0, 7), n), 4);
        let f = c[0] as f64 / n as f64;
        let want = 0.1f64.sqrt() / probs.iter().map(|&p| (p as f64).sqrt()).sum::<f64>();
        assert!((f - want).abs() < 0.01, "{f} vs {want}");
    }

    #[test]
    fn seed_reproduces() {
        let logits: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
        let p = SamplingParams {
            seed: 1,
            ..SamplingParams::default()
        };
        // Feed each token back as recent so the penalty takes part too.
        let run = |p: &SamplingParams| {
            let mut recent = Vec::new();
            for step in 0..50 {
                let t = sample(&mut logits.clone(), &recent, p, step);
                recent.push(t);
            }
            recent
        };
        let a = run(&p);
        assert_eq!(a, run(&p));
        assert_ne!(
            a,
            run(&SamplingParams {
                seed: 2,
                ..p.clone()
            })
        );
        assert!(
            counts(&a, 10).iter().filter(|&&n| n > 0).count() > 3,
            "{a:?}"
        );
    }

    #[test]
    fn invalid_params_do_not_hang_or_panic() {
        let logits = [1.0, f32::NAN, 3.0, 2.0, f32::INFINITY, -1.0];
        for p in [
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: -1.0,
                top_k: 0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: f32::NAN,
                min_p: 2.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                repeat_penalty: f32::NAN,
                ..SamplingParams::default()
            },
        ] {
            assert!(p.validate().is_err());
            assert!((sample(&mut logits.to_vec(), &[0, 2], &p, 0) as usize) < logits.len());
        }
        // Weights of every kind reach the last band and the walk ends.
        let mut c = vec![(0, f32::NAN), (1, -1.0), (2, f32::INFINITY), (3, 0.0)];
        assert!(pick(&mut c, 0.5) < 4);
    }

    #[test]
    fn head_until_matches_a_full_sort() {
        // Weights with many exact ties and a long tail; masses across the whole range.
        let c: Vec<(u32, f32)> = (0..5000)
            .map(|i| {
                let u = uniform(5, i);
                (i as u32, (-(60.0 * u).round()).exp())
            })
            .collect();
        let mut sorted = c.clone();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f32 = c.iter().map(|x| x.1).sum();
        for k in 0..200 {
            let mass = total * uniform(6, k);
            let mut sum = 0.0f32;
            let want = sorted.iter().position(|x| {
                sum += x.1;
                sum >= mass
            });
            let want = want.unwrap_or(sorted.len() - 1);
            let mut got = c.clone();
            let i = head_until(&mut got, mass);
            assert_eq!(i, want, "mass {mass}");
            assert_eq!(got[..=i], sorted[..=i]);
        }
        // More than the total: everything, the last is the worst.
        let mut got = c.clone();
        assert_eq!(head_until(&mut got, 2.0 * total), c.len() - 1);
        assert_eq!(got, sorted);
    }
}
