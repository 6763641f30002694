//! One typed launcher per kernel, expanded from the declarations in `kernel_abi::kernels!`
//! that gpu-kernels expands its entry points from: a struct whose fields are the kernel's
//! parameters, named and typed (a device pointer `*mut T` / `*const T` as a [`DevPtrMut<T>`] /
//! [`DevPtr<T>`]), a constant per entry point, and `launch`. A launch site names every
//! parameter, and the compiler checks their count and types against the kernel's.
//!
//! ```text
//! let p = kernels::RmsNorm { out, x, w, n, eps };
//! // SAFETY: what the kernel reads and writes is in bounds (the sizes checked above).
//! unsafe { p.launch(dev, kernels::RmsNorm::rms_norm, cfg, false) }?;
//! ```
use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop};

use super::{Device, Overlap};
use crate::Result;

/// The device address of `T`s that a kernel reads, a `*const T` parameter: a `u64`, passed as
/// the pointer is. Null where the kernel's declaration says it may be.
#[repr(transparent)]
pub(crate) struct DevPtr<T> {
    addr: u64,
    elem: PhantomData<fn() -> T>,
}

/// The device address of `T`s that a kernel writes (and may read), a `*mut T` parameter.
#[repr(transparent)]
pub(crate) struct DevPtrMut<T> {
    addr: u64,
    elem: PhantomData<fn() -> T>,
}

// SAFETY: both are a `u64` (`repr(transparent)`), which is how a kernel takes a pointer.
unsafe impl<T> DeviceRepr for DevPtr<T> {}
unsafe impl<T> DeviceRepr for DevPtrMut<T> {}

macro_rules! dev_ptr_common {
    ($P:ident) => {
        impl<T> Clone for $P<T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $P<T> {}

        impl<T> std::fmt::Debug for $P<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({:#x})", stringify!($P), self.addr)
            }
        }

        impl<T> $P<T> {
            /// The address `addr`.
            pub(crate) fn from_addr(addr: u64) -> Self {
                $P {
                    addr,
                    elem: PhantomData,
                }
            }

            /// The null pointer.
            pub(crate) fn null() -> Self {
                Self::from_addr(0)
            }

            /// Whether the address is a multiple of `bytes`.
            pub(crate) fn is_aligned(self, bytes: u64) -> bool {
                self.addr.is_multiple_of(bytes)
            }

            /// The same address, as `U`s.
            pub(crate) fn cast<U>(self) -> $P<U> {
                $P::from_addr(self.addr)
            }
        }
    };
}

dev_ptr_common!(DevPtr);
dev_ptr_common!(DevPtrMut);

impl<T> DevPtr<T> {
    /// The start of `buf`, and the guard that keeps it usable on `stream` until it drops (after
    /// the launch).
    pub(crate) fn of<'s, B: DevicePtr<T> + ?Sized>(
        buf: &'s B,
        stream: &'s CudaStream,
    ) -> (Self, SyncOnDrop<'s>) {
        let (addr, guard) = buf.device_ptr(stream);
        (Self::from_addr(addr), guard)
    }
}

impl<T> DevPtrMut<T> {
    /// As [`DevPtr::of`], for a buffer the kernel writes.
    pub(crate) fn of<'s, B: DevicePtrMut<T> + ?Sized>(
        buf: &'s mut B,
        stream: &'s CudaStream,
    ) -> (Self, SyncOnDrop<'s>) {
        let (addr, guard) = buf.device_ptr_mut(stream);
        (Self::from_addr(addr), guard)
    }

    /// The address `n` elements on.
    pub(crate) fn add(self, n: usize) -> Self {
        Self::from_addr(self.addr + (n * size_of::<T>()) as u64)
    }

    /// The same address, for a kernel that only reads it.
    pub(crate) fn as_const(self) -> DevPtr<T> {
        DevPtr::from_addr(self.addr)
    }
}

/// The host's type for a kernel parameter of type `Self` (as the declaration spells it).
pub(crate) trait KernelParam {
    type Host: DeviceRepr + Copy;
}

impl<T> KernelParam for *mut T {
    type Host = DevPtrMut<T>;
}

impl<T> KernelParam for *const T {
    type Host = DevPtr<T>;
}

macro_rules! scalar_params {
    ($($t:ty),*) => {
        $(impl KernelParam for $t {
            type Host = $t;
        })*
    };
}

scalar_params!(u32, u64, f32);

/// A launcher's field for a kernel parameter of type `T`: `Param<*const f32>` is a
/// `DevPtr<f32>`, `Param<u32>` a `u32`.
pub(crate) type Param<T> = <T as KernelParam>::Host;

/// An entry point of kernel `K` in the PTX (a kernel built several times has several).
pub(crate) struct Entry<K> {
    name: &'static str,
    kernel: PhantomData<fn() -> K>,
}

impl<K> Clone for Entry<K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Entry<K> {}

impl<K> std::fmt::Debug for Entry<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl<K> Entry<K> {
    const fn new(name: &'static str) -> Self {
        Entry {
            name,
            kernel: PhantomData,
        }
    }

    /// Its name in the PTX.
    pub(crate) fn name(self) -> &'static str {
        self.name
    }
}

/// Expands `kernel_abi::kernels!` into the launchers, and [`ENTRIES`], every entry point.
macro_rules! launchers {
    ($($(#[$doc:meta])* $K:ident $params:tt => $($body:ident)::+ {
        $($entry:ident $(= $key:expr)?),+ $(,)?
    })*) => {
        $(launchers!(@kernel [$(#[$doc])*] $K $params $($entry $(= $key)?),+);)*

        /// Every entry point that the kernels declare, as the PTX names them.
        pub(crate) const ENTRIES: &[&str] = &[$($(stringify!($entry)),+),*];
    };
    (@kernel [$(#[$doc:meta])*] $K:ident ($($p:ident: $t:ty),* $(,)?)
        $($entry:ident $(= $key:expr)?),+) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $K {
            $(pub(crate) $p: Param<$t>),*
        }

        #[allow(non_upper_case_globals)]
        impl $K {
            $(pub(crate) const $entry: Entry<$K> = Entry::new(stringify!($entry));)+

            /// The entry point of key `key`, if the kernel has one.
            #[allow(dead_code)]
            pub(crate) fn entry(key: u32) -> Option<Entry<$K>> {
                $($(if key == $key {
                    return Some(Self::$entry);
                })?)+
                let _ = key;
                None
            }

            /// Launches entry point `entry` with these parameters on `dev`'s stream, with
            /// `overlap` as [`Device::launch_raw`] says.
            ///
            /// # Safety
            /// Every pointer must be valid for what the kernel does with `cfg` (its
            /// declaration's doc), and `overlap` allowed by where it waits for the kernel
            /// before it.
            pub(crate) unsafe fn launch(
                &self,
                dev: &Device,
                entry: Entry<$K>,
                cfg: LaunchConfig,
                overlap: Overlap,
            ) -> Result<()> {
                let mut params = [$(&self.$p as *const Param<$t> as *mut c_void),*];
                // SAFETY: the parameters are the kernel's, in its order (its declaration's),
                // and live until the launch; the rest is the caller's.
                unsafe { dev.launch_raw(entry.name, &mut params, cfg, overlap) }
            }
        }
    };
}

kernel_abi::kernels!(launchers);
