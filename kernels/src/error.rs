//! The one error type of the kernel launches: what was wrong with the input, named.

/// Why a public kernel launch refused its input. Every variant names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A buffer's length disagrees with the shape it was given for.
    #[error("{what}: buffer holds {got} elements, the shape needs {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A dimension is not a multiple of what the format or kernel requires.
    #[error("{what} = {value} must be a multiple of {multiple}")]
    Alignment {
        what: &'static str,
        value: usize,
        multiple: usize,
    },
    /// A dimension is out of the range the kernel supports.
    #[error("{what} = {value} is out of range (allowed {min}..={max})")]
    Range {
        what: &'static str,
        value: usize,
        min: usize,
        max: usize,
    },
    /// Operands that must agree (a gate and its up projection) do not.
    #[error("{what} differ: {detail}")]
    Mismatch { what: &'static str, detail: String },
    /// The device cannot do what the kernel needs (a dtype, an instruction).
    #[error("{device} does not support {feature}")]
    Unsupported { feature: String, device: String },
}
