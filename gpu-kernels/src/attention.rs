//! The KV cache and causal grouped-query attention. CPU twin: `orcd::cpu::attention`.
//!
//! Caches are `[max_pos, kv_dim]` row-major with `kv_dim = n_kv * head_dim`; query head `h` reads
//! kv head `h / (n_heads / n_kv)`. The current position `pos[0]` lives in device memory (so a
//! captured CUDA graph replays for any position): every loop over keys takes its bound from it,
//! and no launch size depends on it. A position past the cache's end traps the kernel.
//!
//! Both attention kernels are written once, generic over the padded head dim `D` (64 or 128:
//! shared tiles and registers are sized by it, dims from `head_dim` on are zeros) and `VEC`
//! (`head_dim == D` and every buffer 16-byte aligned: vector loads and stores without bounds
//! on the dims). Both take `D = 64` with `VEC` for head_dim 64 with aligned buffers (the
//! model), and `D = 128` without for everything else (any head_dim 1..=128): the prefill
//! kernel picks at run time, the decode kernel is two (`attention_decode_hd64` and
//! `attention_decode`) and the host picks.
use core::arch::nvptx;

// Threads of a block of either attention kernel, keys of a tile, the decode kernel's key
// slices (its grid's y, at most) and the query rows of a prefill block.
use kernel_abi::attention::{
    DECODE_SHARED_BYTES, DECODE_SPLITS, PREFILL_ROWS, PREFILL_SHARED_BYTES, THREADS, TILE_KEYS,
};

use crate::matmul::Vector;
use crate::params::{AttentionDecode, AttentionPrefill, KvAppend};
use crate::util::{
    F32x4, LO_SCALE, WARP, aligned, allow_next_grid, block, block_dim, exp, exp_wide, fma,
    grid_dim, ldmatrix4, mma, red_add_f64, shared, shared_addr, split_pair, store_shared2,
    sync_threads, thread, wait_prior_grids, warp_max, warp_sum,
};

/// Keys up to which each block of the decode kernel has one tile at most (with
/// `DECODE_SPLITS` slices, as the host launches it).
pub const ONE_TILE_KEYS: u32 = DECODE_SPLITS * TILE_KEYS;

/// `for $i in 0..$n { $body }` written out, so that every index into an array is a constant and
/// the array stays in registers (LLVM does not fully unroll loops whose bodies hold many `mma`s
/// or shuffles). `$n` is a literal (2, 4, 8 or 32), or an expression that folds to a constant
/// with its largest value after a `;`.
macro_rules! unroll {
    ($i:ident in 0..$n:tt, $body:block) => {
        unroll!($i in 0..$n; $n, $body)
    };
    ($i:ident in 0..$n:expr; 2, $body:block) => {
        unroll!(@ $i, $n, $body; 0 1)
    };
    ($i:ident in 0..$n:expr; 4, $body:block) => {
        unroll!(@ $i, $n, $body; 0 1 2 3)
    };
    ($i:ident in 0..$n:expr; 8, $body:block) => {
        unroll!(@ $i, $n, $body; 0 1 2 3 4 5 6 7)
    };
    ($i:ident in 0..$n:expr; 32, $body:block) => {
        unroll!(@ $i, $n, $body;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31)
    };
    (@ $i:ident, $n:expr, $body:block; $($k:literal)*) => {
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}

/// 8 bytes, for one vector access of 2 floats.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct F32x2([f32; 2]);

/// `N` (2 or 4) floats at `p`, `4N`-byte aligned: one vector load.
#[inline(always)]
unsafe fn load_n<const N: usize>(p: *const f32) -> [f32; N] {
    const { assert!(N == 2 || N == 4) };
    let mut v = [0.0; N];
    unsafe {
        if N == 4 {
            let w = *(p as *const F32x4);
            v.copy_from_slice(&w.0[..N]);
        } else {
            let w = *(p as *const F32x2);
            v.copy_from_slice(&w.0[..N]);
        }
    }
    v
}

/// Stores `N` (2 or 4) floats at `p`, `4N`-byte aligned: one vector store.
#[inline(always)]
unsafe fn store_n<const N: usize>(p: *mut f32, v: [f32; N]) {
    const { assert!(N == 2 || N == 4) };
    unsafe {
        if N == 4 {
            let mut w = [0.0; 4];
            w.copy_from_slice(&v);
            *(p as *mut F32x4) = F32x4(w);
        } else {
            let mut w = [0.0; 2];
            w.copy_from_slice(&v);
            *(p as *mut F32x2) = F32x2(w);
        }
    }
}

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.bar.warp.sync"]
    fn bar_warp_sync(mask: u32);
}

/// Lane `lane ^ m`'s `v` (the whole warp calls it).
#[inline(always)]
fn shfl_xor(v: f32, m: u32) -> f32 {
    unsafe { shfl_bfly_f32(u32::MAX, v, m, 0x1f) }
}

/// The warp's memory writes before it are seen by its lanes' reads after it (`bar.warp.sync`
/// orders memory among its lanes as `bar.sync` does among a block's).
#[inline(always)]
fn sync_warp() {
    unsafe { bar_warp_sync(u32::MAX) }
}

/// The keys and values of one kv head: rows of `kv_dim` floats, the head's `hd` at `kv_off`.
#[derive(Clone, Copy)]
struct Kv {
    k: *const f32,
    v: *const f32,
    kv_dim: usize,
    kv_off: usize,
    hd: u32,
}

impl Kv {
    /// Floats `d..d + 4` of key row `key` of `cache` (`self.k` or `self.v`): zeros for keys from
    /// `end` on and for dims from `hd` on (`end >= 1`). `VEC`: `hd` is the padded dim and the
    /// rows are 16-byte aligned: one vector load, the key clamped into the cache and the
    /// value zeroed after, so that the loads of a tile are straight-line code.
    #[inline(always)]
    fn load4<const VEC: bool>(&self, cache: *const f32, key: u32, d: u32, end: u32) -> [f32; 4] {
        if VEC {
            let at = key.min(end - 1) as usize * self.kv_dim + self.kv_off + d as usize;
            let v = unsafe { *(cache.add(at) as *const F32x4) }.0;
            if key < end { v } else { [0.0; 4] }
        } else {
            let at = key as usize * self.kv_dim + self.kv_off + d as usize;
            core::array::from_fn(|e| {
                if key < end && d + (e as u32) < self.hd {
                    unsafe { *cache.add(at + e) }
                } else {
                    0.0
                }
            })
        }
    }

    /// This thread's `N` staging units of K and of V for the keys from `k0` (`stage_unit`),
    /// zeros from `end` on.
    #[inline(always)]
    fn stage<const D: usize, const N: usize, const VEC: bool>(
        &self,
        k0: u32,
        end: u32,
    ) -> ([[f32; 4]; N], [[f32; 4]; N]) {
        let units = |cache| {
            core::array::from_fn(|i| {
                let (r, d) = stage_unit::<D>(i);
                self.load4::<VEC>(cache, k0 + r, d, end)
            })
        };
        (units(self.k), units(self.v))
    }
}

/// Staging unit `t + 256 i` of thread `t` in a tile of keys with head dims padded to `D`:
/// (key `u / (D / 4)`, floats `4 (u % (D / 4))..+4`).
#[inline(always)]
fn stage_unit<const D: usize>(i: usize) -> (u32, u32) {
    let u = thread() as usize + THREADS as usize * i;
    ((u / (D / 4)) as u32, (4 * (u % (D / 4))) as u32)
}

/// Copies `k, v = [rows, kv_dim]` into rows `pos[0]..pos[0] + rows` of `k_cache, v_cache =
/// [max_pos, kv_dim]`. Grid: `ceil(rows * kv_dim / blockDim)` blocks; no shared memory.
#[inline(always)]
pub(crate) unsafe fn kv_append(p: KvAppend) {
    let KvAppend {
        k_cache,
        v_cache,
        k,
        v,
        pos,
        rows,
        kv_dim,
        max_pos,
    } = p;
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
/// position `pos[0]` over keys `0..=pos[0]`, added into `sums = [n_heads * head_dim +
/// n_heads]` f64, zero before the launch, unnormalised (see [`Sums`]):
/// `sums[h * head_dim + d]` gets `sum_j e^(s_j - r_h) v_j[d]` and `sums[n_heads * head_dim +
/// h]` gets `sum_j e^(s_j - r_h)`, over the keys `j` with scores `s_j = q_h·k_j * scale`, for
/// a reference `r_h`: head h's score of key `pos[0]`, its own token's. `scale` =
/// 1/sqrt(head_dim), head_dim <= 128.
///
/// Grid: `(n_kv * ceil(group / 8), splits)` with `group = n_heads / n_kv` and
/// `splits <= 64`: block `(x, s)` serves up to 8 query heads of one kv head, one per warp,
/// over slice `s` of the keys, so each K/V row is read once for all of them. Block: 256
/// threads. Shared: 38,400 bytes (the `D = 128` path's; the other needs less).
///
/// The slices are whole tiles of 32 keys, as few per slice as cover `pos[0] + 1` keys in
/// `splits` slices (32 keys per block up to 2048 keys); all of it follows from `pos[0]` on
/// the device, so the launch does not depend on the position. Blocks past the last key
/// have nothing to do and leave at once. Per tile (its K and V staged in shared memory by
/// 16-byte loads, the next tile's loads in flight during the current one's math), lane `i`
/// of each warp scores key `i` against its head's query, and the warp updates the head's
/// online softmax (max `m`, sum `l`) and its output dims `D/32` per lane. Then each warp
/// adds its slice's share, `e^(m - r_h)` times its `l` and outputs, into the sums by
/// `red.add.f64` and leaves: no slice waits for another, and the slices need no common
/// max. The one reference keeps every slice's terms on one scale, and f64 holds them: the
/// sum includes key `pos[0]`'s `e^0 = 1`, so it never underflows, and only a key scoring
/// more than ~709 above the query's own overflows it (the head's output is then not
/// finite; the default model's largest such gap, over a prompt and 40 generated tokens in
/// every layer and head, is ~33). The order of the additions varies from launch to
/// launch, at f64's rounding.
///
/// Keyed by `D`, the padded head dim: 128 for any head_dim (`decode::<128, 4, false>`), 64 for
/// head_dim 64 with `sums`, `q` and the caches 16-byte aligned (the host checks; traps on
/// another head_dim): 16-byte loads throughout, and only the registers its path needs.
#[inline(always)]
pub(crate) unsafe fn attention_decode<const D: u32>(p: AttentionDecode) {
    const { assert!(D == 64 || D == 128) };
    if D == 64 {
        if p.head_dim != 64 {
            unsafe { nvptx::trap() };
        }
        unsafe { decode::<64, 2, true>(p) }
    } else {
        unsafe { decode::<128, 4, false>(p) }
    }
}

/// The decode kernel's output as a GEMV's input vector (`matmul::Vector`): element `k` of
/// `n = n_heads * head_dim` is `sums[k] / sums[n + k / head_dim]`, the head's output over its
/// softmax's sum, in f64 (whose range the sums may need), rounded to f32. `head_dim % 4 == 0`
/// and `sums` 16-byte aligned, so that each 4 elements are one head's.
#[derive(Clone, Copy)]
pub(crate) struct Sums {
    pub(crate) sums: *const f64,
    pub(crate) n: u32,
    pub(crate) head_dim: u32,
}

impl Sums {
    /// The softmax's sum of the head of element `k`.
    #[inline(always)]
    fn head_sum(self, k: usize) -> f64 {
        unsafe { *self.sums.add(self.n as usize + k / self.head_dim as usize) }
    }
}

impl Vector for Sums {
    #[inline(always)]
    fn load4(self, k: usize) -> [f32; 4] {
        #[repr(C, align(16))]
        #[derive(Clone, Copy)]
        struct F64x2([f64; 2]);
        let [a, b] = [k, k + 2].map(|k| unsafe { *(self.sums.add(k) as *const F64x2) }.0);
        let inv = 1.0 / self.head_sum(k);
        [a[0], a[1], b[0], b[1]].map(|x| (x * inv) as f32)
    }

    #[inline(always)]
    fn load(self, k: usize) -> f32 {
        (unsafe { *self.sums.add(k) } / self.head_sum(k)) as f32
    }
}

/// `attention_decode` for head dims padded to `D` (see the module's doc). `DPL = D / 32`: the
/// output dims per lane, `lane * DPL..`; also the K (and V) units of 4 floats a thread stages
/// per tile (32 keys of `D / 4` units over 256 threads).
#[inline(always)]
unsafe fn decode<const D: usize, const DPL: usize, const VEC: bool>(p: AttentionDecode) {
    let AttentionDecode {
        sums,
        q,
        k_cache,
        v_cache,
        pos,
        n_heads,
        n_kv,
        head_dim,
        max_pos,
        scale,
    } = p;
    const { assert!(D == 32 * DPL) };
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let group = n_heads / n_kv;
    let per_kv = group.div_ceil(THREADS / WARP);
    let kvh = block() / per_kv;
    let g = (block() % per_kv) * (THREADS / WARP) + warp;
    let active = g < group;
    let h = kvh * group + g;
    let hd = head_dim;
    let kv = Kv {
        k: k_cache,
        v: v_cache,
        kv_dim: (n_kv * hd) as usize,
        kv_off: (kvh * hd) as usize,
        hd,
    };

    let smem = shared::<F32x4>() as *mut f32;
    let ks = smem; // [32][D + 4]: + 4 so that lane-per-key 16-byte reads hit distinct banks
    let vs = unsafe { ks.add(32 * (D + 4)) }; // [32][D]
    let qs = unsafe { vs.add(32 * D) }; // [8][D]
    let ps = unsafe { qs.add(8 * D) }; // [8][32]
    // All of it within the shared memory the host launches with.
    const { assert!(4 * (32 * (D + 4) + 32 * D + 8 * D + 8 * 32) <= DECODE_SHARED_BYTES as usize) };

    // The kernel this one may overlap is attn_qkv, which let it start only once the kernels
    // before attn_qkv had finished. So the position (set before the step's first kernel) and
    // the cache rows before it (earlier steps') are final: read before the wait, with the
    // first tile's keys before `p0`. Key `p0` is attn_qkv's.
    let p0 = unsafe { *pos };
    let (splits, split) = unsafe { (nvptx::_grid_dim_y(), nvptx::_block_idx_y()) };
    if p0 >= max_pos || splits > DECODE_SPLITS {
        unsafe { nvptx::trap() };
    }
    let n_keys = p0 + 1;
    let chunk = n_keys.div_ceil(splits).next_multiple_of(TILE_KEYS);
    let used = n_keys.div_ceil(chunk);
    // The whole block leaves, before any barrier.
    if split >= used {
        return;
    }
    let first = split * chunk;
    let end = n_keys.min(first + chunk);
    let tiles = (end - first).div_ceil(TILE_KEYS);
    let unit = stage_unit::<D>;
    let load = |k0: u32| kv.stage::<D, DPL, VEC>(k0, end);
    let mut staged = if p0 > first {
        kv.stage::<D, DPL, VEC>(first, end.min(p0))
    } else {
        ([[0.0; 4]; DPL], [[0.0; 4]; DPL])
    };

    // Everything from here on is the kernels' before (q and the caches from attn_qkv).
    wait_prior_grids();
    allow_next_grid();
    // Key `p0`, if the first tile holds it.
    if p0 < first + TILE_KEYS {
        for i in 0..DPL {
            let (r, d) = unit(i);
            if first + r == p0 {
                staged.0[i] = kv.load4::<VEC>(kv.k, p0, d, end);
                staged.1[i] = kv.load4::<VEC>(kv.v, p0, d, end);
            }
        }
    }
    // The query first: its loads do not wait for the position's.
    let my_q = unsafe { qs.add(warp as usize * D) };
    let d0 = lane * DPL as u32;
    let qv: [f32; DPL] = if VEC {
        // Inactive warps read head 0 of the group and store zeros.
        let hq = if active { h } else { kvh * group };
        let v = unsafe { load_n::<DPL>(q.add((hq * hd + d0) as usize)) };
        if active { v } else { [0.0; DPL] }
    } else {
        core::array::from_fn(|i| {
            let d = d0 + i as u32;
            if active && d < hd {
                unsafe { *q.add((h * hd + d) as usize) }
            } else {
                0.0
            }
        })
    };
    unsafe { store_n(my_q.add(d0 as usize), qv) };
    // Key `p0`'s dims of this lane, for the reference score.
    let own = unsafe { kv.k.add(p0 as usize * kv.kv_dim + kv.kv_off + d0 as usize) };
    let k_own: [f32; DPL] = if VEC {
        unsafe { load_n::<DPL>(own) }
    } else {
        core::array::from_fn(|i| {
            if d0 + (i as u32) < hd {
                unsafe { *own.add(i) }
            } else {
                0.0
            }
        })
    };

    // The reference: the head's score of key p0, the same in every slice (the same products,
    // added in the same order).
    let mut s_own = 0.0f32;
    for i in 0..DPL {
        s_own = fma(qv[i], k_own[i], s_own);
    }
    let s_own = warp_sum(s_own) * scale;

    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32; DPL]);
    // Every thread runs the same tiles: the barriers are reached by all.
    for t in 0..tiles {
        for i in 0..DPL {
            let (r, d) = unit(i);
            unsafe {
                *(ks.add(r as usize * (D + 4) + d as usize) as *mut F32x4) = F32x4(staged.0[i]);
                *(vs.add(r as usize * D + d as usize) as *mut F32x4) = F32x4(staged.1[i]);
            }
        }
        sync_threads();
        let k0 = first + t * TILE_KEYS;
        // The next tile's loads fly during the math (most blocks have one tile: none).
        if t + 1 < tiles {
            staged = load(k0 + TILE_KEYS);
        }
        // Warp-uniform: the shuffles inside see every lane.
        if active {
            // Lane `lane` scores key `k0 + lane`, in four independent FMA chains.
            let key_row = unsafe { ks.add(lane as usize * (D + 4)) };
            let mut dots = [0.0f32; 4];
            unroll!(c in 0..D / 4; 32, {
                let kq = unsafe { *(key_row.add(4 * c) as *const F32x4) }.0;
                let qq = unsafe { *(my_q.add(4 * c) as *const F32x4) }.0;
                for e in 0..4 {
                    dots[e] = fma(qq[e], kq[e], dots[e]);
                }
            });
            let s = if k0 + lane < end {
                ((dots[0] + dots[1]) + (dots[2] + dots[3])) * scale
            } else {
                f32::NEG_INFINITY
            };
            // Key k0 < end is live, so the max is finite.
            let m_new = m.max(warp_max(s));
            let c = exp(m - m_new);
            let p = exp(s - m_new);
            m = m_new;
            // This lane's keys' share of the sum, reduced over the warp at the end.
            l = l * c + p;
            let my_p = unsafe { ps.add(warp as usize * 32) };
            unsafe { *my_p.add(lane as usize) = p };
            sync_warp();
            // Lane `lane`'s dims over the tile's 32 keys (dead keys weigh 0 and their rows are
            // finite: zeros past `end`), in two chains.
            let mut part = [[0.0f32; DPL]; 2];
            unroll!(k4 in 0..8, {
                let pk = unsafe { *(my_p.add(4 * k4) as *const F32x4) }.0;
                unroll!(e in 0..4, {
                    let k = 4 * k4 + e;
                    let v = unsafe { load_n::<DPL>(vs.add(k * D + d0 as usize)) };
                    unroll!(i in 0..DPL; 4, {
                        part[k % 2][i] = fma(pk[e], v[i], part[k % 2][i]);
                    });
                });
            });
            for (i, a) in acc.iter_mut().enumerate() {
                *a = fma(*a, c, part[0][i] + part[1][i]);
            }
        }
        // Everyone is done with the tile before the next one overwrites it.
        sync_threads();
    }

    if !active {
        return;
    }
    let w = exp_wide(m - s_own);
    let l = warp_sum(l);
    let out = unsafe { sums.add((h * hd + d0) as usize) };
    for (i, a) in acc.iter().enumerate() {
        if VEC || d0 + (i as u32) < hd {
            red_add_f64(unsafe { out.add(i) }, *a as f64 * w);
        }
    }
    if lane == 0 {
        red_add_f64(
            unsafe { sums.add((n_heads * hd + h) as usize) },
            l as f64 * w,
        );
    }
}

/// Causal attention of `rows` query rows `q = [rows, n_heads * head_dim]`, row `t` at position
/// `pos[0] + t` over keys `0..=pos[0] + t`, into `out` (same shape), flash-attention style on
/// tensor cores at f32 precision. `scale` = 1/sqrt(head_dim), head_dim <= 128.
/// Grid: `(ceil(rows / 64), n_heads)`: block `(x, h)` does query head `h` for 64 rows, the
/// blocks of the last rows (the most keys) first. Block: 256 threads. Shared: 32768 bytes.
///
/// Warp `w` owns the 16 rows of row group `w % 4` (one m16 tile of `mma.sync` m16n8k16) and
/// part `w / 4`: with `D = 64` the two parts take alternate tiles of 32 keys and meet at the
/// end (so two warps work on each row group's keys, and one's softmax overlaps the other's
/// products); with `D = 128` both take every tile, each for half the output dims. The block
/// walks the keys in rounds of `4096 / D` keys (one tile per part), staged in shared memory as
/// split f16 halves (see [`LO_SCALE`]) by 16-byte loads, the next round's loads in flight
/// during the current one's math. A warp computes its scores `S = Q·Kᵀ` (Q's fragments in
/// registers), masks the keys past each row's position (the diagonal tiles only), updates its
/// rows' online softmax and adds `P·V`, `P` taken straight from `S`'s accumulators. Each
/// product is three `mma`s, `hi·hi` and `(lo·hi + hi·lo) / LO_SCALE` in a second accumulator,
/// the `lo·lo` term (< 2^-22 of the product) left out. A warp skips the tiles wholly after
/// its last row. Operands must stay below 65504 in magnitude (f16's range; activations are
/// far below): a larger one makes its rows' outputs non-finite.
#[inline(always)]
pub(crate) unsafe fn attention_prefill(p: AttentionPrefill) {
    let AttentionPrefill {
        out,
        q,
        k_cache,
        v_cache,
        pos,
        rows,
        n_heads,
        n_kv,
        head_dim,
        max_pos,
        scale,
    } = p;
    let fast = head_dim == 64
        && aligned(out, 16)
        && aligned(q, 16)
        && aligned(k_cache, 16)
        && aligned(v_cache, 16);
    let a = (out, q, k_cache, v_cache, pos);
    let n = (rows, n_heads, n_kv, head_dim, max_pos, scale);
    if fast {
        unsafe { prefill::<64, true>(a, n) }
    } else {
        unsafe { prefill::<128, false>(a, n) }
    }
}

type PrefillPtrs = (*mut f32, *const f32, *const f32, *const f32, *const u32);

/// The three products of one split tile: `main += a_hi·b_hi`, `cross += a_lo·b_hi + a_hi·b_lo`.
#[inline(always)]
fn mma3(main: &mut [f32; 4], cross: &mut [f32; 4], a: &([u32; 4], [u32; 4]), b: [[u32; 2]; 2]) {
    mma(main, a.0, b[0]);
    mma(cross, a.1, b[0]);
    mma(cross, a.0, b[1]);
}

/// An A fragment (see [`mma`]) of four float pairs, split: (hi words, lo words).
#[inline(always)]
fn split_a(v: [[f32; 2]; 4]) -> ([u32; 4], [u32; 4]) {
    let s = v.map(|[a, b]| split_pair(a, b));
    (s.map(|s| s.0), s.map(|s| s.1))
}

/// `attention_prefill` for head dims padded to `D` (see the module's doc).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn prefill<const D: usize, const VEC: bool>(
    (out, q, k_cache, v_cache, pos): PrefillPtrs,
    (rows, n_heads, n_kv, head_dim, max_pos, scale): (u32, u32, u32, u32, u32, f32),
) {
    let p0 = unsafe { *pos };
    if p0 > max_pos - rows {
        unsafe { nvptx::trap() };
    }
    // Key parts (2 with D = 64, else 1), keys per round, and the bytes of one of the round's
    // four tiles (K hi, K lo, V hi, V lo: `[round keys][D]` halves, 8192 either way).
    let parts = (128 / D) as u32;
    let round_keys = parts * TILE_KEYS;
    let tile_bytes = const {
        let bytes = 2 * (128 / D) * 32 * D;
        // The round's four tiles, within the shared memory the host launches with.
        assert!(4 * bytes <= PREFILL_SHARED_BYTES as usize);
        bytes as u32
    };
    let (lane, warp) = (thread() % WARP, thread() / WARP);
    let (g, c) = (lane / 4, lane % 4);
    let (rg, part) = (warp % 4, warp / 4);
    // D = 64: key part `part`, all dims; D = 128: every key, output dims `64 part..`.
    let (kp, dp) = if parts == 2 { (part, 0) } else { (0, part) };
    let h = unsafe { nvptx::_block_idx_y() } as u32;
    let row0 = (grid_dim() - 1 - block()) * PREFILL_ROWS;
    let wrow0 = row0 + 16 * rg;
    let hd = head_dim;
    let q_dim = (n_heads * hd) as usize;
    let kv = Kv {
        k: k_cache,
        v: v_cache,
        kv_dim: (n_kv * hd) as usize,
        kv_off: (h / (n_heads / n_kv) * hd) as usize,
        hd,
    };
    // Keys the block needs: up to the position of its last row.
    let n_keys = p0 + rows.min(row0 + PREFILL_ROWS);
    let rounds = n_keys.div_ceil(round_keys);
    // Whether the warp has rows, and the position of its last.
    let warp_rows = wrow0 < rows;
    let warp_last = p0 + (wrow0 + 15).min(rows - 1);

    // Q's A fragments for the k steps of 16 dims, split. Rows past `rows` are zeros.
    let q_pair = |r: u32, d: u32| -> [f32; 2] {
        if VEC {
            let at = r.min(rows - 1) as usize * q_dim + (h * hd + d) as usize;
            let v = unsafe { load_n::<2>(q.add(at)) };
            if r < rows { v } else { [0.0; 2] }
        } else {
            core::array::from_fn(|e| {
                let d = d + e as u32;
                if r < rows && d < hd {
                    unsafe { *q.add(r as usize * q_dim + (h * hd + d) as usize) }
                } else {
                    0.0
                }
            })
        }
    };
    let mut qf = [([0u32; 4], [0u32; 4]); 8];
    unroll!(kk in 0..D / 16; 8, {
        let (r, d) = (wrow0 + g, 16 * kk as u32 + 2 * c);
        qf[kk] = split_a([
            q_pair(r, d),
            q_pair(r + 8, d),
            q_pair(r, d + 8),
            q_pair(r + 8, d + 8),
        ]);
    });

    // Staging: `stage_unit` `i` (< 4) of a round's K (and V); 16-byte chunk `j` of tile row
    // `r` lies at chunk `j ^ (r % 8)`, so that the 8 rows one ldmatrix phase reads fall in
    // distinct banks.
    let unit = stage_unit::<D>;
    let chunk_at = |r: u32, j: u32| r * (2 * D as u32) + 16 * (j ^ (r % 8));
    let load = |round: u32| kv.stage::<D, 4, VEC>(round * round_keys, n_keys);
    let base = shared_addr(shared::<F32x4>());
    // 4 floats as split halves at `at` (hi) and `at + tile_bytes` (lo).
    let store4 = |at: u32, x: [f32; 4]| {
        let (h0, l0) = split_pair(x[0], x[1]);
        let (h1, l1) = split_pair(x[2], x[3]);
        store_shared2(at, [h0, h1]);
        store_shared2(at + tile_bytes, [l0, l1]);
    };
    let store = |(kk, vv): ([[f32; 4]; 4], [[f32; 4]; 4])| {
        unroll!(i in 0..4, {
            let (r, d) = unit(i);
            let at = base + chunk_at(r, d / 8) + 2 * (d % 8);
            store4(at, kk[i]);
            store4(at + 2 * tile_bytes, vv[i]);
        });
    };
    // The lanes' ldmatrix rows within the warp's 32 keys. K (non-transposed, rows are keys):
    // matrices (keys 0-7, dims 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) of a pair of n8
    // tiles are the B fragments of its two tiles. V (transposed, rows are keys): matrices
    // (keys 0-7, dims 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) likewise.
    let k_row = kp * TILE_KEYS + lane % 8 + 8 * (lane / 16);
    let k_chunk = lane / 8 % 2;
    let v_row = kp * TILE_KEYS + lane % 8 + 8 * (lane / 8 % 2);
    let v_chunk = 8 * dp + lane / 16;

    let mut o_main = [[0.0f32; 4]; 8];
    let mut o_cross = [[0.0f32; 4]; 8];
    // Rows g and g + 8: running max, and this lane's keys' share of the sum.
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut staged = load(0);
    // Every thread runs the same rounds: the barriers are reached by all.
    for round in 0..rounds {
        store(staged);
        sync_threads();
        // The next round's loads (the last round's again at the end) fly during the math,
        // with D = 64; D = 128 has no registers to spare for them and loads after it.
        let next = (round + 1).min(rounds - 1);
        if D == 64 {
            staged = load(next);
        }
        let k0 = round * round_keys + kp * TILE_KEYS;
        // Warp-uniform: the shuffles and mma inside see every lane.
        if warp_rows && k0 <= warp_last {
            // S = Q·Kᵀ for the 4 n8 tiles of the warp's 32 keys.
            let mut s_main = [[0.0f32; 4]; 4];
            let mut s_cross = [[0.0f32; 4]; 4];
            unroll!(kk in 0..D / 16; 8, {
                let at = [0, 1].map(|jp| chunk_at(k_row + 16 * jp, 2 * kk as u32 + k_chunk));
                let hi = at.map(|at| ldmatrix4::<false>(base + at));
                let lo = at.map(|at| ldmatrix4::<false>(base + tile_bytes + at));
                unroll!(j in 0..4, {
                    let (jp, w) = (j / 2, 2 * (j % 2));
                    let b = [[hi[jp][w], hi[jp][w + 1]], [lo[jp][w], lo[jp][w + 1]]];
                    mma3(&mut s_main[j], &mut s_cross[j], &qf[kk], b);
                });
            });
            // Scaled scores; keys past a row's position (only in a tile that reaches past
            // the warp's first row) are -inf.
            let mut s = [[0.0f32; 4]; 4];
            for j in 0..4 {
                for e in 0..4 {
                    s[j][e] = fma(s_cross[j][e], 1.0 / LO_SCALE, s_main[j][e]) * scale;
                }
            }
            if k0 + TILE_KEYS - 1 > p0 + wrow0 {
                for j in 0..4 {
                    for e in 0..4 {
                        let key = k0 + 8 * j as u32 + 2 * c + e as u32 % 2;
                        if key > p0 + wrow0 + g + 8 * (e as u32 / 2) {
                            s[j][e] = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            // Online softmax of rows g (e = 0, 1) and g + 8 (e = 2, 3): the tile's max over
            // the 4 lanes of the row, the correction of the old sums. A row with no live key
            // yet (only in part 1's tiles) keeps max -inf and weighs its keys 0.
            let mut corr = [0.0f32; 2];
            let mut m_use = [0.0f32; 2];
            for half in 0..2 {
                let mut mt = m[half];
                for j in 0..4 {
                    mt = mt.max(s[j][2 * half]).max(s[j][2 * half + 1]);
                }
                mt = mt.max(shfl_xor(mt, 1));
                mt = mt.max(shfl_xor(mt, 2));
                m_use[half] = if mt == f32::NEG_INFINITY { 0.0 } else { mt };
                corr[half] = exp(m[half] - m_use[half]);
                m[half] = mt;
            }
            let mut p = [[0.0f32; 4]; 4];
            let mut lt = [0.0f32; 2];
            for j in 0..4 {
                for e in 0..4 {
                    p[j][e] = exp(s[j][e] - m_use[e / 2]);
                    lt[e / 2] += p[j][e];
                }
            }
            for half in 0..2 {
                l[half] = fma(l[half], corr[half], lt[half]);
            }
            for n in 0..8 {
                for e in 0..4 {
                    o_main[n][e] *= corr[e / 2];
                    o_cross[n][e] *= corr[e / 2];
                }
            }
            // O += P·V over the warp's 32 keys (two k steps of 16): P's A fragment is the
            // accumulators of the n8 tiles 2ks and 2ks + 1.
            unroll!(ks in 0..2, {
                let (p0t, p1t) = (p[2 * ks], p[2 * ks + 1]);
                let pf = split_a([
                    [p0t[0], p0t[1]],
                    [p0t[2], p0t[3]],
                    [p1t[0], p1t[1]],
                    [p1t[2], p1t[3]],
                ]);
                let at = [0, 1, 2, 3].map(|np| chunk_at(v_row + 16 * ks as u32, v_chunk + 2 * np));
                let hi = at.map(|at| ldmatrix4::<true>(base + 2 * tile_bytes + at));
                let lo = at.map(|at| ldmatrix4::<true>(base + 3 * tile_bytes + at));
                unroll!(n in 0..8, {
                    let (np, w) = (n / 2, 2 * (n % 2));
                    let b = [[hi[np][w], hi[np][w + 1]], [lo[np][w], lo[np][w + 1]]];
                    mma3(&mut o_main[n], &mut o_cross[n], &pf, b);
                });
            });
        }
        if D != 64 {
            staged = load(next);
        }
        // Everyone is done with the round before the next one overwrites it.
        sync_threads();
    }

    let mut o = [[0.0f32; 4]; 8];
    for n in 0..8 {
        for e in 0..4 {
            o[n][e] = fma(o_cross[n][e], 1.0 / LO_SCALE, o_main[n][e]);
        }
    }
    if parts == 2 {
        // Part 1 hands its rows' (o, m, l) to part 0 through shared memory (free: the loop
        // ended on a barrier), value `i` of thread `t` at `128 i + t % 128`.
        let slots = shared::<f32>();
        let at = |i: usize| unsafe { slots.add(128 * i + (thread() % 128) as usize) };
        if part == 1 {
            for n in 0..8 {
                for e in 0..4 {
                    unsafe { *at(4 * n + e) = o[n][e] };
                }
            }
            for half in 0..2 {
                unsafe { (*at(32 + half), *at(34 + half)) = (m[half], l[half]) };
            }
        }
        sync_threads();
        if part == 1 {
            return;
        }
        // Part 0's max is finite in every row of a warp with rows (its first tile holds key
        // 0); part 1's may be -inf (it then weighs 0).
        let mut f = [[0.0f32; 2]; 2];
        for half in 0..2 {
            let (m1, l1) = unsafe { (*at(32 + half), *at(34 + half)) };
            let mx = m[half].max(m1);
            f[half] = [exp(m[half] - mx), exp(m1 - mx)];
            l[half] = fma(l[half], f[half][0], l1 * f[half][1]);
        }
        for n in 0..8 {
            for e in 0..4 {
                let o1 = unsafe { *at(4 * n + e) };
                o[n][e] = fma(o[n][e], f[e / 2][0], o1 * f[e / 2][1]);
            }
        }
    }
    if !warp_rows {
        return;
    }
    for half in 0..2 {
        l[half] += shfl_xor(l[half], 1);
        l[half] += shfl_xor(l[half], 2);
    }
    // Rows g and g + 8, dims `64 dp + 8 n + 2 c` and `+1`.
    for half in 0..2 {
        let r = wrow0 + g + 8 * half as u32;
        if r >= rows {
            continue;
        }
        let at = unsafe { out.add(r as usize * q_dim + (h * hd) as usize) };
        let inv = 1.0 / l[half];
        for n in 0..8 {
            let d = 64 * dp + 8 * n as u32 + 2 * c;
            let v = [o[n][2 * half] * inv, o[n][2 * half + 1] * inv];
            if VEC {
                unsafe { store_n(at.add(d as usize), v) };
            } else {
                for (e, v) in v.iter().enumerate() {
                    if d + (e as u32) < hd {
                        unsafe { *at.add(d as usize + e) = *v };
                    }
                }
            }
        }
    }
}
