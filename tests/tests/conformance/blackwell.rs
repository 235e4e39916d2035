//! Blackwell's native FP4 path compiles: [`nvfp4_mma_tile_kernel`]'s CUDA C++ is generated on
//! the host (any machine) and, where `nvcc` is found (`$CUDA_HOME/bin/nvcc`, else
//! `/usr/local/cuda/bin/nvcc`), compiled to a cubin for the Blackwell targets. It cannot run
//! on the H200 (sm_90) nor here: compiling is all this proves.
//!
//! [`nvfp4_mma_tile_kernel`]: kiln_kernels::blackwell::nvfp4_mma_tile_kernel
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_kernels::blackwell::nvfp4_mma_tile_source;
use kiln_kernels::KernelError;

/// The block-scaled NVFP4 MMA as CubeCL writes it (E2M1 operands, f32, UE4M3 scales per 16).
const NVFP4_MMA: &str = "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64\
                         .row.col.f32.e2m1.e2m1.f32.ue4m3";

fn nvcc() -> Option<(PathBuf, PathBuf)> {
    let home =
        std::env::var_os("CUDA_HOME").map_or_else(|| "/usr/local/cuda".into(), PathBuf::from);
    let nvcc = home.join("bin/nvcc");
    nvcc.is_file().then(|| (nvcc, home.join("include")))
}

/// `nvcc -cubin -arch=<arch>` on `source`: `Ok` or ptxas' complaint.
fn compile(nvcc: &Path, include: &Path, source: &Path, arch: &str) -> Result<(), String> {
    let out = Command::new(nvcc)
        .args(["-cubin", &format!("-arch={arch}"), "-I"])
        .arg(include)
        .arg(source)
        .arg("-o")
        .arg(source.with_extension(format!("{arch}.cubin")))
        .output()
        .expect("nvcc runs");
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

#[test]
fn native_fp4_mma_compiles_for_blackwell() {
    let source = nvfp4_mma_tile_source(120).expect("CubeCL offers the NVFP4 MMA on sm_120");
    assert!(
        source.contains(NVFP4_MMA),
        "no block-scaled NVFP4 mma in:\n{source}"
    );
    assert!(
        source.contains("nvfp4_mma_tile_kernel ("),
        "no kernel entry point in:\n{source}"
    );
    // CubeCL 0.10 offers block-scaled mma.sync only for arch 12.x, not for sm_100 (nor sm_90).
    for arch in [90, 100] {
        assert!(matches!(
            nvfp4_mma_tile_source(arch),
            Err(KernelError::Unsupported { .. })
        ));
    }

    let Some((nvcc, include)) = nvcc() else {
        println!("SKIP nvcc: no CUDA toolkit ($CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc); checked the generated source only");
        return;
    };
    let dir = std::env::temp_dir().join(format!("kiln-nvfp4-mma-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("nvfp4_mma_tile.cu");
    std::fs::write(&file, &source).unwrap();
    // Consumer/workstation Blackwell and GB10 have the warp-level block-scaled MMA.
    for arch in ["sm_120a", "sm_121a"] {
        if let Err(log) = compile(&nvcc, &include, &file, arch) {
            panic!("{arch}: nvcc rejected {}:\n{log}", file.display());
        }
        println!("{arch}: compiled");
    }
    // Datacenter Blackwell has block-scaled MMA only as tcgen05.mma (tensor memory), which
    // CubeCL 0.10 cannot emit: ptxas refuses the warp-level form there.
    let log =
        compile(&nvcc, &include, &file, "sm_100a").expect_err("sm_100a took mma.sync block_scale");
    assert!(
        log.contains("'mma with block scale' not supported on .target 'sm_100a'"),
        "sm_100a: unexpected nvcc output:\n{log}"
    );
    let why = log
        .lines()
        .find(|l| l.contains("not supported"))
        .unwrap_or_default();
    println!("sm_100a: rejected as expected: {why}");
    std::fs::remove_dir_all(&dir).unwrap();
}
