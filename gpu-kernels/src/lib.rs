//! orcd's GPU kernels, written in Rust and compiled to one PTX file by `host/build.rs`.
//!
//! Every kernel here has a CPU twin in `orcd::cpu` with the same name and a GPU test that
//! compares the two. Conventions: pointers are raw device pointers, sizes are `u32`,
//! matrices are row-major, weights in f16 are passed as their `u16` bits.
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

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // No unwinding and no printing on the GPU: stop the kernel, the host sees a launch error.
    unsafe { core::arch::nvptx::trap() }
}
