//! What a device is and what it can do, as `kiln info` and `kiln check` print it.
use std::collections::BTreeSet;
use std::fmt;

use cubecl::prelude::*;

use crate::BackendKind;

/// A device's identity and the capabilities kiln's kernels care about.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceReport {
    pub backend: BackendKind,
    pub name: String,
    /// `sm_90` on CUDA; the graphics API and adapter type on wgpu.
    pub arch: String,
    /// Tensor-core (cooperative matrix) shapes and types, `a x b -> c mxnxk`.
    pub tensor_cores: Vec<String>,
    pub bf16: bool,
    pub fp8: bool,
    pub fp4: bool,
    /// Block-scaled FP4 MMA: the Blackwell path of `kiln_kernels::blackwell`.
    pub native_fp4_mma: bool,
    pub multiprocessors: Option<u32>,
    pub max_shared_memory: usize,
    pub max_units_per_cube: u32,
}

impl DeviceReport {
    /// Reads the capabilities from a client; `name` and `arch` come from the backend.
    pub fn from_client<R: Runtime>(
        backend: BackendKind,
        name: String,
        arch: String,
        client: &ComputeClient<R>,
    ) -> Self {
        let props = client.properties();
        let tensor_cores: BTreeSet<String> = props
            .features
            .matmul
            .cmma
            .iter()
            .map(|c| {
                format!(
                    "{:?} x {:?} -> {:?} {}x{}x{}",
                    c.a_type, c.b_type, c.cd_type, c.m, c.n, c.k
                )
            })
            .collect();
        DeviceReport {
            backend,
            name,
            arch,
            tensor_cores: tensor_cores.into_iter().collect(),
            bf16: props.supports_type(half::bf16::as_type_native_unchecked()),
            fp8: props.supports_type(cubecl::e4m3::as_type_native_unchecked()),
            fp4: props.supports_type(cubecl::e2m1::as_type_native_unchecked()),
            native_fp4_mma: kiln_kernels::blackwell::supports_native_fp4(client),
            multiprocessors: props.hardware.num_streaming_multiprocessors,
            max_shared_memory: props.hardware.max_shared_memory_size,
            max_units_per_cube: props.hardware.max_units_per_cube,
        }
    }
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes = |b: bool| if b { "yes" } else { "no" };
        writeln!(f, "backend        {}", self.backend)?;
        writeln!(f, "device         {}", self.name)?;
        writeln!(f, "arch           {}", self.arch)?;
        writeln!(
            f,
            "types          bf16 {}, fp8 e4m3 {}, fp4 e2m1 {}, native FP4 MMA {}",
            yes(self.bf16),
            yes(self.fp8),
            yes(self.fp4),
            yes(self.native_fp4_mma)
        )?;
        match self.multiprocessors {
            Some(sms) => writeln!(f, "multiprocessors {sms}")?,
            None => writeln!(f, "multiprocessors unknown")?,
        }
        writeln!(
            f,
            "limits         {} B shared memory, {} units per cube",
            self.max_shared_memory, self.max_units_per_cube
        )?;
        if self.tensor_cores.is_empty() {
            writeln!(f, "tensor cores   none")
        } else {
            writeln!(f, "tensor cores   {}", self.tensor_cores.join("; "))
        }
    }
}
