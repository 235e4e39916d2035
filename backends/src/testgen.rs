//! `backend_tests!`: one `#[test]` per enabled backend (and dtype) from a generic body.
//!
//! ```ignore
//! kiln_backends::backend_tests! {
//!     // fn small_shapes<R: cubecl::Runtime>(client: &cubecl::prelude::ComputeClient<R>)
//!     small_shapes,
//!     // fn gemm<R: Runtime, F: Float + CubeElement>(client: &ComputeClient<R>)
//!     gemm [f32, bf16],
//! }
//! ```
//! expands to `wgpu::small_shapes`, `wgpu::gemm::f32`, `wgpu::gemm::bf16` and the same under
//! `cuda::` and `cuda_routed::` (CUDA with kiln's launcher) for the backends the calling
//! crate enables through its `wgpu` / `cuda` features.
//! A dtype the device cannot store is an explicit, logged skip, not a pass in silence.

/// Stamps out the tests; see the module docs.
#[macro_export]
macro_rules! backend_tests {
    ($($body:ident $([$($dtype:ident),+ $(,)?])?),* $(,)?) => {
        #[cfg(feature = "wgpu")]
        mod wgpu {
            $crate::backend_tests!(@backend $crate::Wgpu; $($body $([$($dtype),+])?),*);
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $crate::backend_tests!(@backend $crate::Cuda; $($body $([$($dtype),+])?),*);
        }
        #[cfg(feature = "cuda")]
        mod cuda_routed {
            $crate::backend_tests!(@backend $crate::CudaRouted; $($body $([$($dtype),+])?),*);
        }
    };
    (@backend $backend:path; $($body:ident $([$($dtype:ident),+])?),*) => {
        $($crate::backend_tests!(@one $backend; $body $([$($dtype),+])?);)*
    };
    (@one $backend:path; $body:ident) => {
        #[test]
        fn $body() {
            let client = <$backend as $crate::Backend>::client();
            super::$body(&client);
        }
    };
    (@one $backend:path; $body:ident [$($dtype:ident),+]) => {
        mod $body {
            #[allow(unused_imports)]
            use super::super::*;
            $(
                #[test]
                fn $dtype() {
                    let client = <$backend as $crate::Backend>::client();
                    let ty = <$dtype as cubecl::prelude::CubePrimitive>::as_type_native_unchecked();
                    if !client.properties().supports_type(ty) {
                        eprintln!(
                            "SKIP {}::{}: {} cannot hold {}",
                            stringify!($body),
                            stringify!($dtype),
                            <$backend as $crate::Backend>::KIND,
                            stringify!($dtype)
                        );
                        return;
                    }
                    super::super::$body::<_, $dtype>(&client);
                }
            )+
        }
    };
}
