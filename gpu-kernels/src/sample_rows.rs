//! Batched sampling: one block per row of logits, each row with its own parameters, as
//! `orcd::sampling::sample` picks (its twin) but for last-bit differences at a boundary.
//!
//! Every step of the CPU's pipeline (top-k, then top-p over the softmax of what is left, then
//! min-p, then the draw) keeps a prefix of the candidates in their order (higher logit first,
//! then lower id). So a step here is a search for where its prefix ends: the largest key at
//! which the candidates' running count or weight reaches the step's target, then the id among
//! that key's ties. No sort: any top-k, top-k off included, in fixed shared memory.
//!
//! A search pass sums the candidates at `PROBES` keys at once, each sum as a block-wide sum of
//! each thread's own candidates in id order, so the sum at a key has the same bits whichever
//! pass takes it. Those sums only grow as the key falls, so the largest key that reaches a
//! target is one key, however the search gets there. A top-k of up to `MAX_K` is gathered into
//! shared memory first, and the later steps read it there instead of the row.
//!
//! A greedy row (temperature 0 or top-k 1) is an arg-max, split over the grid's y when rows
//! are few: each block takes a slice and the last one to finish writes the token.
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::sampling::{best_key, block_best, gather, key, kth_key, uniform};
use crate::util::{
    WARP, better, block, block_dim, block_sum, count_last, exp, load_early, shared, sync_threads,
    thread, warp_sum,
};

use kernel_abi::sampling::{CAND_I, CAND_V, MAX_K, PROBE_SUMS, PROBES, ROW_PARAM_WORDS};

use crate::params::SampleRows;

/// The key of the lowest finite logit: -inf (and NaN, key 0) are never candidates.
const KEY_MIN: u32 = 0x0080_0000;

const _: () = assert!(PROBES == 16, "each_probe! writes out 16 probes");

/// `for $j in 0..PROBES { $body }` written out, so that every index into a probe array is a
/// constant and the arrays stay in registers.
macro_rules! each_probe {
    ($j:ident => $body:block) => {
        each_probe!(@ $j, $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $j:ident, $body:block; $($k:literal)*) => {
        $({
            let $j: usize = $k;
            $body
        })*
    };
}

/// The candidates left by the steps so far: the prefix of an order that ends at the logit of
/// key `k` and id `i` (keys above `k`, and ids up to `i` of key `k`).
#[derive(Clone, Copy)]
struct Prefix {
    k: u32,
    i: u32,
}

/// Every candidate.
const ALL: Prefix = Prefix { k: 0, i: 0 };

/// Which order a step cuts: top-k ranks the logits themselves, the later steps (as the CPU's
/// `head_until`) their scaled values `(l - max) / T`, whose f32 rounding can tie two logits
/// that differ, the lower id first.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    Logits,
    Scaled,
}

/// Where a step's prefix ends: where the running count reaches a number, or where the running
/// weight reaches a share of the candidates' total weight.
#[derive(Clone, Copy)]
enum Target {
    Count(f32),
    Share(f32),
}

/// `f(x[i], i)` for this thread's `i` of `lo..hi` (`lo + thread, + blockDim, ...`) in order,
/// four loads in flight at a time.
#[inline(always)]
fn scan(x: *const f32, lo: u32, hi: u32, mut f: impl FnMut(f32, u32)) {
    let bd = block_dim();
    let mut i = lo + thread();
    while i + 3 * bd < hi {
        // Loads that LLVM cannot sink past the branches of `f`.
        let at = |k: u32| load_early(x.wrapping_add((i + k * bd) as usize));
        let v = [at(0), at(1), at(2), at(3)];
        f(v[0], i);
        f(v[1], i + bd);
        f(v[2], i + 2 * bd);
        f(v[3], i + 3 * bd);
        i += 4 * bd;
    }
    while i < hi {
        f(unsafe { *x.add(i as usize) }, i);
        i += bd;
    }
}

struct Row {
    x: *const f32,
    n: u32,
    /// The candidates gathered into shared memory (values `CAND_V`, ids `CAND_I`, in id
    /// order), if the row's top-k is there: then passes read those, not `x`.
    listed: Option<u32>,
    /// The largest logit: scaled value 0, weight 1.
    max: f32,
    temperature: f32,
    /// What top-k kept, in the order of the logits.
    top: Prefix,
    /// Weights below it are not candidates (only in the draw, as the CPU applies min-p last).
    floor: f32,
}

impl Row {
    /// The CPU's `(l - max) / T`: the softmax's input, and the order after top-k.
    #[inline(always)]
    fn scaled(&self, l: f32) -> f32 {
        (l - self.max) / self.temperature
    }

    #[inline(always)]
    fn key(&self, l: f32, order: Order) -> u32 {
        match order {
            Order::Logits => key(l),
            Order::Scaled => key(self.scaled(l)),
        }
    }

    /// Whether `l` (id `i`) is a candidate of `p` in `order` (and of top-k's prefix), with
    /// its weight when it is.
    #[inline(always)]
    fn candidate(&self, l: f32, i: u32, p: Prefix, order: Order) -> Option<(u32, f32)> {
        let in_prefix = |k: u32, p: Prefix| k >= KEY_MIN && (k > p.k || (k == p.k && i <= p.i));
        let k = self.key(l, order);
        let weight = exp(self.scaled(l));
        (in_prefix(key(l), self.top) && in_prefix(k, p) && weight >= self.floor)
            .then_some((k, weight))
    }

    /// `f(l, i)` for this thread's logits in id order: ids `thread, + blockDim, ...` of the
    /// row, or of the listed candidates those with such ids.
    #[inline(always)]
    fn each(&self, mut f: impl FnMut(f32, u32)) {
        let Some(count) = self.listed else {
            return scan(self.x, 0, self.n, f);
        };
        let sh = shared::<u32>();
        let (t, mask) = (thread(), block_dim() - 1);
        for j in 0..count as usize {
            let i = unsafe { *sh.add(CAND_I + j) };
            if i & mask == t {
                f(unsafe { *(sh.add(CAND_V + j) as *const f32) }, i);
            }
        }
    }

    /// The count and weight of the candidates of `p` at or past each probe `(t, last)` in
    /// `order`: those whose key is above `t` or is `t` with an id up to `last`. Each sum is
    /// `block_sum`'s of each thread's own candidates added in id order.
    #[inline(always)]
    fn sums(&self, p: Prefix, order: Order, probes: &[(u32, u32); PROBES]) -> [(f32, f32); PROBES] {
        let (mut count, mut weight) = ([0.0f32; PROBES], [0.0f32; PROBES]);
        self.each(|l, i| {
            if let Some((k, w)) = self.candidate(l, i, p, order) {
                each_probe!(j => {
                    let (t, last) = probes[j];
                    if k > t || (k == t && i <= last) {
                        count[j] += 1.0;
                        weight[j] += w;
                    }
                });
            }
        });
        block_sums(count, weight)
    }

    /// The count of `p`'s candidates of key `k` or above, of those above it, and the smallest
    /// id of those of key `k`.
    #[inline(always)]
    fn at_key(&self, p: Prefix, order: Order, k: u32) -> (f32, f32, u32) {
        let (mut at_or_above, mut above, mut first) = (0.0f32, 0.0f32, u32::MAX);
        self.each(|l, i| {
            if let Some((kl, _)) = self.candidate(l, i, p, order) {
                at_or_above += (kl >= k) as u32 as f32;
                above += (kl > k) as u32 as f32;
                if kl == k && first == u32::MAX {
                    first = i;
                }
            }
        });
        let v = if first == u32::MAX {
            f32::NEG_INFINITY
        } else {
            0.0
        };
        (
            block_sum(at_or_above),
            block_sum(above),
            block_best(v, first).1,
        )
    }

    /// The prefix of `p`'s candidates in `order` that ends at the first one at which their
    /// running count or weight reaches `target`.
    #[inline(always)]
    fn cut(&self, p: Prefix, order: Order, target: Target) -> Prefix {
        let of = |s: (f32, f32)| match target {
            Target::Count(_) => s.0,
            Target::Share(_) => s.1,
        };
        // The largest key whose candidates at or above it reach the goal. Probe 0 is at the
        // range's low end: in the first pass its sum is the total that a share is of.
        let (mut lo, mut hi) = (KEY_MIN, self.key(self.max, order));
        let mut total = None;
        let goal = loop {
            let span = (hi - lo) as u64;
            let mut probes = [(lo, u32::MAX); PROBES];
            each_probe!(j => {
                probes[j].0 = lo + (span * j as u64).div_ceil(PROBES as u64) as u32;
            });
            let s = self.sums(p, order, &probes);
            let total = *total.get_or_insert(s[0].1);
            let goal = match target {
                Target::Count(c) => c,
                Target::Share(share) => share * total,
            };
            // Probes reach the goal up to some one and no further.
            let mut next = lo;
            each_probe!(j => {
                if of(s[j]) >= goal {
                    next = probes[j].0;
                }
            });
            let mut above = hi;
            each_probe!(j => {
                if of(s[j]) < goal && probes[j].0 > next {
                    above = above.min(probes[j].0 - 1);
                }
            });
            (lo, hi) = (next, above);
            if lo >= hi {
                break goal;
            }
        };
        // Which of that key's ties (in id order) reaches it: the one tie, or the smallest id
        // at which the goal is reached with at least one of the ties in.
        let (at_or_above, above, first) = self.at_key(p, order, lo);
        if at_or_above - above == 1.0 {
            return Prefix { k: lo, i: first };
        }
        let (mut a, mut b) = (0u32, self.n - 1);
        while a < b {
            let span = (b - a) as u64;
            let mut probes = [(lo, a); PROBES];
            each_probe!(j => {
                probes[j].1 = a + (span * j as u64 / PROBES as u64) as u32;
            });
            let s = self.sums(p, order, &probes);
            // Probes fail up to some one and hold from there: the answer is past the last
            // that fails and at most the first that holds.
            let (mut from, mut to) = (a, b);
            each_probe!(j => {
                if s[j].0 > above && of(s[j]) >= goal {
                    to = to.min(probes[j].1);
                } else {
                    from = probes[j].1 + 1;
                }
            });
            (a, b) = (from, to);
        }
        Prefix { k: lo, i: a }
    }
}

/// `block_sum` of each of the counts and weights, in one meeting of the warps.
#[inline(always)]
fn block_sums(count: [f32; PROBES], weight: [f32; PROBES]) -> [(f32, f32); PROBES] {
    let sh = shared::<f32>();
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let slot = |j: usize, w: u32| unsafe { sh.add(PROBE_SUMS + j * WARP as usize + w as usize) };
    each_probe!(j => {
        let (c, w) = (warp_sum(count[j]), warp_sum(weight[j]));
        if lane == 0 {
            unsafe {
                *slot(j, warp) = c;
                *slot(PROBES + j, warp) = w;
            }
        }
    });
    sync_threads();
    let read = |j: usize| {
        if lane < warps {
            unsafe { *slot(j, lane) }
        } else {
            0.0
        }
    };
    let mut sums = [(0.0, 0.0); PROBES];
    each_probe!(j => {
        sums[j] = (warp_sum(read(j)), warp_sum(read(PROBES + j)));
    });
    // Keep the slots until every warp has read them, so the block can sum again.
    sync_threads();
    sums
}

/// Per row `r` (the grid's x) of `logits = [rows, n]`: the penalties `pen_*[first..first +
/// count]` (distinct ids: the logit is divided by `pen_scale` if >= 0, else multiplied, then
/// `pen_sub` subtracted), then the next token into `out[r]` as `sampling::sample` picks it with
/// the row's `params[PARAM_WORDS * r..]` (temperature 0: the arg-max). Logits are penalised in
/// place. A greedy row's slices (grid y) meet in `scratch[2r]` (their best, as `best_key`) and
/// `scratch[2r + 1]` (a count). Grid: (rows, slices); block: a power of two from 64 to 512
/// threads; shared: `SAMPLE_ROWS_SHARED_WORDS` words.
#[inline(always)]
pub(crate) unsafe fn sample_rows(p: SampleRows) {
    let SampleRows {
        out,
        logits,
        n,
        params,
        pen_ids,
        pen_scale,
        pen_sub,
        scratch,
    } = p;
    let r = block() as usize;
    let (slice, slices) = unsafe {
        (
            core::arch::nvptx::_block_idx_y() as u32,
            core::arch::nvptx::_grid_dim_y() as u32,
        )
    };
    let x = unsafe { logits.add(r * n as usize) };
    let w = |i: usize| unsafe { *params.add(ROW_PARAM_WORDS * r + i) };
    let (temperature, top_k, top_p, min_p) = (
        f32::from_bits(w(0)),
        w(1),
        f32::from_bits(w(2)),
        f32::from_bits(w(3)),
    );
    let seed = w(4) as u64 | (w(5) as u64) << 32;
    let draw = w(6) as u64 | (w(7) as u64) << 32;
    let (first, count) = (w(8) as usize, w(9) as usize);
    // Top-k 1 keeps the best logit alone, whatever the temperature: an arg-max too.
    let greedy = temperature == 0.0 || top_k == 1;
    if !greedy && slice > 0 {
        return;
    }
    // A greedy block's slice of the row, else all of it.
    let (lo, hi) = if greedy {
        let len = n.div_ceil(slices);
        ((slice * len).min(n), ((slice + 1) * len).min(n))
    } else {
        (0, n)
    };

    let mut i = thread() as usize;
    while i < count {
        let (id, scale, sub) = unsafe {
            (
                *pen_ids.add(first + i),
                *pen_scale.add(first + i),
                *pen_sub.add(first + i),
            )
        };
        if lo <= id && id < hi {
            let l = unsafe { x.add(id as usize) };
            let v = unsafe { *l };
            let v = if scale == 1.0 {
                v
            } else if v < 0.0 {
                v * scale
            } else {
                v / scale
            };
            unsafe { *l = v - sub };
        }
        i += block_dim() as usize;
    }
    // The penalised logits are read by every thread next.
    sync_threads();

    let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
    scan(x, lo, hi, |v, i| {
        if better(v, i, bv, bi) {
            (bv, bi) = (v, i);
        }
    });
    let (max, best) = block_best(bv, bi);
    if greedy {
        if thread() != 0 {
            return;
        }
        let best = if slices == 1 {
            if best == u32::MAX {
                0
            } else {
                best_key(max, best)
            }
        } else {
            // SAFETY: the row's two scratch words are only used atomically while this launch
            // runs; the count releases this block's best and acquires the others'.
            let key = unsafe { AtomicU64::from_ptr(scratch.add(2 * r)) };
            if best != u32::MAX {
                key.fetch_max(best_key(max, best), Relaxed);
            }
            if !unsafe { count_last(scratch.add(2 * r + 1) as *mut u32, slices) } {
                return;
            }
            key.swap(0, Relaxed)
        };
        // Nothing at all (every logit NaN), or for top-k 1 nothing above -inf: token 0.
        let token = if best == 0 || (temperature != 0.0 && ((best >> 32) as u32) < KEY_MIN) {
            0
        } else {
            !(best as u32)
        };
        unsafe { *out.add(r) = token };
        return;
    }

    let token = if key(max) < KEY_MIN {
        // Nothing beats -inf: no candidate.
        0
    } else {
        let mut row = Row {
            x,
            n,
            listed: None,
            max,
            temperature,
            top: ALL,
            floor: 0.0,
        };
        if 0 < top_k && top_k <= MAX_K {
            // The top k (or every logit but NaN, if fewer) in id order, into shared memory:
            // the candidates beyond are never read again.
            let sh = shared::<u32>();
            let value = |j: u32| unsafe { *x.add(j as usize) };
            let (cv, ci) = unsafe { (sh.add(CAND_V) as *mut f32, sh.add(CAND_I)) };
            let found = kth_key(&value, n, top_k);
            row.listed = Some(gather(&value, &|j| j, n, found, cv, ci, MAX_K));
        } else if top_k > 0 {
            let probes = [(KEY_MIN, u32::MAX); PROBES];
            if row.sums(ALL, Order::Logits, &probes)[0].0 > top_k as f32 {
                row.top = row.cut(ALL, Order::Logits, Target::Count(top_k as f32));
            }
        }
        let mut p = ALL;
        if top_p < 1.0 {
            p = row.cut(p, Order::Scaled, Target::Share(top_p));
        }
        // min-p keeps the weights of at least min_p times the largest (1).
        row.floor = min_p;
        row.cut(p, Order::Scaled, Target::Share(uniform(seed, draw)))
            .i
    };
    if thread() == 0 {
        unsafe { *out.add(r) = token };
    }
}
