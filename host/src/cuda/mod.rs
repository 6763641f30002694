//! The CUDA device layer: device 0, the embedded PTX loaded once, device buffers and one typed
//! launch helper per kernel. Built on cudarc with dynamic loading, so the library compiles
//! and its CPU parts run on machines without CUDA.
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, ValidAsZeroBits, sys,
};

use crate::{Error, Result};
use kernels::{DevPtr, DevPtrMut};

mod attention;
pub mod batch;
pub mod decode;
pub mod decode_pipeline;
mod gemm_rows;
mod kernels;
mod matmul;
pub mod model;
pub mod paged;
pub mod sample_rows;
mod sampling;

pub use attention::AttentionSums;
pub use decode::{BoundedArgmax, StepEnd};
pub use gemm_rows::gemm_rows_scratch;
pub use matmul::GpuMatrix;

/// Threads per block of the row-per-block and row-per-warp kernels.
const BLOCK: u32 = 256;

/// An open CUDA device with the kernels loaded and one stream that every launch goes to.
/// Launch helpers for each kernel family live in this module's files, as `impl Device` blocks.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Every entry point that `kernel_abi::kernels!` declares, by name.
    kernels: HashMap<&'static str, CudaFunction>,
    /// Whether kernels may be launched to overlap the one before them (programmatic dependent
    /// launch: sm_90 and later, with the sm_90 PTX).
    overlap: bool,
}

/// Every declared entry point (`kernels::ENTRIES`), looked up once in `module`.
fn load_kernels(module: &Arc<CudaModule>) -> Result<HashMap<&'static str, CudaFunction>> {
    kernels::ENTRIES
        .iter()
        .map(|&name| {
            let f = module
                .load_function(name)
                .map_err(|e| Error::Cuda(format!("loading kernel {name}: {e}")))?;
            Ok((name, f))
        })
        .collect()
}

/// Where the blocks that share a unit of a kernel's work meet (the key splits of
/// `paged_attention`, the parts of K of `matmul_rows`): their partial results, and a count per
/// unit by which the last block to finish knows to add them up. The counts start at zero and
/// every launch leaves them so.
pub struct SplitScratch {
    part: CudaSlice<f32>,
    counts: CudaSlice<u32>,
}

/// Reads a device's memory in use from any thread, while another thread runs its work.
#[derive(Clone)]
pub struct MemoryGauge(Arc<CudaContext>);

impl MemoryGauge {
    /// Bytes of device memory in use as the driver counts them, total less free: this
    /// process's allocations, its context's own, and any other process's on the device.
    pub fn used(&self) -> Result<u64> {
        // Not `CudaContext::mem_get_info`: that takes (and clears) an error the context has
        // recorded, which is the running thread's to see.
        // SAFETY: the context is alive as long as the `Arc`; making it current on this thread
        // changes nothing for the threads that use it.
        unsafe { cudarc::driver::result::ctx::set_current(self.0.cu_ctx()) }?;
        let (free, total) = cudarc::driver::result::mem_get_info()?;
        Ok(total.saturating_sub(free) as u64)
    }
}

/// Whether a CUDA device can be opened here, without opening it.
pub fn is_available() -> bool {
    // SAFETY: only tries to load libcuda; nothing is called through it.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    driver && CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// Whether a kernel may start before the kernel launched before it has finished
/// (programmatic dependent launch, on sm_90 and newer): see [`Device::launch_raw`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overlap {
    /// It starts after the kernel before it has finished.
    Serial,
    /// It may start early: each thread calls `wait_prior_grids` before it writes memory or
    /// reads what the kernel before may write.
    Allowed,
}

impl Device {
    /// Opens device `ordinal` and loads the kernels: the sm_90 build on Hopper and later, else
    /// the sm_80 build. Errors, never panics, when there is no driver (`no CUDA driver found`)
    /// or no device (`no CUDA device`).
    pub fn open(ordinal: usize) -> Result<Device> {
        Self::open_with(ordinal, false)
    }

    /// Opens device `ordinal` with the sm_80 build of the kernels whatever the GPU, as a GPU
    /// before Hopper runs them (no programmatic dependent launch): to check that build on a
    /// newer GPU.
    pub fn open_sm80(ordinal: usize) -> Result<Device> {
        Self::open_with(ordinal, true)
    }

    fn open_with(ordinal: usize, sm80: bool) -> Result<Device> {
        // SAFETY: as in `is_available`.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::NoCudaDriver);
        }
        match CudaContext::device_count() {
            Ok(n) if n as usize > ordinal => {}
            _ => return Err(Error::NoCudaDevice),
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all the work, so cudarc's cross-stream event tracking is pure cost.
        // SAFETY: called before any buffer or stream of this context exists.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own (not the legacy default stream) so that work can be captured
        // into CUDA graphs.
        let stream = ctx.new_stream()?;
        let overlap = !sm80 && ctx.compute_capability()?.0 >= 9;
        let ptx = if overlap {
            crate::ptx_sm90()
        } else {
            crate::ptx()
        };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| Error::Cuda(format!("loading the PTX failed: {e}")))?;
        let kernels = load_kernels(&module)?;
        Ok(Device {
            ctx,
            stream,
            kernels,
            overlap,
        })
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String> {
        Ok(self.ctx.name()?)
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// A `SplitScratch` of `part` floats and `counts` counts (each at least one).
    fn split_scratch(&self, part: usize, counts: usize) -> Result<SplitScratch> {
        Ok(SplitScratch {
            part: self.zeros(part.max(1))?,
            counts: self.zeros(counts.max(1))?,
        })
    }

    /// A handle that reads the memory in use from other threads.
    pub fn memory_gauge(&self) -> MemoryGauge {
        MemoryGauge(self.ctx.clone())
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Copies `src` into the start of `dst`.
    pub fn copy_to<T: DeviceRepr>(&self, dst: &mut impl DevicePtrMut<T>, src: &[T]) -> Result<()> {
        check(src.len() <= dst.len(), "copy_to: lengths")?;
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(src)?)
    }

    /// `len` values of page-locked host memory: a copy into it is asynchronous, so the host
    /// can wait for that copy alone (an event after it) while later work runs.
    pub(crate) fn pinned<T: DeviceRepr>(&self, len: usize) -> Result<PinnedHostSlice<T>> {
        // SAFETY: the values are only read after a copy into them has completed. Flags 0:
        // cached (not write-combined) memory, as the host reads it.
        Ok(unsafe { self.ctx.alloc_pinned_with_flags(len, 0) }?)
    }

    /// An event, for the host to wait on one point of the stream.
    pub(crate) fn event(&self) -> Result<CudaEvent> {
        Ok(self.ctx.new_event(None)?)
    }

    /// The function of entry point `entry` (all were loaded at `open`).
    pub(crate) fn function<K>(&self, entry: kernels::Entry<K>) -> &CudaFunction {
        self.kernel(entry.name())
    }

    /// The function of the entry point called `name`, one of `kernels::ENTRIES`.
    fn kernel(&self, name: &str) -> &CudaFunction {
        self.kernels
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is not declared"))
    }

    /// The stream every launch goes to.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all launched work; a kernel fault surfaces here.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// `out[r] = rms_norm(x[r]) * w` for every `w.len()`-long row. Twin: `cpu::rms_norm`.
    pub fn rms_norm(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let n = w.len();
        check(
            x.len() == out.len() && n > 0 && x.len() % n == 0,
            "rms_norm: shapes",
        )?;
        let rows = (x.len() / n) as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: kernel_abi::BLOCK_SUM_BYTES,
        };
        let s = &self.stream;
        let (out, _o) = DevPtrMut::of(out, s);
        let (x, _x) = DevPtr::of(x, s);
        let (w, _w) = DevPtr::of(w, s);
        let n = n as u32;
        let p = kernels::RmsNorm { out, x, w, n, eps };
        // SAFETY: it touches `rows * n` elements of out and x and `n` of w, all checked above.
        unsafe { p.launch(self, kernels::RmsNorm::rms_norm, cfg, Overlap::Serial) }
    }

    /// Launches entry point `name` with `cfg` on the stream; with `Overlap::Allowed`,
    /// overlapping the kernel before it where the device can: programmatic dependent launch,
    /// whose blocks start while the kernel before still runs and load what that kernel does not
    /// write (their weights, and what earlier kernels wrote) until `wait_prior_grids`
    /// (gpu-kernels' util.rs) returns. In a CUDA graph this hides most of a launch's latency.
    /// The typed launchers (`kernels`) call it.
    ///
    /// # Safety
    /// `params` must point to the kernel's parameters, in order, each valid until the call
    /// returns, and every pointer among them valid for what the kernel does with `cfg`. With
    /// `Overlap::Allowed`, its blocks may start once every block of the kernel launched before
    /// it has called `allow_next_grid` or exited; kernels call it only after their own
    /// `wait_prior_grids`, so all the kernels before that one have finished: each thread must
    /// call `wait_prior_grids` before it writes memory, or reads memory that the kernel
    /// launched just before it may write.
    pub(crate) unsafe fn launch_raw(
        &self,
        name: &str,
        params: &mut [*mut c_void],
        cfg: LaunchConfig,
        overlap: Overlap,
    ) -> Result<()> {
        let s = &self.stream;
        self.ctx.bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(overlap == Overlap::Allowed && self.overlap),
        };
        // SAFETY: the config and attribute outlive the call; the parameters are the kernel's
        // and live until the launch (the caller's contract); the function is of this context.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.kernel(name).cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        Ok(r.result()?)
    }
}

/// Lets `f`'s blocks have `bytes` of dynamic shared memory where that is more than a block gets
/// without asking (48 KiB).
pub(crate) fn allow_shared(f: &CudaFunction, bytes: u32) -> Result<()> {
    if bytes > 48 << 10 {
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
    }
    Ok(())
}

/// `n` as a kernel's `u32` size, or an error naming `what`.
pub(crate) fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Invalid(format!("{what}: {n} is too large for a kernel")))
}

pub(crate) fn check(ok: bool, what: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!("{what} do not match")))
    }
}

#[cfg(test)]
mod tests {
    /// The kernel that a line of PTX opens (`.visible .entry NAME(`), if it opens one.
    fn entry_name(line: &str) -> Option<&str> {
        line.strip_prefix(".visible .entry ")?.split('(').next()
    }

    /// The kernels of `ptx` that keep a frame in local memory (a `.local` declaration).
    fn kernels_with_local_memory(ptx: &str) -> Vec<&str> {
        let mut kernel = None;
        let mut found = Vec::new();
        for line in ptx.lines() {
            if let Some(name) = entry_name(line) {
                kernel = Some(name);
            } else if line.trim_start().starts_with(".local")
                && let Some(k) = kernel
            {
                found.push(k);
            }
        }
        found
    }

    /// No kernel keeps arrays in local memory: a zip over two arrays in the norm kernels'
    /// staging once put 80 bytes there, on the decode step's critical path (removing it made
    /// decode 23% faster). Reads the embedded PTX: no GPU needed.
    #[test]
    fn no_kernel_uses_local_memory() {
        let frame = ".visible .entry slow(\n)\n{\n\t.local .align 8 .b8 \t__local_depot0[80];\n}\n";
        assert_eq!(kernels_with_local_memory(frame), ["slow"]);
        for (build, ptx) in [("sm_80", crate::ptx()), ("sm_90", crate::ptx_sm90())] {
            let found = kernels_with_local_memory(&ptx);
            assert!(
                found.is_empty(),
                "{build} kernels with local memory: {found:?}"
            );
        }
    }

    /// The entry points of both PTX builds are those that `kernel_abi::kernels!` declares
    /// (gpu-kernels expands its entry points from the same list): a kernel written outside the
    /// declarations fails here. Reads the embedded PTX: no GPU needed.
    #[test]
    fn every_kernel_is_declared_and_in_the_ptx() {
        let mut declared = super::kernels::ENTRIES.to_vec();
        declared.sort_unstable();
        for (build, ptx) in [("sm_80", crate::ptx()), ("sm_90", crate::ptx_sm90())] {
            let mut entries: Vec<&str> = ptx.lines().filter_map(entry_name).collect();
            entries.sort_unstable();
            assert_eq!(
                entries, declared,
                "{build}: the PTX's entry points and the declared"
            );
        }
    }

    /// CUDA's PTX assembler accepts both builds for their targets: PTX that the driver's JIT
    /// would refuse at run time (an instruction or modifier that the PTX version rustc writes
    /// cannot spell) fails here, without a GPU. `ORCD_PTXAS` names ptxas, else the PATH's;
    /// without one the test says it is skipped.
    #[test]
    fn ptx_assembles_for_its_targets() {
        use std::process::Command;
        let ptxas = std::env::var_os("ORCD_PTXAS").unwrap_or_else(|| "ptxas".into());
        if Command::new(&ptxas).arg("--version").output().is_err() {
            println!(
                "skipped: no ptxas (ORCD_PTXAS or the PATH; the nvidia-cuda-nvcc wheels have one)"
            );
            return;
        }
        let dir = std::env::temp_dir().join(format!("orcd-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (arch, ptx) in [("sm_80", crate::ptx()), ("sm_90", crate::ptx_sm90())] {
            let src = dir.join(format!("{arch}.ptx"));
            std::fs::write(&src, &ptx).unwrap();
            let out = Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg(&src)
                .arg("-o")
                .arg(dir.join(format!("{arch}.cubin")))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ptxas -arch={arch}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
