//! Element types.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// 32-bit signed integer (targets, argmax).
    I32,
    /// 64-bit signed integer (targets).
    I64,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
        }
    }

    /// Whether this is a floating-point type (valid for `e`, `c`, `bias`).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Machine epsilon (distance from 1.0 to the next value): 2⁻²³ f32, 2⁻¹⁰ f16, 2⁻⁷ bf16.
    /// Integer types return `None`.
    pub fn machine_eps(self) -> Option<f32> {
        match self {
            DType::F32 => Some(f32::EPSILON),
            DType::F16 => Some(2f32.powi(-10)),
            DType::BF16 => Some(2f32.powi(-7)),
            DType::I32 | DType::I64 => None,
        }
    }

    /// The original's automatic filter threshold: machine epsilon / 32
    /// (2⁻¹² bf16, 2⁻¹⁵ f16, 2⁻²⁸ f32; CCE paper section 4.3). Integer types return `None`.
    pub fn auto_filter_eps(self) -> Option<f32> {
        self.machine_eps().map(|e| e / 32.0)
    }

    /// The conformance tolerance on values of order 1 (MATH.md): 1e-5 f32, 1e-3 f16, 1e-2 bf16.
    pub fn tolerance(self) -> f64 {
        match self {
            DType::F32 => 1e-5,
            DType::F16 => 1e-3,
            DType::BF16 => 1e-2,
            DType::I32 | DType::I64 => 0.0,
        }
    }

    /// Lower-case name as used on the command line (`f32`, `f16`, `bf16`, `i32`, `i64`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "i32" | "int32" => Ok(DType::I32),
            "i64" | "int64" => Ok(DType::I64),
            other => Err(format!(
                "unknown dtype '{other}' (expected f32, f16, bf16, i32 or i64)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_eps_matches_the_original() {
        assert_eq!(DType::BF16.auto_filter_eps(), Some(2f32.powi(-12)));
        assert_eq!(DType::F16.auto_filter_eps(), Some(2f32.powi(-15)));
        assert_eq!(DType::F32.auto_filter_eps(), Some(2f32.powi(-28)));
        assert_eq!(DType::I64.auto_filter_eps(), None);
    }

    #[test]
    fn parse_round_trips() {
        for d in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64] {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f8".parse::<DType>().is_err());
    }
}
