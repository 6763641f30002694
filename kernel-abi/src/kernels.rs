/// Every kernel's parameters, declared once: `kernel_abi::kernels!(m)` invokes the macro `m`
/// with the list below, and each side expands it its own way. gpu-kernels (its lib.rs) makes
/// each kernel's parameters a struct, `params::Name`, and each entry point an
/// `#[unsafe(no_mangle)] extern "gpu-kernel"` function taking them one by one (so the PTX
/// signature is plain scalars and pointers) that calls the body with the struct. orcd
/// (`cuda::kernels`) makes each kernel a struct of typed fields, `kernels::Name`, pointers as
/// device addresses typed by element, with a `launch` method and a constant per entry point.
///
/// A declaration reads
///
/// ```text
/// /// What it computes. Grid: ..., block: ..., shared: ... (the launch contract).
/// Name(param: Type, ...) => module::body { entry, ... }
/// ```
///
/// `Type` is the kernel's own: `*mut T` or `*const T` (device pointers, `T` a primitive;
/// null where the kernel says it may be), `u32`, `u64` or `f32`. `module::body` is the
/// kernel's body in gpu-kernels, `unsafe fn body(p: params::Name)`. Each `entry` is an entry
/// point of that name in the PTX. A kernel built several times (per weight type or family,
/// per head dim) gives each entry point a key, `entry = KEY` (a `u32` constant): the entry
/// calls `body::<KEY>(p)`, and the host picks an entry by its key.
#[macro_export]
macro_rules! kernels {
    ($m:ident) => {
        $m! {
            /// `out[r, i] = x[r, i] / sqrt(mean(x[r]²) + eps)·w[i]` for every row `r` of `n`
            /// columns. Grid: one block per row; block: a multiple of 32 threads; shared:
            /// `BLOCK_SUM_BYTES`.
            RmsNorm(out: *mut f32, x: *const f32, w: *const f32, n: u32, eps: f32)
                => norm::rms_norm { rms_norm }

            /// `gate[i] = silu(gate[i])·up[i]` for `i < n`, with `silu(g) = g / (1 + e^-g)`
            /// (SwiGLU). Grid: `ceil(n / blockDim)` blocks; any block size; no shared memory.
            SiluMul(gate: *mut f32, up: *const f32, n: u32) => elementwise::silu_mul { silu_mul }

            /// `x[i] += y[i]` for `i < n`, the residual connection. Grid: `ceil(n / blockDim)`
            /// blocks; any block size; no shared memory.
            Add(x: *mut f32, y: *const f32, n: u32) => elementwise::add { add }
        }
    };
}
