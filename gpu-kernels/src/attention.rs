//! The KV cache and causal grouped-query attention. CPU twin: `orcd::cpu::attention`.
//!
//! Caches are `[max_pos, kv_dim]` row-major with `kv_dim = n_kv * head_dim`; query head `h` reads
//! kv head `h / (n_heads / n_kv)`. The current position `pos[0]` lives in device memory (so a
//! captured CUDA graph replays for any position): every loop over keys takes its bound from it,
//! and no launch size depends on it. A position past the cache's end traps the kernel.
use core::arch::nvptx;
use core::sync::atomic::{AtomicU32, Ordering::Relaxed};

use crate::util::{
    WARP, block, block_dim, exp, shared, sync_threads, thread, threadfence, warp_broadcast,
    warp_max, warp_sum,
};

/// Head dims up to `32 * MAX_DIMS_PER_LANE` = 128: each lane of a warp owns the output dims
/// `lane + 32 * j`.
const MAX_DIMS_PER_LANE: usize = 4;
/// Keys per tile of both attention kernels: one per lane.
const TILE_KEYS: u32 = WARP;
/// Elements of a tile each thread loads before storing any (`stage_tile`).
const STAGE_BATCH: usize = 8;
/// Partials the decode kernel's combine loads before using any.
const COMBINE_BATCH: usize = 8;

/// Copies `k, v = [rows, kv_dim]` into rows `pos[0]..pos[0] + rows` of `k_cache, v_cache =
/// [max_pos, kv_dim]`. Grid: `ceil(rows * kv_dim / blockDim)` blocks; no shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn kv_append(
    k_cache: *mut f32,
    v_cache: *mut f32,
    k: *const f32,
    v: *const f32,
    pos: *const u32,
    rows: u32,
    kv_dim: u32,
    max_pos: u32,
) {
    let p0 = unsafe { *pos };
    if p0 > max_pos - rows {
        unsafe { nvptx::trap() };
    }
    let i = block() as usize * block_dim() as usize + thread() as usize;
    if i >= rows as usize * kv_dim as usize {
        return;
    }
    let at = p0 as usize * kv_dim as usize + i;
    unsafe {
        *k_cache.add(at) = *k.add(i);
        *v_cache.add(at) = *v.add(i);
    }
}

/// Split-K ("flash-decoding") attention of one query row `q = [n_heads * head_dim]` at
/// position `pos[0]` over keys `0..=pos[0]`, into `out = [n_heads * head_dim]`. `scale` =
/// 1/sqrt(head_dim), head_dim <= 128.
///
/// Grid: `(n_kv * ceil(group / warps), splits)` with `group = n_heads / n_kv` and `warps =
/// blockDim / 32`: block `(x, s)` serves up to `warps` query heads of one kv head, one per
/// warp, over slice `s` of the keys, so each K/V row is read once for all of them. Block: a
/// multiple of 32 threads. Shared: `32 * (head_dim + 1) + 32 * head_dim + warps * head_dim + 1`
/// f32. Scratch: `partials = [n_heads, splits, head_dim + 2]` f32 and `counters =
/// [gridDim.x]` u32, zero before the first launch (and left zero by every launch).
///
/// The slices are whole tiles of 32 keys, as few per slice as cover `pos[0] + 1` keys in
/// `splits` slices; all of it follows from `pos[0]` on the device, so the launch does not
/// depend on the position. Blocks past the last key have nothing to do and leave at once.
/// A block runs the prefill kernel's tiled online softmax over its slice (K and V tiles staged
/// in shared memory, lane `i` scores key `i`) and stores each head's partial (max `m`, sum `l`,
/// unnormalised `acc`). The last block of `x` to finish, by an atomic count of the slices in
/// use, combines the partials of its heads into `out` in slice order (so the result does not
/// depend on which block came last) and zeroes the count for the next launch.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn attention_decode(
    out: *mut f32,
    q: *const f32,
    k_cache: *const f32,
    v_cache: *const f32,
    pos: *const u32,
    partials: *mut f32,
    counters: *mut u32,
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    max_pos: u32,
    scale: f32,
) {
    let p0 = unsafe { *pos };
    if p0 >= max_pos {
        unsafe { nvptx::trap() };
    }
    let (splits, split) = unsafe { (nvptx::_grid_dim_y(), nvptx::_block_idx_y()) };
    let n_keys = p0 + 1;
    let chunk = n_keys.div_ceil(splits).next_multiple_of(TILE_KEYS);
    let used = n_keys.div_ceil(chunk);
    // The whole block leaves, before any barrier.
    if split >= used {
        return;
    }
    let first = split * chunk;
    let last = n_keys.min(first + chunk) - 1;

    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let group = n_heads / n_kv;
    let per_kv = group.div_ceil(warps);
    let kvh = block() / per_kv;
    let g = (block() % per_kv) * warps + warp;
    let active = g < group;
    let h = kvh * group + g;
    let hd = head_dim as usize;
    let kv_dim = (n_kv * head_dim) as usize;
    let kv_off = kvh as usize * hd;
    let dim = |j: usize| lane as usize + WARP as usize * j;

    let smem = shared::<f32>();
    let ks = smem; // [TILE_KEYS, hd + 1]
    let vs = unsafe { ks.add(TILE_KEYS as usize * (hd + 1)) }; // [TILE_KEYS, hd]
    let qs = unsafe { vs.add(TILE_KEYS as usize * hd) }; // [warps, hd]
    let is_last = unsafe { qs.add(warps as usize * hd) } as *mut u32;

    let my_q = unsafe { qs.add(warp as usize * hd) };
    let mut d = lane as usize;
    while d < hd {
        unsafe {
            *my_q.add(d) = if active {
                *q.add(h as usize * hd + d)
            } else {
                0.0
            }
        };
        d += WARP as usize;
    }

    let mut run = Running::new();
    let mut k0 = first;
    while k0 <= last {
        stage_tile(
            ks,
            vs,
            k_cache,
            v_cache,
            k0,
            last + 1,
            head_dim,
            kv_dim,
            kv_off,
        );
        sync_threads();
        // Warp-uniform: the shuffles inside see every lane.
        if active {
            run.add_tile(ks, vs, my_q, k0, last, hd, scale);
        }
        // Everyone is done with the tile before the next one overwrites it.
        sync_threads();
        k0 += TILE_KEYS;
    }

    let part = |h: u32, s: u32| unsafe { partials.add((h * splits + s) as usize * (hd + 2)) };
    if active {
        let mine = part(h, split);
        if lane == 0 {
            unsafe { (*mine, *mine.add(1)) = (run.m, run.l) };
        }
        for (j, acc) in run.acc.iter().enumerate() {
            if dim(j) < hd {
                unsafe { *mine.add(2 + dim(j)) = *acc };
            }
        }
    }
    // Release: the partials are visible GPU-wide before the count says so.
    threadfence();
    sync_threads();
    if thread() == 0 {
        // SAFETY: the word is this block row's counter in global memory, only used atomically
        // while blocks of this launch run.
        let count = unsafe { AtomicU32::from_ptr(counters.add(block() as usize)) };
        let done = count.fetch_add(1, Relaxed) + 1 == used;
        if done {
            count.store(0, Relaxed);
            // Acquire: the other blocks' partials are read after their counts.
            threadfence();
        }
        unsafe { *is_last = done as u32 };
    }
    sync_threads();
    if unsafe { *is_last } == 0 || !active {
        return;
    }

    // out = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M) over the used slices (each has
    // at least one key, so every m_s is finite).
    let mut max = f32::NEG_INFINITY;
    let mut s = lane;
    while s < used {
        max = max.max(unsafe { *part(h, s) });
        s += WARP;
    }
    let max = warp_max(max);
    // In rounds of COMBINE_BATCH slices, all loads first; a slice past `used` keeps m = -inf
    // and weighs 0.
    let (mut sum, mut o) = (0.0f32, [0.0f32; MAX_DIMS_PER_LANE]);
    let mut s0 = 0;
    while s0 < used {
        let mut ml = [(f32::NEG_INFINITY, 0.0f32); COMBINE_BATCH];
        let mut a = [[0.0f32; MAX_DIMS_PER_LANE]; COMBINE_BATCH];
        for (b, (ml, a)) in ml.iter_mut().zip(a.iter_mut()).enumerate() {
            if s0 + (b as u32) < used {
                let p = part(h, s0 + b as u32);
                *ml = unsafe { (*p, *p.add(1)) };
                for (j, a) in a.iter_mut().enumerate() {
                    if dim(j) < hd {
                        *a = unsafe { *p.add(2 + dim(j)) };
                    }
                }
            }
        }
        for ((m, l), a) in ml.iter().zip(&a) {
            let f = exp(m - max);
            sum += l * f;
            for (o, a) in o.iter_mut().zip(a) {
                *o += a * f;
            }
        }
        s0 += COMBINE_BATCH as u32;
    }
    let out = unsafe { out.add(h as usize * hd) };
    for (j, o) in o.iter().enumerate() {
        if dim(j) < hd {
            unsafe { *out.add(dim(j)) = o / sum };
        }
    }
}

/// Causal attention of `rows` query rows `q = [rows, n_heads * head_dim]`, row `t` at position
/// `pos[0] + t` over keys `0..=pos[0] + t`, into `out` (same shape), flash-attention style.
/// `scale` = 1/sqrt(head_dim), head_dim <= 128.
/// Grid: `(ceil(rows / (blockDim / 32)), n_heads)`: block `(x, h)` does query head `h` for the
/// rows `x * warps ..`, one row per warp. Block: a multiple of 32 threads.
/// Shared: `32 * (head_dim + 1) + 32 * head_dim + (blockDim / 32) * head_dim` f32.
///
/// The block walks the keys in tiles of 32, staged in shared memory (K rows padded by one so
/// that lane-per-key reads hit distinct banks). Per tile, lane `i` scores key `i` against its
/// warp's row, the warp updates that row's online softmax (max, sum and the per-lane output
/// dims) and skips tiles wholly after the row's position.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn attention_prefill(
    out: *mut f32,
    q: *const f32,
    k_cache: *const f32,
    v_cache: *const f32,
    pos: *const u32,
    rows: u32,
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    max_pos: u32,
    scale: f32,
) {
    let p0 = unsafe { *pos };
    if p0 > max_pos - rows {
        unsafe { nvptx::trap() };
    }
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let h = unsafe { nvptx::_block_idx_y() } as u32;
    let first_row = block() * warps;
    let row = first_row + warp;
    let active = row < rows;
    let hd = head_dim as usize;
    let (q_dim, kv_dim) = ((n_heads * head_dim) as usize, (n_kv * head_dim) as usize);
    let kv_off = (h / (n_heads / n_kv)) as usize * hd;
    let dim = |j: usize| lane as usize + WARP as usize * j;

    let smem = shared::<f32>();
    let ks = smem; // [TILE_KEYS, hd + 1]
    let vs = unsafe { ks.add(TILE_KEYS as usize * (hd + 1)) }; // [TILE_KEYS, hd]
    let qs = unsafe { vs.add(TILE_KEYS as usize * hd) }; // [warps, hd]

    let my_q = unsafe { qs.add(warp as usize * hd) };
    let q_at = row as usize * q_dim + h as usize * hd;
    let mut d = lane as usize;
    while d < hd {
        unsafe { *my_q.add(d) = if active { *q.add(q_at + d) } else { 0.0 } };
        d += WARP as usize;
    }

    // Keys the block needs: up to the position of its last row.
    let n_keys = p0 + rows.min(first_row + warps);
    // This row's last key (unused when inactive).
    let last = p0 + row;
    let mut run = Running::new();
    let mut k0 = 0;
    while k0 < n_keys {
        stage_tile(
            ks, vs, k_cache, v_cache, k0, n_keys, head_dim, kv_dim, kv_off,
        );
        sync_threads();
        // Warp-uniform: the whole warp has one row, so the shuffles inside see every lane.
        // Tile 0 holds key 0, so a row's max is finite from its first tile on.
        if active && k0 <= last {
            run.add_tile(ks, vs, my_q, k0, last, hd, scale);
        }
        // Everyone is done with the tile before the next one overwrites it.
        sync_threads();
        k0 += TILE_KEYS;
    }

    if active {
        let out = unsafe { out.add(q_at) };
        for (j, acc) in run.acc.iter().enumerate() {
            if dim(j) < hd {
                unsafe { *out.add(dim(j)) = *acc / run.l };
            }
        }
    }
}

/// Stages keys `k0..k0 + 32` of one kv head (at `kv_off` in rows of `kv_dim`) into the shared
/// tiles `ks = [32, head_dim + 1]` (rows padded by one so that lane-per-key reads hit distinct
/// banks) and `vs = [32, head_dim]`; keys from `end` on are zeros, never read as garbage.
/// The whole block calls it. Each thread issues the loads of `STAGE_BATCH` elements before it
/// stores any, so that a round costs one memory latency, not one per element.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn stage_tile(
    ks: *mut f32,
    vs: *mut f32,
    k_cache: *const f32,
    v_cache: *const f32,
    k0: u32,
    end: u32,
    head_dim: u32,
    kv_dim: usize,
    kv_off: usize,
) {
    let (n, bd) = (TILE_KEYS * head_dim, block_dim());
    let mut e0 = thread();
    while e0 < n {
        let mut kv = [(0.0f32, 0.0f32); STAGE_BATCH];
        for (b, kv) in kv.iter_mut().enumerate() {
            let e = e0 + b as u32 * bd;
            let key = k0 + e / head_dim;
            if e < n && key < end {
                let at = key as usize * kv_dim + kv_off + (e % head_dim) as usize;
                *kv = unsafe { (*k_cache.add(at), *v_cache.add(at)) };
            }
        }
        for (b, kv) in kv.iter().enumerate() {
            let e = e0 + b as u32 * bd;
            if e < n {
                let (i, d) = (e / head_dim, e % head_dim);
                unsafe {
                    *ks.add((i * (head_dim + 1) + d) as usize) = kv.0;
                    *vs.add(e as usize) = kv.1;
                }
            }
        }
        e0 += STAGE_BATCH as u32 * bd;
    }
}

/// One query's online softmax, kept by a warp: the running max `m` of the scores seen, the
/// sum `l` of e^(score - m) and, per lane, the output dims `lane + 32 j` in `acc` = the sum of
/// e^(score - m) * v, all rescaled whenever `m` grows.
struct Running {
    m: f32,
    l: f32,
    acc: [f32; MAX_DIMS_PER_LANE],
}

impl Running {
    fn new() -> Self {
        Running {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: [0.0; MAX_DIMS_PER_LANE],
        }
    }

    /// Adds keys `k0..=min(last, k0 + 31)` of the staged tile (`stage_tile`), scored against
    /// `q = [head_dim]` in shared memory: lane `i` scores key `k0 + i`. The whole warp calls
    /// it, with `k0 <= last`, so the tile's max is finite.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn add_tile(
        &mut self,
        ks: *const f32,
        vs: *const f32,
        q: *const f32,
        k0: u32,
        last: u32,
        hd: usize,
        scale: f32,
    ) {
        let lane = thread() % WARP;
        let dim = |j: usize| lane as usize + WARP as usize * j;
        let mut s = f32::NEG_INFINITY;
        if k0 + lane <= last {
            let k = unsafe { ks.add(lane as usize * (hd + 1)) };
            let mut dot = 0.0f32;
            for d in 0..hd {
                dot += unsafe { *q.add(d) * *k.add(d) };
            }
            s = dot * scale;
        }
        let m_new = self.m.max(warp_max(s));
        let c = exp(self.m - m_new);
        let p = exp(s - m_new);
        self.l = self.l * c + warp_sum(p);
        self.m = m_new;
        for acc in self.acc.iter_mut() {
            *acc *= c;
        }
        let keys = TILE_KEYS.min(last - k0 + 1);
        for i in 0..keys {
            let p = warp_broadcast(p, i);
            let v = unsafe { vs.add(i as usize * hd) };
            for (j, acc) in self.acc.iter_mut().enumerate() {
                if dim(j) < hd {
                    *acc += p * unsafe { *v.add(dim(j)) };
                }
            }
        }
    }
}
