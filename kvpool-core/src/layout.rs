//! The KV layout of a model (layers, heads, dtype, K+V or MLA) and its stable fingerprint.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// A KV layout or a key could not be built or parsed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// A dimension of the layout was zero.
    #[error("invalid KV layout: `{field}` must be greater than zero")]
    ZeroDimension {
        /// The offending field name.
        field: &'static str,
    },
    /// The dtype string is not one kvpool knows.
    #[error("unknown dtype `{0}`: expected one of f16, bf16, f32, fp8_e4m3, fp8_e5m2")]
    UnknownDtype(String),
    /// The TP rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank given.
        rank: u32,
        /// The world size given.
        world_size: u32,
    },
    /// The model name is too long to be part of a key.
    #[error(
        "model name of {len} bytes is too long for a key (at most {max}); use a shorter `[model] name`"
    )]
    ModelNameTooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }

    /// Stable numeric code, used in fingerprints and the chunk header.
    pub const fn code(self) -> u8 {
        match self {
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
            Dtype::F32 => 3,
            Dtype::Fp8E4m3 => 4,
            Dtype::Fp8E5m2 => 5,
        }
    }

    /// Inverse of [`Dtype::code`].
    pub const fn from_code(code: u8) -> Option<Dtype> {
        match code {
            1 => Some(Dtype::F16),
            2 => Some(Dtype::Bf16),
            3 => Some(Dtype::F32),
            4 => Some(Dtype::Fp8E4m3),
            5 => Some(Dtype::Fp8E5m2),
            _ => None,
        }
    }

    /// Canonical lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "float16" | "half" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f32" | "float32" | "float" => Ok(Dtype::F32),
            "fp8_e4m3" | "fp8" | "float8_e4m3fn" => Ok(Dtype::Fp8E4m3),
            "fp8_e5m2" | "float8_e5m2" => Ok(Dtype::Fp8E5m2),
            other => Err(LayoutError::UnknownDtype(other.to_string())),
        }
    }
}

/// Whether each layer stores separate K and V, or one MLA latent vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvKind {
    /// Separate key and value tensors per layer (standard MHA/GQA).
    KeyValue,
    /// A single compressed latent per token per layer (DeepSeek MLA).
    MlaLatent,
}

impl KvKind {
    /// Number of tensors per layer: 2 for K+V, 1 for MLA.
    pub const fn planes(self) -> usize {
        match self {
            KvKind::KeyValue => 2,
            KvKind::MlaLatent => 1,
        }
    }
}

/// The shape of a model's KV cache as kvpool stores it.
///
/// A chunk of `n` tokens is stored layer-major: for each layer, each plane (K then V, or the
/// single MLA latent), `n` rows of `kv_heads * head_size` elements. Layer-major order lets a
/// layer-wise transfer touch one contiguous region per layer.
///
/// ```
/// use kvpool_core::{Dtype, KvKind, KvLayout};
/// let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
/// assert_eq!(layout.bytes_per_token(), 2 * 32 * 8 * 128 * 2);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvLayout {
    /// Transformer layers.
    pub num_layers: usize,
    /// KV heads per layer on this rank (1 for MLA).
    pub num_kv_heads: usize,
    /// Elements per head (latent width for MLA).
    pub head_size: usize,
    /// Element type.
    pub dtype: Dtype,
    /// K+V or MLA latent.
    pub kind: KvKind,
    /// Tokens per engine page ("block").
    pub block_size: usize,
}

impl Default for KvLayout {
    /// A small 8-layer GQA model in bf16 (32 KiB per token; 8 MiB per 256-token chunk).
    fn default() -> Self {
        KvLayout {
            num_layers: 8,
            num_kv_heads: 8,
            head_size: 128,
            dtype: Dtype::Bf16,
            kind: KvKind::KeyValue,
            block_size: 16,
        }
    }
}

impl KvLayout {
    /// Builds a layout, rejecting zero dimensions.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: Dtype,
        kind: KvKind,
        block_size: usize,
    ) -> Result<Self, LayoutError> {
        let layout = KvLayout {
            num_layers,
            num_kv_heads,
            head_size,
            dtype,
            kind,
            block_size,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// Checks every dimension is non-zero.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_size", self.head_size),
            ("block_size", self.block_size),
        ] {
            if v == 0 {
                return Err(LayoutError::ZeroDimension { field });
            }
        }
        Ok(())
    }

    /// Bytes of one token's row in one plane of one layer.
    pub const fn bytes_per_token_per_plane(&self) -> usize {
        self.num_kv_heads * self.head_size * self.dtype.size_bytes()
    }

    /// Bytes of one token in one layer (all planes).
    pub const fn bytes_per_token_per_layer(&self) -> usize {
        self.kind.planes() * self.bytes_per_token_per_plane()
    }

    /// Bytes of one token across all layers.
    pub const fn bytes_per_token(&self) -> usize {
        self.num_layers * self.bytes_per_token_per_layer()
    }

    /// Bytes of a chunk of `tokens` tokens.
    pub const fn chunk_bytes(&self, tokens: usize) -> usize {
        tokens * self.bytes_per_token()
    }

    /// Stable 64-bit fingerprint of everything that changes the meaning of stored bytes.
    ///
    /// It is xxh3-64 (seed 0) of a fixed little-endian encoding, so it is the same on every
    /// process and machine. The engine block size is left out: it changes how the engine pages
    /// KV, not the bytes kvpool stores per token.
    pub fn fingerprint(&self) -> u64 {
        let mut buf = Vec::with_capacity(40);
        buf.extend_from_slice(b"kvpool.layout.v1");
        buf.extend_from_slice(&(self.num_layers as u64).to_le_bytes());
        buf.extend_from_slice(&(self.num_kv_heads as u64).to_le_bytes());
        buf.extend_from_slice(&(self.head_size as u64).to_le_bytes());
        buf.push(self.dtype.code());
        buf.push(self.kind.planes() as u8);
        xxhash_rust::xxh3::xxh3_64(&buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_token_counts_planes_and_dtype() {
        let kv = KvLayout::new(4, 2, 64, Dtype::F16, KvKind::KeyValue, 16).unwrap();
        assert_eq!(kv.bytes_per_token(), 4 * 2 * 2 * 64 * 2);
        let mla = KvLayout::new(4, 1, 576, Dtype::Bf16, KvKind::MlaLatent, 64).unwrap();
        assert_eq!(mla.bytes_per_token(), 4 * 576 * 2);
        assert_eq!(mla.chunk_bytes(256), 256 * 4 * 576 * 2);
    }

    #[test]
    fn zero_dimension_is_rejected() {
        let err = KvLayout::new(0, 2, 64, Dtype::F16, KvKind::KeyValue, 16).unwrap_err();
        assert_eq!(
            err,
            LayoutError::ZeroDimension {
                field: "num_layers"
            }
        );
    }

    #[test]
    fn fingerprint_is_pinned_and_sensitive() {
        let a = KvLayout::new(32, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
        // Pinned: a change here silently orphans every stored chunk.
        assert_eq!(a.fingerprint(), PINNED_FP);
        let mut b = a;
        b.dtype = Dtype::F16;
        assert_ne!(a.fingerprint(), b.fingerprint());
        let mut c = a;
        c.kind = KvKind::MlaLatent;
        assert_ne!(a.fingerprint(), c.fingerprint());
        let mut d = a;
        d.block_size = 32;
        assert_eq!(a.fingerprint(), d.fingerprint());
    }

    // Computed independently with Python's `xxhash`: xxh3_64_intdigest(b"kvpool.layout.v1" +
    // struct.pack("<QQQ", 32, 8, 128) + bytes([2, 2])).
    const PINNED_FP: u64 = 10941389482625150881;

    #[test]
    fn dtype_parses_and_round_trips_codes() {
        for d in [
            Dtype::F16,
            Dtype::Bf16,
            Dtype::F32,
            Dtype::Fp8E4m3,
            Dtype::Fp8E5m2,
        ] {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
            assert_eq!(Dtype::from_code(d.code()), Some(d));
        }
        assert!("int4".parse::<Dtype>().is_err());
    }
}
