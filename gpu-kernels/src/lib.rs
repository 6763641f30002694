//! orcd's GPU kernels, written in Rust and compiled to one PTX file by `host/build.rs`.
//!
//! Every kernel here has a CPU twin in `orcd::cpu` with the same name and a GPU test that
//! compares the two. Conventions: pointers are raw device pointers, sizes are `u32`,
//! matrices are row-major, weights in f16 are passed as their `u16` bits.
//!
//! Each kernel's parameters are declared once, in `kernel_abi::kernels!`, which the host reads
//! too; this crate's entry points are expanded from it below (see `docs/kernels.md`).
#![no_std]
#![feature(
    abi_gpu_kernel,
    stdarch_nvptx,
    link_llvm_intrinsics,
    gpu_intrinsics,
    gpu_launch_sized_workgroup_mem,
    core_intrinsics,
    f16,
    asm_experimental_arch
)]
#![allow(internal_features, clippy::missing_safety_doc)]

pub mod attention;
pub mod decode;
pub mod elementwise;
pub mod gemm_rows;
pub mod matmul;
pub mod norm;
pub mod paged;
pub mod quant;
pub mod rope;
pub mod sample_rows;
pub mod sampling;

mod util;

/// Expands `kernel_abi::kernels!`: each kernel's parameters as a struct in [`params`], and each
/// entry point as an `extern "gpu-kernel"` function that takes them one by one, as the host
/// passes them, and calls the kernel's body with the struct (and with the entry's key as the
/// body's const generic argument, where it has one). Every body is `#[inline(always)]`: the
/// PTX is the body's, its parameters the declaration's.
macro_rules! entry_points {
    ($($(#[$doc:meta])* $K:ident $params:tt => $($body:ident)::+ {
        $($entry:ident $(= $key:expr)?),+ $(,)?
    })*) => {
        /// Each kernel's parameters, as `kernel_abi::kernels!` declares them.
        pub mod params {
            $(entry_points!(@params [$(#[$doc])*] $K $params);)*
        }
        $(entry_points!(@entries [$(#[$doc])*] $K $params [$($body)::+] $($entry $(= $key)?),+);)*
    };
    (@params [$(#[$doc:meta])*] $K:ident ($($p:ident: $t:ty),* $(,)?)) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $K {
            $(pub $p: $t),*
        }
    };
    (@entries $docs:tt $K:ident $params:tt $body:tt $($entry:ident $(= $key:expr)?),+) => {
        $(entry_points!(@entry $docs $K $params $body $entry $($key)?);)+
    };
    (@entry [$(#[$doc:meta])*] $K:ident ($($p:ident: $t:ty),* $(,)?) [$($body:ident)::+]
        $entry:ident $($key:expr)?) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "gpu-kernel" fn $entry($($p: $t),*) {
            unsafe { $($body)::+$(::<{ $key }>)?(params::$K { $($p),* }) }
        }
    };
}

kernel_abi::kernels!(entry_points);

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // No unwinding and no printing on the GPU: stop the kernel, the host sees a launch error.
    unsafe { core::arch::nvptx::trap() }
}
