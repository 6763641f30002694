//! The KV cache and causal grouped-query attention. CPU twin: `orcd::cpu::attention`.
//!
//! Caches are `[max_pos, kv_dim]` row-major with `kv_dim = n_kv * head_dim`; query head `h` reads
//! kv head `h / (n_heads / n_kv)`. The current position `pos[0]` lives in device memory (so a
//! captured CUDA graph replays for any position): every loop over keys takes its bound from it,
//! and no launch size depends on it. A position past the cache's end traps the kernel.
use core::arch::nvptx;

use crate::util::{
    WARP, block, block_dim, exp, shared, sync_threads, thread, warp_broadcast, warp_max, warp_sum,
};

/// Head dims up to `32 * MAX_DIMS_PER_LANE` = 128: each lane of a warp owns the output dims
/// `lane + 32 * j`.
const MAX_DIMS_PER_LANE: usize = 4;
/// Keys per tile of the prefill kernel: one per lane.
const TILE_KEYS: u32 = WARP;

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

/// Attention of one query row `q = [n_heads * head_dim]` at position `pos[0]` over keys
/// `0..=pos[0]` into `out = [n_heads * head_dim]`. `scale` = 1/sqrt(head_dim), head_dim <= 128.
/// Grid: one block per query head; block: a multiple of 32 threads, at least head_dim;
/// shared: `(blockDim / 32) * (head_dim + 2)` f32.
///
/// Warp `w` takes keys `w, w + warps, ...`: the warp computes the key's score with a warp sum,
/// then updates its online softmax (running max `m`, sum `l`, and `acc` = the sum of
/// exp(score - m) * v over its keys, rescaled whenever `m` grows). The warps' partial
/// results are combined through shared memory at the end.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn attention_decode(
    out: *mut f32,
    q: *const f32,
    k_cache: *const f32,
    v_cache: *const f32,
    pos: *const u32,
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
    let (lane, warp, warps) = (thread() % WARP, thread() / WARP, block_dim() / WARP);
    let h = block();
    let hd = head_dim as usize;
    let kv_dim = (n_kv * head_dim) as usize;
    let kv_off = (h / (n_heads / n_kv)) as usize * hd;
    let dim = |j: usize| lane as usize + WARP as usize * j;

    let q = unsafe { q.add(h as usize * hd) };
    let mut qr = [0.0f32; MAX_DIMS_PER_LANE];
    for (j, qr) in qr.iter_mut().enumerate() {
        if dim(j) < hd {
            *qr = unsafe { *q.add(dim(j)) };
        }
    }

    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    let mut acc = [0.0f32; MAX_DIMS_PER_LANE];
    let mut key = warp;
    while key <= p0 {
        let row = key as usize * kv_dim + kv_off;
        let (k, v) = unsafe { (k_cache.add(row), v_cache.add(row)) };
        let mut dot = 0.0f32;
        for (j, qr) in qr.iter().enumerate() {
            if dim(j) < hd {
                dot += qr * unsafe { *k.add(dim(j)) };
            }
        }
        // Every lane holds the same score: the butterfly sum is symmetric.
        let s = warp_sum(dot) * scale;
        // One exp per key: either the old terms shrink or the new one does.
        let (c, p) = if s > m {
            let c = exp(m - s);
            m = s;
            (c, 1.0)
        } else {
            (1.0, exp(s - m))
        };
        l = l * c + p;
        for (j, acc) in acc.iter_mut().enumerate() {
            if dim(j) < hd {
                *acc = *acc * c + p * unsafe { *v.add(dim(j)) };
            }
        }
        key += warps;
    }

    // Combine the warps: out = sum_w acc_w * e^(m_w - M) / sum_w l_w * e^(m_w - M). A warp
    // without keys has m = -inf and weighs 0.
    let smem = shared::<f32>();
    let stride = hd + 2;
    let mine = unsafe { smem.add(warp as usize * stride) };
    if lane == 0 {
        unsafe { (*mine, *mine.add(1)) = (m, l) };
    }
    for (j, acc) in acc.iter().enumerate() {
        if dim(j) < hd {
            unsafe { *mine.add(2 + dim(j)) = *acc };
        }
    }
    sync_threads();
    let d = thread() as usize;
    if d < hd {
        let part = |w: u32| unsafe { smem.add(w as usize * stride) };
        let mut max = f32::NEG_INFINITY;
        for w in 0..warps {
            max = max.max(unsafe { *part(w) });
        }
        let (mut sum, mut o) = (0.0f32, 0.0f32);
        for w in 0..warps {
            let f = exp(unsafe { *part(w) } - max);
            sum += unsafe { *part(w).add(1) } * f;
            o += unsafe { *part(w).add(2 + d) } * f;
        }
        unsafe { *out.add(h as usize * hd + d) = o / sum };
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
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    let mut acc = [0.0f32; MAX_DIMS_PER_LANE];
    let mut k0 = 0;
    while k0 < n_keys {
        // Stage the tile; keys past the block's last are zeros, never read as garbage.
        let mut e = thread();
        while e < TILE_KEYS * head_dim {
            let (i, d) = (e / head_dim, (e % head_dim) as usize);
            let key = k0 + i;
            let (kv, vv) = if key < n_keys {
                let at = key as usize * kv_dim + kv_off + d;
                unsafe { (*k_cache.add(at), *v_cache.add(at)) }
            } else {
                (0.0, 0.0)
            };
            unsafe {
                *ks.add(i as usize * (hd + 1) + d) = kv;
                *vs.add(e as usize) = vv;
            }
            e += block_dim();
        }
        sync_threads();

        // Warp-uniform: the whole warp has one row, so the shuffles below see every lane.
        if active && k0 <= last {
            let key = k0 + lane;
            let mut s = f32::NEG_INFINITY;
            if key <= last {
                let k = unsafe { ks.add(lane as usize * (hd + 1)) };
                let mut dot = 0.0f32;
                for d in 0..hd {
                    dot += unsafe { *my_q.add(d) * *k.add(d) };
                }
                s = dot * scale;
            }
            // Tile 0 holds key 0, so `m` is finite from the first tile on and a later tile,
            // which has its first key <= last, never has a max of -inf.
            let m_new = m.max(warp_max(s));
            let c = exp(m - m_new);
            let p = exp(s - m_new);
            l = l * c + warp_sum(p);
            m = m_new;
            for acc in acc.iter_mut() {
                *acc *= c;
            }
            let keys = TILE_KEYS.min(last - k0 + 1);
            for i in 0..keys {
                let p = warp_broadcast(p, i);
                let v = unsafe { vs.add(i as usize * hd) };
                for (j, acc) in acc.iter_mut().enumerate() {
                    if dim(j) < hd {
                        *acc += p * unsafe { *v.add(dim(j)) };
                    }
                }
            }
        }
        // Everyone is done with the tile before the next one overwrites it.
        sync_threads();
        k0 += TILE_KEYS;
    }

    if active {
        let out = unsafe { out.add(q_at) };
        for (j, acc) in acc.iter().enumerate() {
            if dim(j) < hd {
                unsafe { *out.add(dim(j)) = *acc / l };
            }
        }
    }
}
