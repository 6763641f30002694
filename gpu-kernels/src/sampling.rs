//! Token choice on the GPU, so that only the chosen id crosses to the host.
//! CPU twins: `orcd::cpu::argmax` and `orcd::sampling::sample` (same steps, same order, same
//! tie rule: a higher value, then a lower id).
use core::sync::atomic::{AtomicU32, Ordering::Relaxed};

use crate::util::{WARP, better, block_dim, block_sum, shared, sync_threads, thread, warp_argmax};

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.down.i32"]
    fn shfl_down_i32(mask: u32, v: i32, delta: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.vote.ballot.sync"]
    fn ballot(mask: u32, pred: bool) -> u32;
    #[link_name = "llvm.nvvm.ex2.approx.f"]
    fn ex2(x: f32) -> f32;
}

/// Index of the largest of `n` floats; the first index wins on ties, NaN never wins
/// (all NaN gives `u32::MAX`). Grid: one block; block: a multiple of 32 threads, at most 1024;
/// shared: 32 f32 + 32 u32.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn argmax(out: *mut u32, x: *const f32, n: u32) {
    let (_, i) = scan_best(x, n);
    if thread() == 0 {
        unsafe { *out = i };
    }
}

/// The most candidates top-k keeps: the shared candidate arrays' length.
const MAX_K: u32 = 1024;
/// Shared memory of `sample`, in 4-byte words: [0, 64) block reductions (`block_sum`,
/// `block_best`), then scalars passed between threads, per-warp counts, the radix histogram
/// and the candidates (value, id): 4224 words in all, a number the host's launch code repeats.
/// The penalty's bitmap of `n` bits reuses it from word 0 before any of these is live.
const VARS: usize = 64;
const WARP_COUNTS: usize = 96;
const HIST: usize = 128;
const BINS: u32 = 2048;
const CAND_V: usize = HIST + BINS as usize;
const CAND_I: usize = CAND_V + MAX_K as usize;
/// Slots in VARS.
const DIGIT: usize = 0;
const REMAINING: usize = 1;
const COUNT: usize = 2;
const NONE: u32 = u32::MAX;

/// The next token into `out[0]`, as `orcd::sampling::sample` picks it for these logits
/// (penalised in place), the window `recent[..window]` of recent tokens and the draw
/// `uniform(seed, step)`. `temperature` 0 is greedy; otherwise `top_k` must be in 1..=1024.
/// Grid: one block; block: a power of two from 64 to 1024 threads; shared:
/// 4 * max(4224, ceil(n / 32)) bytes.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn sample(
    out: *mut u32,
    logits: *mut f32,
    n: u32,
    recent: *const u32,
    window: u32,
    penalty: f32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    seed: u64,
    step: u64,
) {
    let token = choose(
        logits,
        n,
        recent,
        window,
        penalty,
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        step,
    );
    if thread() == 0 {
        unsafe { *out = token };
    }
}

/// `sample` for a decode step with every per-step value in device memory, so that a captured
/// CUDA graph replays it: the tokens so far are `tokens[..=pos[0]]` (the penalty looks at the
/// last `repeat_last_n` of them) and the draw is `uniform(seed, step[0])`. The token goes to
/// `out[0]` and to `tokens[pos[0] + 1]` (the next step's input; not written when that is past
/// `n_tokens`, the buffer's length), then `pos[0]` and `step[0]` advance by one.
/// `pos[0] >= n_tokens` traps. Grid, block and shared memory as `sample`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn sample_dev(
    out: *mut u32,
    logits: *mut f32,
    n: u32,
    tokens: *mut u32,
    n_tokens: u32,
    pos: *mut u32,
    step: *mut u64,
    repeat_last_n: u32,
    penalty: f32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    seed: u64,
) {
    let (p0, draw) = unsafe { (*pos, *step) };
    if p0 >= n_tokens {
        unsafe { core::arch::nvptx::trap() };
    }
    let window = (p0 + 1).min(repeat_last_n);
    let recent = unsafe { tokens.add((p0 + 1 - window) as usize) };
    let token = choose(
        logits,
        n,
        recent,
        window,
        penalty,
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        draw,
    );
    // Every path of `choose` passes a barrier, so all threads have read pos and step.
    if thread() == 0 {
        unsafe {
            *out = token;
            if p0 + 1 < n_tokens {
                *tokens.add(p0 as usize + 1) = token;
            }
            *pos = p0 + 1;
            *step = draw + 1;
        }
    }
}

/// The token of `sample`'s steps, valid in thread 0. Every thread of the block calls it.
#[allow(clippy::too_many_arguments)]
fn choose(
    logits: *mut f32,
    n: u32,
    recent: *const u32,
    window: u32,
    penalty: f32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    seed: u64,
    step: u64,
) -> u32 {
    let (t, bd) = (thread(), block_dim());
    if penalty != 1.0 && window > 0 {
        repeat_penalty(logits, n, recent, window, penalty);
    }
    if temperature == 0.0 {
        let (_, i) = scan_best(logits, n);
        return if i == u32::MAX { 0 } else { i };
    }
    let (kth, need_eq) = kth_key(logits, n, top_k);
    let count = gather(logits, n, kth, need_eq);
    if count == 0 {
        return 0;
    }
    let sh = shared::<u32>();
    let cv = unsafe { sh.add(CAND_V) } as *mut f32;
    let ci = unsafe { sh.add(CAND_I) };
    let at = |j: u32| unsafe { cv.add(j as usize) };

    // Steps 3 to 5: (logit - max) / temperature, the best at exactly 0, then softmax.
    let mut m = f32::NEG_INFINITY;
    let mut j = t;
    while j < count {
        m = m.max(unsafe { *at(j) });
        j += bd;
    }
    let (max, _) = block_best(m, 0);
    let mut sum = 0.0;
    let mut j = t;
    while j < count {
        let v = unsafe { *at(j) };
        let s = if v == max {
            0.0
        } else {
            (v - max) / temperature
        };
        let e = exp(s);
        unsafe { *at(j) = e };
        sum += e;
        j += bd;
    }
    let sum = block_sum(sum);
    // The sort's padding comes last: no probability is below -inf, no id above u32::MAX.
    let len = count.next_power_of_two();
    let mut j = t;
    while j < len {
        unsafe {
            if j < count {
                *at(j) /= sum;
            } else {
                *at(j) = f32::NEG_INFINITY;
                *ci.add(j as usize) = u32::MAX;
            }
        }
        j += bd;
    }
    sync_threads();
    sort(cv, ci, len);

    // Steps 6 to 8 walk the sorted candidates in order, one thread, so that every running
    // sum is rounded as the CPU rounds it.
    if t != 0 {
        return 0;
    }
    let p = |j: u32| unsafe { *at(j) };
    let mut kept = count;
    if top_p < 1.0 {
        kept = walk(&p, count, top_p) + 1;
    }
    if min_p > 0.0 {
        let floor = min_p * p(0);
        let mut j = 0;
        while j < kept && p(j) >= floor {
            j += 1;
        }
        kept = j;
    }
    if kept == 0 {
        return 0;
    }
    let mut total = 0.0f32;
    for j in 0..kept {
        total += p(j);
    }
    unsafe { *ci.add(walk(&p, kept, uniform(seed, step) * total) as usize) }
}

/// The first `j` < `len` (not 0) at which `p(0) + ... + p(j)` reaches `mass`; `len - 1` if the
/// sum never gets there.
fn walk(p: &impl Fn(u32) -> f32, len: u32, mass: f32) -> u32 {
    let mut sum = 0.0f32;
    for j in 0..len {
        sum += p(j);
        if sum >= mass {
            return j;
        }
    }
    len - 1
}

/// The best (value, index) of the block, by `better`; every thread gets it. Needs 32 f32 +
/// 32 u32 of shared memory at word 0.
fn block_best(v: f32, i: u32) -> (f32, u32) {
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let (v, i) = warp_argmax(v, i);
    let sv = shared::<f32>();
    let si = unsafe { sv.add(32) } as *mut u32;
    if lane == 0 {
        unsafe {
            *sv.add(warp as usize) = v;
            *si.add(warp as usize) = i;
        }
    }
    sync_threads();
    let (v, i) = if lane < warps {
        unsafe { (*sv.add(lane as usize), *si.add(lane as usize)) }
    } else {
        (f32::NEG_INFINITY, u32::MAX)
    };
    let best = warp_argmax(v, i);
    // Keep the slots until every warp has read them, so the block can reduce again.
    sync_threads();
    best
}

/// `block_best` of `x[..n]`: (largest value, its first index), or index `u32::MAX` if all NaN.
fn scan_best(x: *const f32, n: u32) -> (f32, u32) {
    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    let mut i = thread();
    while i < n {
        let v = unsafe { *x.add(i as usize) };
        if better(v, i, bv, bi) {
            bv = v;
            bi = i;
        }
        i += block_dim();
    }
    block_best(bv, bi)
}

/// Step 1: every distinct id below `n` of `recent[..window]` gets its logit divided by
/// `penalty` if it is >= 0, multiplied if negative. An id repeated in the window is penalised
/// once: the thread that first sets its bit in a shared bitmap of `n` bits does it.
fn repeat_penalty(logits: *mut f32, n: u32, recent: *const u32, window: u32, penalty: f32) {
    let (t, bd) = (thread(), block_dim());
    let bits = shared::<u32>();
    let mut w = t;
    while w < n.div_ceil(32) {
        unsafe { *bits.add(w as usize) = 0 };
        w += bd;
    }
    sync_threads();
    let mut j = t;
    while j < window {
        let id = unsafe { *recent.add(j as usize) };
        if id < n {
            let bit = 1 << (id % 32);
            // SAFETY: the word is in the block's shared memory, aligned, only used atomically here.
            let word = unsafe { AtomicU32::from_ptr(bits.add(id as usize / 32)) };
            if word.fetch_or(bit, Relaxed) & bit == 0 {
                let l = unsafe { &mut *logits.add(id as usize) };
                *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
            }
        }
        j += bd;
    }
    // The penalised logits are read by other threads next and the bitmap's words get reused.
    sync_threads();
}

/// A u32 that orders the logits as `better` does: NaN and -inf give 0 (never candidates, as
/// on the CPU), the rest 1 and up, with -0 equal to +0.
fn key(v: f32) -> u32 {
    if v.is_nan() || v == f32::NEG_INFINITY {
        return 0;
    }
    let b = (v + 0.0).to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// Step 3's threshold by radix select over the keys, 11 + 11 + 10 bits: the key of the k-th
/// best logit and how many logits with that key belong to the top k (those with higher keys
/// all do). `(0, 0)` when fewer than `k` logits are valid: then all of them are in.
fn kth_key(logits: *const f32, n: u32, k: u32) -> (u32, u32) {
    let sh = shared::<u32>();
    let (t, bd) = (thread(), block_dim());
    let (lane, warp, warps) = (t % WARP, t / WARP, bd / WARP);
    let var = |slot: usize| unsafe { sh.add(VARS + slot) };
    let hist = |bin: u32| unsafe { sh.add(HIST + bin as usize) };
    // The keys that agree with the digits found so far (`key & mask == prefix`) are counted by
    // their next digit; `rem` is how many of the top k are still to be found among them.
    let (mut prefix, mut mask, mut rem) = (0u32, 0u32, k);
    // The digits are bits [21, 32), [10, 21) and [0, 10); `top` is where the next one ends.
    let mut top = 32;
    while top > 0 {
        let width = if top > 10 { 11 } else { 10 };
        let shift = top - width;
        let digit_mask = (1u32 << width) - 1;
        let mut b = t;
        while b < BINS {
            unsafe { *hist(b) = 0 };
            b += bd;
        }
        if t == 0 {
            unsafe { *var(DIGIT) = NONE };
        }
        sync_threads();
        let mut i = t;
        while i < n {
            let key = key(unsafe { *logits.add(i as usize) });
            if key != 0 && key & mask == prefix {
                // SAFETY: a shared word, only used atomically in this loop.
                let bin = unsafe { AtomicU32::from_ptr(hist((key >> shift) & digit_mask)) };
                bin.fetch_add(1, Relaxed);
            }
            i += bd;
        }
        sync_threads();
        // This thread's bins are [lo, lo + per); `above` counts the keys in all higher bins.
        let per = BINS / bd;
        let lo = t * per;
        let mut own = 0;
        for b in lo..lo + per {
            own += unsafe { *hist(b) };
        }
        let mut above = own;
        let mut delta = 1;
        while delta < WARP {
            let o = unsafe { shfl_down_i32(0xffff_ffff, above as i32, delta, 0x1f) } as u32;
            if lane + delta < WARP {
                above += o;
            }
            delta *= 2;
        }
        if lane == 0 {
            unsafe { *sh.add(WARP_COUNTS + warp as usize) = above };
        }
        sync_threads();
        for w in warp + 1..warps {
            above += unsafe { *sh.add(WARP_COUNTS + w as usize) };
        }
        above -= own;
        // The one thread whose bins hold the rem-th best key finds its bin, from the top.
        if above < rem && rem <= above + own {
            let mut b = lo + per;
            loop {
                b -= 1;
                let c = unsafe { *hist(b) };
                if rem <= above + c {
                    unsafe {
                        *var(DIGIT) = b;
                        *var(REMAINING) = rem - above;
                    }
                    break;
                }
                above += c;
            }
        }
        sync_threads();
        let digit = unsafe { *var(DIGIT) };
        if digit == NONE {
            // Only on the first pass, when fewer than k keys are valid.
            return (0, 0);
        }
        prefix |= digit << shift;
        mask |= digit_mask << shift;
        rem = unsafe { *var(REMAINING) };
        // Everyone has read the slots before the next pass resets them.
        sync_threads();
        top = shift;
    }
    (prefix, rem)
}

/// Step 3's candidates (logit, id) into shared memory, in no particular order: every logit
/// with a key above `kth` and the `need_eq` lowest ids with key `kth` (the CPU's tie rule).
/// Returns their number.
fn gather(logits: *const f32, n: u32, kth: u32, need_eq: u32) -> u32 {
    let sh = shared::<u32>();
    let (t, bd) = (thread(), block_dim());
    let (lane, warp, warps) = (t % WARP, t / WARP, bd / WARP);
    let count = unsafe { sh.add(VARS + COUNT) };
    if t == 0 {
        unsafe { *count = 0 };
    }
    sync_threads();
    let push = |v: f32, i: u32| {
        // SAFETY: a shared word, only used atomically until the sync at the end.
        let slot = unsafe { AtomicU32::from_ptr(count) }.fetch_add(1, Relaxed);
        if slot < MAX_K {
            unsafe {
                *(sh.add(CAND_V + slot as usize) as *mut f32) = v;
                *sh.add(CAND_I + slot as usize) = i;
            }
        }
    };
    // Ids with key `kth` are ranked in id order: block by block, by the warps' counts and
    // each lane's place in its warp. `taken` is the same in every thread.
    let mut taken = 0;
    let mut base = 0;
    while base < n {
        let i = base + t;
        let v = if i < n {
            unsafe { *logits.add(i as usize) }
        } else {
            f32::NAN
        };
        let key = key(v);
        if key > kth {
            push(v, i);
        }
        if taken < need_eq {
            let eq = key == kth;
            let votes = unsafe { ballot(0xffff_ffff, eq) };
            if lane == 0 {
                unsafe { *sh.add(WARP_COUNTS + warp as usize) = votes.count_ones() };
            }
            sync_threads();
            let (mut before, mut all) = (0, 0);
            for w in 0..warps {
                let c = unsafe { *sh.add(WARP_COUNTS + w as usize) };
                before += if w < warp { c } else { 0 };
                all += c;
            }
            let rank = taken + before + (votes & ((1 << lane) - 1)).count_ones();
            if eq && rank < need_eq {
                push(v, i);
            }
            taken += all;
            // The counts are rewritten for the next block of ids.
            sync_threads();
        }
        base += bd;
    }
    sync_threads();
    unsafe { *count }.min(MAX_K)
}

/// Sorts the first `len` (a power of two, at most 1024) candidates best first by `better`:
/// a bitonic sort, each compare-exchange by one thread.
fn sort(cv: *mut f32, ci: *mut u32, len: u32) {
    let mut size = 2;
    while size <= len {
        let mut stride = size / 2;
        while stride > 0 {
            let mut c = thread();
            while c < len / 2 {
                let i = (c / stride) * 2 * stride + c % stride;
                let j = i + stride;
                unsafe {
                    let (vi, ii) = (*cv.add(i as usize), *ci.add(i as usize));
                    let (vj, ij) = (*cv.add(j as usize), *ci.add(j as usize));
                    // Best first within blocks of `size` whose bit `size` is clear, the
                    // opposite in the others; the last round (`size == len`) is all best first.
                    let swap = if i & size == 0 {
                        better(vj, ij, vi, ii)
                    } else {
                        better(vi, ii, vj, ij)
                    };
                    if swap {
                        *cv.add(i as usize) = vj;
                        *ci.add(i as usize) = ij;
                        *cv.add(j as usize) = vi;
                        *ci.add(j as usize) = ii;
                    }
                }
                c += block_dim();
            }
            sync_threads();
            stride /= 2;
        }
        size *= 2;
    }
}

/// e^x through `ex2.approx` on x * log2(e): relative error about 2^-22 plus |x| * 2^-24 from
/// rounding the product (3e-6 at x = -50).
fn exp(x: f32) -> f32 {
    unsafe { ex2(x * core::f32::consts::LOG2_E) }
}

/// `orcd::sampling::uniform`, bit for bit: SplitMix64 output number `step` of `seed`, top 24
/// bits as a float in [0, 1).
fn uniform(seed: u64, step: u64) -> f32 {
    let mut z = seed.wrapping_add(step.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / 16_777_216.0
}

/// The end of a greedy decode step whose token the output projection's fused arg-max already
/// put in `out[0]` (no pass over the logits here): as `sample_dev` ends, the token goes to
/// `tokens[pos[0] + 1]` (not past `n_tokens`), then `pos[0]` and `step[0]` advance by one.
/// An arg-max over all-NaN logits (`u32::MAX`) becomes token 0, as the CPU sampler picks.
/// Grid: one block; block: one thread.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn advance(
    out: *mut u32,
    tokens: *mut u32,
    n_tokens: u32,
    pos: *mut u32,
    step: *mut u64,
) {
    unsafe {
        let p0 = *pos;
        let token = if *out == u32::MAX { 0 } else { *out };
        *out = token;
        if p0 + 1 < n_tokens {
            *tokens.add(p0 as usize + 1) = token;
        }
        *pos = p0 + 1;
        *step += 1;
    }
}
