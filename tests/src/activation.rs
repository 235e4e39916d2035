//! Activation element types the GEMM takes, with exact conversions to and from f32.
use cubecl::prelude::*;

/// An activation dtype: f32 everywhere, bf16 where the device stores it.
pub trait Activation: Float + CubeElement {
    const NAME: &'static str;
    /// The nearest value of this type (round to nearest even).
    fn round_from(x: f32) -> Self;
    /// The exact f32 value.
    fn exact_f32(self) -> f32;
}

impl Activation for f32 {
    const NAME: &'static str = "f32";
    fn round_from(x: f32) -> Self {
        x
    }
    fn exact_f32(self) -> f32 {
        self
    }
}

impl Activation for half::bf16 {
    const NAME: &'static str = "bf16";
    fn round_from(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn exact_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}
