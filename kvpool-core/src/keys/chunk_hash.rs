//! Chained, seedless chunk hashes (xxh3-128 by default, SHA-256 selectable).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::cell::Cell;
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

/// A 128-bit chunk hash. It identifies a chunk *and every token before it*: hash_i =
/// H(hash_{i-1} || tokens_i), starting from a fixed root.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkHash(pub [u8; 16]);

impl ChunkHash {
    /// The hash as a big-endian integer (its hex form reads the same).
    pub fn as_u128(&self) -> u128 {
        u128::from_be_bytes(self.0)
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({self})")
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

thread_local! {
    static TOKENS_HASHED: Cell<u64> = const { Cell::new(0) };
}

/// Token ids this thread has chained into chunk hashes so far (to prove in tests that a
/// request's tokens are hashed once between scheduler and worker).
pub fn tokens_hashed_on_this_thread() -> u64 {
    TOKENS_HASHED.with(Cell::get)
}

/// Which hash function chains the chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgorithm {
    /// xxh3-128 with seed 0: fast and stable across machines. The default.
    #[default]
    Xxh3_128,
    /// SHA-256 truncated to 128 bits: slower, collision resistant against adversarial input.
    Sha256,
}

/// Domain tag for chunks hashed from token ids.
const DOMAIN_TOKENS: u8 = 0x01;
/// Domain tag for chunks hashed from engine block hashes.
const DOMAIN_BLOCKS: u8 = 0x02;
/// Domain tag for a request's extra keys chained onto the root.
const DOMAIN_EXTRA: u8 = 0x03;
/// Domain tag for the block-granular keys of a prompt's tail (its whole blocks in the chunk its
/// last token falls in).
const DOMAIN_TAIL_BLOCK: u8 = 0x04;
/// Bytes hashed to form the fixed root of every chain.
const ROOT_SEED: &[u8] = b"kvpool.chunk-hash.root.v1";

impl HashAlgorithm {
    /// The fixed hash that precedes the first chunk.
    pub fn root(self) -> ChunkHash {
        self.hash_parts(&[ROOT_SEED])
    }

    fn hash_parts(self, parts: &[&[u8]]) -> ChunkHash {
        match self {
            HashAlgorithm::Xxh3_128 => {
                let mut h = Xxh3::new();
                for p in parts {
                    h.update(p);
                }
                ChunkHash(h.digest128().to_be_bytes())
            }
            HashAlgorithm::Sha256 => {
                let mut h = Sha256::new();
                for p in parts {
                    h.update(p);
                }
                let full = h.finalize();
                let mut out = [0u8; 16];
                out.copy_from_slice(&full[..16]);
                ChunkHash(out)
            }
        }
    }

    /// hash_i = H(prev || 0x01 || tokens as little-endian u32).
    pub fn chain_tokens(self, prev: &ChunkHash, tokens: &[u32]) -> ChunkHash {
        TOKENS_HASHED.with(|c| c.set(c.get() + tokens.len() as u64));
        #[cfg(target_endian = "little")]
        {
            let bytes: &[u8] = bytemuck::cast_slice(tokens);
            self.hash_parts(&[&prev.0, &[DOMAIN_TOKENS], bytes])
        }
        #[cfg(target_endian = "big")]
        {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            self.hash_parts(&[&prev.0, &[DOMAIN_TOKENS], &bytes])
        }
    }

    /// The root a request's chain starts from: the fixed root, or, when it has extra keys,
    /// [`HashAlgorithm::chain_extra`] of them.
    pub fn request_root(self, extra_keys: &[u8]) -> ChunkHash {
        if extra_keys.is_empty() {
            self.root()
        } else {
            self.chain_extra(&self.root(), extra_keys)
        }
    }

    /// A request's root: H(root || 0x03 || extra keys), for requests whose KV depends on
    /// more than their token ids (LoRA adapter, multimodal inputs, cache salt).
    pub fn chain_extra(self, root: &ChunkHash, extra_keys: &[u8]) -> ChunkHash {
        self.hash_parts(&[&root.0, &[DOMAIN_EXTRA], extra_keys])
    }

    /// Block-granular keys for the tokens after a whole chunk (or the request's root): one hash
    /// per whole block of `block_size` tokens in `tokens`, each chained on the one before,
    /// the first on `prev` (the hash of the chunk before them, or the root): tail_j = H(tail_{j-1} || 0x04 ||
    /// block j's tokens as little-endian u32). Their own domain keeps them apart from chunk
    /// hashes, so a tail block is never taken for a chunk. A trailing partial block is not
    /// hashed.
    pub fn chain_tail_blocks(
        self,
        prev: &ChunkHash,
        tokens: &[u32],
        block_size: usize,
    ) -> Vec<ChunkHash> {
        let mut hashes = Vec::with_capacity(tokens.len() / block_size.max(1));
        let mut last = *prev;
        for block in tokens.chunks_exact(block_size.max(1)) {
            TOKENS_HASHED.with(|c| c.set(c.get() + block.len() as u64));
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            last = self.hash_parts(&[&last.0, &[DOMAIN_TAIL_BLOCK], &bytes]);
            hashes.push(last);
        }
        hashes
    }

    /// hash_i = H(prev || 0x02 || for each block: len as u32 LE || block hash bytes).
    pub fn chain_blocks<B: AsRef<[u8]>>(self, prev: &ChunkHash, blocks: &[B]) -> ChunkHash {
        let mut buf = Vec::with_capacity(17 + blocks.len() * 36);
        buf.extend_from_slice(&prev.0);
        buf.push(DOMAIN_BLOCKS);
        for b in blocks {
            let b = b.as_ref();
            buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
            buf.extend_from_slice(b);
        }
        self.hash_parts(&[&buf])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Pinned values: chunk hashes are storage keys shared across processes and machines.
    // If one of these changes, every stored chunk becomes unreachable.
    #[test]
    fn pinned_xxh3_chain() {
        let algo = HashAlgorithm::Xxh3_128;
        let root = algo.root();
        assert_eq!(root.to_string(), PINNED_XXH3_ROOT);
        let h1 = algo.chain_tokens(&root, &[1, 2, 3, 4]);
        assert_eq!(h1.to_string(), PINNED_XXH3_H1);
        let h2 = algo.chain_tokens(&h1, &[5, 6, 7, 8]);
        assert_eq!(h2.to_string(), PINNED_XXH3_H2);
    }

    #[test]
    fn pinned_extra_keys_chain() {
        let algo = HashAlgorithm::Xxh3_128;
        // Extra keys of a request under LoRA adapter "adapter-1" (see docs/keys.md).
        let mut extra = vec![1u8];
        extra.extend_from_slice(&9u32.to_le_bytes());
        extra.extend_from_slice(b"adapter-1");
        let root = algo.chain_extra(&algo.root(), &extra);
        assert_eq!(root.to_string(), PINNED_XXH3_ROOT_LORA);
        let h1 = algo.chain_tokens(&root, &[1, 2, 3, 4]);
        assert_eq!(h1.to_string(), PINNED_XXH3_H1_LORA);
    }

    #[test]
    fn pinned_sha256_chain() {
        let algo = HashAlgorithm::Sha256;
        let h1 = algo.chain_tokens(&algo.root(), &[1, 2, 3, 4]);
        assert_eq!(h1.to_string(), PINNED_SHA_H1);
    }

    // Computed independently with Python's `xxhash` package and `hashlib`:
    //   root = xxh3_128_digest(b"kvpool.chunk-hash.root.v1")
    //   h1   = xxh3_128_digest(root + b"\x01" + struct.pack("<4I", 1, 2, 3, 4))
    //   sha  = sha256(sha256(b"kvpool.chunk-hash.root.v1")[:16] + b"\x01" + tokens)[:16]
    const PINNED_XXH3_ROOT: &str = "10b4248da3324d63541e264ac9f43631";
    const PINNED_XXH3_H1: &str = "895d1392eb618d64049d62e3a0249520";
    const PINNED_XXH3_H2: &str = "f009ace08f0bfa674cf696dff76a4c10";
    //   root_lora = xxh3_128_digest(root + b"\x03" + b"\x01" + struct.pack("<I", 9) + b"adapter-1")
    //   h1_lora   = xxh3_128_digest(root_lora + b"\x01" + struct.pack("<4I", 1, 2, 3, 4))
    const PINNED_XXH3_ROOT_LORA: &str = "63d12d1bfe12314691c4dc74c23243e0";
    const PINNED_XXH3_H1_LORA: &str = "c6311e42108cb3118b86026a5a5ebdd1";
    const PINNED_SHA_H1: &str = "7ca0bb862c5ee49bfb565207845dc7d9";

    #[test]
    fn pinned_tail_blocks() {
        let algo = HashAlgorithm::Xxh3_128;
        let root = algo.root();
        // Two whole blocks of 2 tokens; the fifth token (a partial block) is not hashed.
        let tails = algo.chain_tail_blocks(&root, &[1, 2, 3, 4, 5], 2);
        assert_eq!(tails.len(), 2);
        assert_eq!(tails[0].to_string(), PINNED_XXH3_TAIL0);
        assert_eq!(tails[1].to_string(), PINNED_XXH3_TAIL1);
        // A tail block is never a chunk of the same tokens, and each chains on the one before.
        assert_ne!(tails[0], algo.chain_tokens(&root, &[1, 2]));
        assert_eq!(
            algo.chain_tail_blocks(&root, &[1, 2, 3, 4], 2),
            tails,
            "the partial block changes nothing"
        );
        assert_ne!(algo.chain_tail_blocks(&root, &[3, 4], 2)[0], tails[1]);
    }

    //   tail0 = xxh3_128_digest(root + b"\x04" + struct.pack("<2I", 1, 2))
    //   tail1 = xxh3_128_digest(tail0 + b"\x04" + struct.pack("<2I", 3, 4))
    const PINNED_XXH3_TAIL0: &str = "f025681bf50d451110a94973b6782a20";
    const PINNED_XXH3_TAIL1: &str = "dd3f4293684123be27595c4b27ffaa65";

    #[test]
    fn chain_depends_on_prefix_and_domain() {
        let algo = HashAlgorithm::Xxh3_128;
        let root = algo.root();
        let a = algo.chain_tokens(&root, &[9, 9]);
        let b = algo.chain_tokens(&a, &[9, 9]);
        assert_ne!(
            a, b,
            "same tokens after a different prefix must hash differently"
        );
        let blocks = algo.chain_blocks(&root, &[[9u8, 0, 0, 0], [9, 0, 0, 0]]);
        assert_ne!(a, blocks);
        assert_ne!(algo.root(), HashAlgorithm::Sha256.root());
    }
}
