//! Batched sampling: one block per row of logits, each row with its own parameters, as
//! `orcd::sampling::sample` picks (its twin) but for last-bit differences at a boundary.
//!
//! Every step of the CPU's pipeline (top-k, then top-p over the softmax of what is left, then
//! min-p, then the draw) keeps a prefix of the candidates in their order (higher logit first,
//! then lower id). So a step here is a search for where its prefix ends: the largest key at
//! which the candidates' running count or weight reaches the step's target, found by bisection
//! over the keys with one block-wide sum a probe, then the id among that key's ties. No sort
//! and no candidate list: any top-k, top-k off included, in fixed shared memory.
use crate::sampling::{block_best, key, scan_best, uniform};
use crate::util::{block, block_dim, block_sum, exp, sync_threads, thread};

use kernel_abi::sampling::ROW_PARAM_WORDS as PARAM_WORDS;

use crate::params::SampleRows;

/// The key of the lowest finite logit: -inf (and NaN, key 0) are never candidates.
const KEY_MIN: u32 = 0x0080_0000;

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

struct Row {
    x: *const f32,
    n: u32,
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

    /// The count and weight of the candidates of `p` whose key is at least `t` and, if their
    /// key is `t`, whose id is at most `last` (all of them with `last = u32::MAX`).
    #[inline(always)]
    fn sum(&self, p: Prefix, order: Order, t: u32, last: u32) -> (f32, f32) {
        let (mut count, mut weight) = (0.0f32, 0.0f32);
        let mut i = thread();
        while i < self.n {
            let l = unsafe { *self.x.add(i as usize) };
            if let Some((k, w)) = self.candidate(l, i, p, order)
                && k >= t
                && (k > t || i <= last)
            {
                count += 1.0;
                weight += w;
            }
            i += block_dim();
        }
        (block_sum(count), block_sum(weight))
    }

    /// The smallest id of `p`'s candidates of key `k`.
    #[inline(always)]
    fn first_id(&self, p: Prefix, order: Order, k: u32) -> u32 {
        let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX);
        let mut i = thread();
        while i < self.n {
            let l = unsafe { *self.x.add(i as usize) };
            if bi == u32::MAX && self.candidate(l, i, p, order).is_some_and(|c| c.0 == k) {
                (bv, bi) = (0.0, i);
            }
            i += block_dim();
        }
        block_best(bv, bi).1
    }

    /// The prefix of `p`'s candidates in `order` that ends at the first one at which their
    /// running count (`by_count`) or weight reaches `target`.
    #[inline(always)]
    fn cut(&self, p: Prefix, order: Order, target: f32, by_count: bool) -> Prefix {
        let reached = |s: (f32, f32)| (if by_count { s.0 } else { s.1 }) >= target;
        // The largest key whose candidates at or above it reach the target.
        let (mut lo, mut hi) = (KEY_MIN, self.key(self.max, order));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if reached(self.sum(p, order, mid, u32::MAX)) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        // Which of that key's ties (in id order) reaches it: the one tie, or the smallest id
        // at which the target is reached with at least one of the ties in.
        let above = self.sum(p, order, lo.saturating_add(1), u32::MAX).0;
        if self.sum(p, order, lo, u32::MAX).0 - above == 1.0 {
            return Prefix {
                k: lo,
                i: self.first_id(p, order, lo),
            };
        }
        let (mut a, mut b) = (0u32, self.n - 1);
        while a < b {
            let mid = a + (b - a) / 2;
            let s = self.sum(p, order, lo, mid);
            if s.0 > above && reached(s) {
                b = mid;
            } else {
                a = mid + 1;
            }
        }
        Prefix { k: lo, i: a }
    }
}

/// Per row `r` (the grid's x) of `logits = [rows, n]`: the penalties `pen_*[first..first +
/// count]` (distinct ids: the logit is divided by `pen_scale` if >= 0, else multiplied, then
/// `pen_sub` subtracted), then the next token into `out[r]` as `sampling::sample` picks it with
/// the row's `params[PARAM_WORDS * r..]` (temperature 0: the arg-max). Logits are penalised in
/// place. Grid: one block per row; block: a multiple of 32 threads, at most 512; shared:
/// 32 f32 + 32 u32.
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
    } = p;
    let r = block() as usize;
    let x = unsafe { logits.add(r * n as usize) };
    let w = |i: usize| unsafe { *params.add(PARAM_WORDS * r + i) };
    let (temperature, top_k, top_p, min_p) = (
        f32::from_bits(w(0)),
        w(1),
        f32::from_bits(w(2)),
        f32::from_bits(w(3)),
    );
    let seed = w(4) as u64 | (w(5) as u64) << 32;
    let draw = w(6) as u64 | (w(7) as u64) << 32;
    let (first, count) = (w(8) as usize, w(9) as usize);

    let mut i = thread() as usize;
    while i < count {
        let (id, scale, sub) = unsafe {
            (
                *pen_ids.add(first + i),
                *pen_scale.add(first + i),
                *pen_sub.add(first + i),
            )
        };
        if id < n {
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

    let (max, best) = scan_best(x, n);
    let token = if temperature == 0.0 {
        if best == u32::MAX { 0 } else { best }
    } else if key(max) < KEY_MIN {
        // Nothing beats -inf: no candidate.
        0
    } else {
        let mut row = Row {
            x,
            n,
            max,
            temperature,
            top: ALL,
            floor: 0.0,
        };
        if top_k > 0 && row.sum(ALL, Order::Logits, KEY_MIN, u32::MAX).0 > top_k as f32 {
            row.top = row.cut(ALL, Order::Logits, top_k as f32, true);
        }
        let mut p = ALL;
        if top_p < 1.0 {
            let z = row.sum(p, Order::Scaled, KEY_MIN, u32::MAX).1;
            p = row.cut(p, Order::Scaled, top_p * z, false);
        }
        // min-p keeps the weights of at least min_p times the largest (1).
        row.floor = min_p;
        let total = row.sum(p, Order::Scaled, KEY_MIN, u32::MAX).1;
        row.cut(p, Order::Scaled, uniform(seed, draw) * total, false)
            .i
    };
    if thread() == 0 {
        unsafe { *out.add(r) = token };
    }
}
