//! Token choice on the GPU, so that only the chosen id crosses to the host.
//! CPU twins: `orcd::cpu::argmax` and `orcd::sampling::sample` (same steps, same order, same
//! tie rule: a higher value, then a lower id).
//!
//! The sampler is two kernels. `sample_candidates` cuts the vocabulary into slices, one block
//! each: a block applies the repetition penalty to its slice and keeps the slice's top k. Every
//! token of the top k of all is in the top k of its slice (fewer than k of its slice beat it),
//! so `sample` (or `sample_dev`), one block, finds the same top k among those candidates and
//! ends the steps there: softmax, sort, top-p, min-p and the draw.
use core::sync::atomic::{AtomicU32, Ordering::Relaxed};

// The most candidates top-k keeps (`MAX_K`), and the layout of the shared memory, in 4-byte
// words: [0, 64) block reductions (`block_sum`, `block_best`), then scalars passed between
// threads (`VARS`), two sets of per-warp counts (`WARP_COUNTS`), the radix histogram (`HIST`,
// `BINS`) and (in `sample` only) the candidates (value, id: `CAND_V`, `CAND_I`). The host sizes
// the shared memory from the same layout.
use kernel_abi::sampling::{BINS, CAND_I, CAND_V, HIST, MAX_K, VARS, WARP_COUNTS};

use crate::params::{Argmax, Sample, SampleCandidates, SampleDev};
use crate::util::{
    WARP, ballot, better, block, block_dim, block_sum, from_lane, shared, sync_threads, thread,
    warp_argmax,
};

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.up.i32"]
    fn shfl_up_i32(mask: u32, v: i32, delta: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.ex2.approx.f"]
    fn ex2(x: f32) -> f32;
}

/// Index of the largest of `n` floats; the first index wins on ties, NaN never wins
/// (all NaN gives `u32::MAX`). Grid: one block; block: a multiple of 32 threads, at most 1024;
/// shared: 32 f32 + 32 u32.
#[inline(always)]
pub(crate) unsafe fn argmax(p: Argmax) {
    let Argmax { out, x, n } = p;
    let (_, i) = scan_best(x, n);
    if thread() == 0 {
        unsafe { *out = i };
    }
}

/// Slots in VARS.
const DIGIT: usize = 0;
const REMAINING: usize = 1;
const WHOLE: usize = 2;
const NONE: u32 = u32::MAX;

/// Steps 1 and 3 of `orcd::sampling::sample` for one slice of the logits per block: block `b`
/// takes the logits `[b * slice, (b + 1) * slice)` (those below `n`), divides or multiplies
/// (the penalty, in place) those of the distinct ids in the window, and writes the slice's top
/// `k` (value, id), in id order, to `cand_v`/`cand_i[b * cap ..][..cap]`, NaN and id
/// `u32::MAX` in the slots left over (`cap >= min(k, slice)`). NaN is never a candidate;
/// -inf ranks below every finite logit (see `key`). The tokens so far are `tokens[..n_tokens]`, or `tokens[..=pos[0]]` if `pos` is
/// not null (then `pos[0] >= n_tokens` traps); the window is the last `last_n` of them.
/// Grid: `ceil(n / slice)` blocks or more; block: a power of two from 64 to 1024 threads;
/// shared: 4 * max(2208, ceil(slice / 32)) bytes.
#[inline(always)]
pub(crate) unsafe fn sample_candidates(p: SampleCandidates) {
    let SampleCandidates {
        cand_v,
        cand_i,
        cap,
        logits,
        n,
        slice,
        tokens,
        n_tokens,
        pos,
        last_n,
        penalty,
        k,
    } = p;
    let end = if pos.is_null() {
        n_tokens
    } else {
        let p0 = unsafe { *pos };
        if p0 >= n_tokens {
            unsafe { core::arch::nvptx::trap() };
        }
        p0 + 1
    };
    let window = end.min(last_n);
    let recent = unsafe { tokens.add((end - window) as usize) };
    let lo = block() * slice;
    let len = slice.min(n.saturating_sub(lo));
    // Not read past `len`, which is 0 for a block past the end.
    let x = logits.wrapping_add(lo as usize);
    if penalty != 1.0 && window > 0 {
        repeat_penalty(x, lo, len, recent, window, penalty);
    }
    let value = |j: u32| unsafe { *x.add(j as usize) };
    let id = |j: u32| lo + j;
    let out_v = cand_v.wrapping_add((block() * cap) as usize);
    let out_i = cand_i.wrapping_add((block() * cap) as usize);
    let count = gather(&value, &id, len, kth_key(&value, len, k), out_v, out_i, cap);
    let mut j = count + thread();
    while j < cap {
        unsafe {
            *out_v.add(j as usize) = f32::NAN;
            *out_i.add(j as usize) = u32::MAX;
        }
        j += block_dim();
    }
}

/// The next token into `out[0]`, as `orcd::sampling::sample` picks it from the logits whose
/// `sample_candidates` are `cand_v`/`cand_i[..slots]` (its grid times its `cap`), for the same
/// `k`, and the draw `uniform(seed, step)`. `temperature` 0 is greedy: `k` must be 1 then;
/// otherwise `k` is `top_k`, in 1..=1024.
/// Grid: one block; block: a power of two from 64 to 1024 threads; shared: 4 * 4256 bytes.
#[inline(always)]
pub(crate) unsafe fn sample(p: Sample) {
    let Sample {
        out,
        cand_v,
        cand_i,
        slots,
        k,
        temperature,
        top_p,
        min_p,
        seed,
        step,
    } = p;
    let token = choose(
        cand_v,
        cand_i,
        slots,
        k,
        temperature,
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
/// CUDA graph replays it, after `sample_candidates` with the same `tokens`, `n_tokens` and
/// `pos`: the draw is `uniform(seed, step[0])`. The token goes to `out[0]` and to
/// `tokens[pos[0] + 1]` (the next step's input; not written when that is past `n_tokens`, the
/// buffer's length), then `pos[0]` and `step[0]` advance by one. `pos[0] >= n_tokens` traps.
/// Grid, block and shared memory as `sample`.
#[inline(always)]
pub(crate) unsafe fn sample_dev(p: SampleDev) {
    let SampleDev {
        out,
        cand_v,
        cand_i,
        slots,
        k,
        tokens,
        n_tokens,
        pos,
        step,
        temperature,
        top_p,
        min_p,
        seed,
    } = p;
    let (p0, draw) = unsafe { (*pos, *step) };
    if p0 >= n_tokens {
        unsafe { core::arch::nvptx::trap() };
    }
    let token = choose(
        cand_v,
        cand_i,
        slots,
        k,
        temperature,
        top_p,
        min_p,
        seed,
        draw,
    );
    // Every path of `choose` passes a barrier, so all threads have read pos and step.
    if thread() == 0 {
        unsafe { end_step(token, out, tokens, n_tokens, pos, step) };
    }
}

/// The token of `sample`'s steps 3 to 8 on the candidates, valid in thread 0. Every thread of
/// the block calls it.
#[allow(clippy::too_many_arguments)]
fn choose(
    cand_v: *const f32,
    cand_i: *const u32,
    slots: u32,
    k: u32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    seed: u64,
    step: u64,
) -> u32 {
    let (t, bd) = (thread(), block_dim());
    let sh = shared::<u32>();
    let cv = unsafe { sh.add(CAND_V) } as *mut f32;
    let ci = unsafe { sh.add(CAND_I) };
    // Step 3: the top k of the candidates, which are in id order, so that position breaks ties
    // as the id does.
    let value = |j: u32| unsafe { *cand_v.add(j as usize) };
    let id = |j: u32| unsafe { *cand_i.add(j as usize) };
    let count = gather(&value, &id, slots, kth_key(&value, slots, k), cv, ci, MAX_K);
    if count == 0 {
        return 0;
    }
    let at = |j: u32| unsafe { cv.add(j as usize) };

    // Steps 4 and 5: (logit - max) / temperature, the best at exactly 0, then softmax.
    let mut m = f32::NEG_INFINITY;
    let mut j = t;
    while j < count {
        m = m.max(unsafe { *at(j) });
        j += bd;
    }
    let (max, _) = block_best(m, 0);
    // Sampling never draws -inf (the CPU's candidates leave it out): none else, no token;
    // otherwise its weight below is e^-inf = 0.
    if max == f32::NEG_INFINITY && temperature != 0.0 {
        return 0;
    }
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
pub(crate) fn block_best(v: f32, i: u32) -> (f32, u32) {
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
pub(crate) fn scan_best(x: *const f32, n: u32) -> (f32, u32) {
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

/// Step 1 on the slice `x[..len]` of the logits, ids `lo..lo + len`: every distinct one of
/// them in `recent[..window]` gets its logit divided by `penalty` if it is >= 0, multiplied if
/// negative. An id repeated in the window is penalised once: the thread that first sets its
/// bit in a shared bitmap of `len` bits does it.
fn repeat_penalty(x: *mut f32, lo: u32, len: u32, recent: *const u32, window: u32, penalty: f32) {
    let (t, bd) = (thread(), block_dim());
    let bits = shared::<u32>();
    let mut w = t;
    while w < len.div_ceil(32) {
        unsafe { *bits.add(w as usize) = 0 };
        w += bd;
    }
    sync_threads();
    let mut j = t;
    while j < window {
        // Ids below `lo` wrap to large numbers: outside the slice, as those past it are.
        let r = unsafe { *recent.add(j as usize) }.wrapping_sub(lo);
        if r < len {
            let bit = 1 << (r % 32);
            // SAFETY: the word is in the block's shared memory, aligned, only used atomically here.
            let word = unsafe { AtomicU32::from_ptr(bits.add(r as usize / 32)) };
            if word.fetch_or(bit, Relaxed) & bit == 0 {
                let l = unsafe { &mut *x.add(r as usize) };
                *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
            }
        }
        j += bd;
    }
    // The penalised logits are read by other threads next and the bitmap's words get reused.
    sync_threads();
}

/// A u32 that orders the logits as `better` does: NaN gives 0 (never a candidate), the rest
/// 1 and up, -inf lowest (the CPU's greedy arg-max takes it when nothing beats it; sampling
/// gives it weight 0 in `choose`, or no token when nothing beats it), with -0 equal to +0.
pub(crate) fn key(v: f32) -> u32 {
    if v.is_nan() {
        return 0;
    }
    let b = (v + 0.0).to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// A u64 ordered as `better` orders (value, index) pairs: larger values first (-0 equal to
/// +0), then smaller indices; NaN gives 0, below every other key.
#[inline(always)]
pub(crate) fn best_key(v: f32, i: u32) -> u64 {
    if v.is_nan() {
        return 0;
    }
    (key(v) as u64) << 32 | !i as u64
}

/// Which of `value(0..len)` are their top `k` (by `better`, position breaking ties), by radix
/// select over the keys, 11 + 11 + 10 bits: `(prefix, mask, need)` such that the top k are the
/// valid values whose `key & mask` is above `prefix`, then the first `need` by position whose
/// `key & mask` equals it. The select stops at the first digit whose bin holds exactly the
/// values still needed (then all of the bin is in). `(0, 0, u32::MAX)`, all valid values, when
/// fewer than `k` are valid.
pub(crate) fn kth_key(value: &impl Fn(u32) -> f32, len: u32, k: u32) -> (u32, u32, u32) {
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
        while i < len {
            let key = key(value(i));
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
        // This lane's bins and the later lanes' (lane 0: the warp's).
        let upto_own = warp_prefix(own);
        let mut above = from_lane(upto_own, WARP - 1) - upto_own + own;
        if lane == 0 {
            unsafe { *sh.add(WARP_COUNTS + warp as usize) = above };
        }
        sync_threads();
        // Plus the warps after this one: all of them less those up to this one.
        let c = if lane < warps {
            unsafe { *sh.add(WARP_COUNTS + lane as usize) }
        } else {
            0
        };
        let upto = warp_prefix(c);
        above += from_lane(upto, WARP - 1) - from_lane(upto, warp);
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
                        *var(WHOLE) = (rem - above == c) as u32;
                    }
                    break;
                }
                above += c;
            }
        }
        sync_threads();
        let (digit, remaining, whole) = unsafe { (*var(DIGIT), *var(REMAINING), *var(WHOLE)) };
        // Everyone has read the slots before the next pass (or select) writes them.
        sync_threads();
        if digit == NONE {
            // Only on the first pass, when fewer than k keys are valid.
            return (0, 0, u32::MAX);
        }
        prefix |= digit << shift;
        mask |= digit_mask << shift;
        rem = remaining;
        if whole == 1 {
            break;
        }
        top = shift;
    }
    (prefix, mask, rem)
}

/// The top k of `kth_key`'s answer `(prefix, mask, need)` for `value(0..len)`: each one's
/// value and `id(j)` into `out_v`/`out_i[..cap]`, in position order. Returns their number
/// (at most `cap`). Ends with a barrier, so that the block may read them next.
pub(crate) fn gather(
    value: &impl Fn(u32) -> f32,
    id: &impl Fn(u32) -> u32,
    len: u32,
    (prefix, mask, need): (u32, u32, u32),
    out_v: *mut f32,
    out_i: *mut u32,
    cap: u32,
) -> u32 {
    let sh = shared::<u32>();
    let (t, bd) = (thread(), block_dim());
    let (lane, warp, warps) = (t % WARP, t / WARP, bd / WARP);
    let below = (1u32 << lane) - 1;
    // Block by block of positions: each warp counts its values above and at the threshold,
    // then every thread adds up the warps before its own. `written` and `taken` (how many at
    // the threshold came before, kept or not) are the same in every thread. The counts go to
    // two sets of slots in turn: a warp writes a set again only after the barrier of the next
    // block, which every thread passes after reading the set.
    let (mut written, mut taken) = (0u32, 0u32);
    let mut counts = WARP_COUNTS;
    let mut base = 0;
    while base < len {
        let j = base + t;
        let v = if j < len { value(j) } else { f32::NAN };
        let key = key(v);
        let above = key != 0 && key & mask > prefix;
        let at = key != 0 && key & mask == prefix;
        let (above_votes, at_votes) = (ballot(above), ballot(at));
        if lane == 0 {
            let c = above_votes.count_ones() | at_votes.count_ones() << 16;
            unsafe { *sh.add(counts + warp as usize) = c };
        }
        sync_threads();
        // Lane `w` takes warp `w`'s counts: the values at the threshold before that warp, and
        // what it keeps of its own, in position order while fewer than `need` came before.
        let c = if lane < warps {
            unsafe { *sh.add(counts + lane as usize) }
        } else {
            0
        };
        let (c_above, c_at) = (c & 0xffff, c >> 16);
        let at_upto = warp_prefix(c_at);
        let at_before = taken + at_upto - c_at;
        let kept = c_above + c_at.min(need.saturating_sub(at_before));
        let kept_upto = warp_prefix(kept);
        // This warp's share, from its lane of the others' counts.
        let rank = from_lane(at_before, warp) + (at_votes & below).count_ones();
        let keep = above || (at && rank < need);
        let slot =
            written + from_lane(kept_upto - kept, warp) + (ballot(keep) & below).count_ones();
        if keep && slot < cap {
            unsafe {
                *out_v.add(slot as usize) = v;
                *out_i.add(slot as usize) = id(j);
            }
        }
        written += from_lane(kept_upto, WARP - 1);
        taken += from_lane(at_upto, WARP - 1);
        counts = if counts == WARP_COUNTS {
            WARP_COUNTS + 32
        } else {
            WARP_COUNTS
        };
        base += bd;
    }
    sync_threads();
    written.min(cap)
}

/// The sum of `v` over lanes 0 to this one of the warp.
fn warp_prefix(mut v: u32) -> u32 {
    let lane = thread() % WARP;
    let mut delta = 1;
    while delta < WARP {
        let o = unsafe { shfl_up_i32(!0, v as i32, delta, 0) } as u32;
        if lane >= delta {
            v += o;
        }
        delta *= 2;
    }
    v
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
pub(crate) fn uniform(seed: u64, step: u64) -> f32 {
    let mut z = seed.wrapping_add(step.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / 16_777_216.0
}

/// The end of a decode step that chose `token`: it goes to `out[0]` and to `tokens[pos[0] + 1]`
/// (the next step's input, if the buffer holds it), then `pos[0]` and `step[0]` advance by
/// one. `sample` and the output projection's fused arg-max (decode.rs) end with it, on one
/// thread, after every read of `pos` and `step` in their kernel.
#[inline(always)]
pub(crate) unsafe fn end_step(
    token: u32,
    out: *mut u32,
    tokens: *mut u32,
    n_tokens: u32,
    pos: *mut u32,
    step: *mut u64,
) {
    unsafe {
        let p0 = *pos;
        *out = token;
        if p0 + 1 < n_tokens {
            *tokens.add(p0 as usize + 1) = token;
        }
        *pos = p0 + 1;
        *step += 1;
    }
}
