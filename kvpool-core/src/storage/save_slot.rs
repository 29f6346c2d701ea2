//! Saves written once, where they will lie in memory on this node that another process can
//! write (the pool daemon's arena): lent by the tier, filled by the engine's copy out of its
//! blocks, sealed with a checksum hashed from those blocks, then committed under its key.

use std::any::Any;
use std::fmt;
use std::time::Instant;

use crate::error::FormatError;
use crate::format::ChunkMeta;
use crate::format::chunk_format::{ChunkCodec, HEADER_LEN, KeyBinding};
use crate::keys::cache_key::CacheKey;

/// Memory a tier lends for one value to be written where it will lie
/// ([`crate::NodeMemoryConnector::batch_lend`]): outside the tier's index, so no reader sees it,
/// until the tier publishes it ([`crate::NodeMemoryConnector::batch_commit_lent`]). Given back to
/// the tier when dropped uncommitted (the tier's handle does that).
pub struct LentBytes {
    ptr: usize,
    len: usize,
    usable_until: Instant,
    handle: Box<dyn Any + Send + Sync>,
}

impl LentBytes {
    /// `len` writable bytes at `ptr`, lent until `usable_until` (after that the tier may have
    /// reclaimed them, and the writer touches nothing); `handle` is the tier's record of the
    /// loan, handed back to it at commit, and gives the memory back when dropped.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay mapped and writable for as long as `handle` lives, and no
    /// reader may be given those bytes before the tier commits them.
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        usable_until: Instant,
        handle: Box<dyn Any + Send + Sync>,
    ) -> Self {
        LentBytes {
            ptr: ptr as usize,
            len,
            usable_until,
            handle,
        }
    }

    /// Address of the first byte, to write to while this lives.
    pub fn ptr(&self) -> usize {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was lent (never: tiers lend whole values).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the lender still promises the bytes (a writer touches nothing otherwise).
    pub fn usable(&self) -> bool {
        Instant::now() < self.usable_until
    }

    /// The tier's record of the loan, for the tier that lent it to commit.
    pub fn into_handle(self) -> Box<dyn Any + Send + Sync> {
        self.handle
    }
}

impl fmt::Debug for LentBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LentBytes")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

/// A chunk's place in node memory, lent for a save to be copied straight into
/// ([`crate::NodeMemoryBackend::lend_save_slots`]): the engine side copies the chunk's payload to
/// [`SaveSlot::payload_ptr`], then the worker [seals](SaveSlot::seal) it, writing the header
/// with a checksum hashed from the blocks the payload came from, and the tier commits it under
/// its key ([`crate::NodeMemoryBackend::commit_save_slots`]). Until then no reader can see it.
#[derive(Debug)]
pub struct SaveSlot {
    bytes: LentBytes,
    key: CacheKey,
    codec: ChunkCodec,
    sealed: Option<ChunkMeta>,
}

impl SaveSlot {
    /// A slot for `key`'s value over `bytes` (the header's [`HEADER_LEN`] bytes, then the
    /// payload), encoded by `codec` (which must not compress).
    pub(crate) fn new(bytes: LentBytes, key: CacheKey, codec: ChunkCodec) -> Self {
        debug_assert!(!codec.compresses() && bytes.len() >= HEADER_LEN);
        SaveSlot {
            bytes,
            key,
            codec,
            sealed: None,
        }
    }

    /// The key the value will be stored under.
    pub fn key(&self) -> &CacheKey {
        &self.key
    }

    /// Address the payload is copied to.
    pub fn payload_ptr(&self) -> usize {
        self.bytes.ptr() + HEADER_LEN
    }

    /// Length of the payload.
    pub fn payload_len(&self) -> usize {
        self.bytes.len() - HEADER_LEN
    }

    /// Whether the lender still promises the memory: a slot past it is neither written nor
    /// sealed, only dropped.
    pub fn usable(&self) -> bool {
        self.bytes.usable()
    }

    /// What the sealed header says the value holds; `None` until sealed.
    pub fn sealed(&self) -> Option<ChunkMeta> {
        self.sealed
    }

    /// Writes the header for a payload holding `meta`, bound to the slot's key, its checksum
    /// hashed over `pieces`: the payload as memory no other process writes holds it (the
    /// engine's blocks it was copied from), in payload order. Never hashed from the slot,
    /// which another process can write: a payload changed there fails its readers' check.
    /// Fails unless the pieces add up to the payload.
    pub fn seal<'a>(
        &mut self,
        meta: &ChunkMeta,
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<(), FormatError> {
        let head = self.codec.uncompressed_header_over(
            meta,
            &KeyBinding::of(&self.key),
            self.payload_len(),
            pieces,
        )?;
        // SAFETY: the first HEADER_LEN bytes of the lent memory, which `LentBytes::new`'s
        // caller keeps mapped and writable while the loan lives, and no reader sees yet.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), self.bytes.ptr() as *mut u8, HEADER_LEN)
        };
        self.sealed = Some(*meta);
        Ok(())
    }

    /// The key and the lent memory, for the tier to commit.
    pub(crate) fn into_parts(self) -> (CacheKey, LentBytes) {
        (self.key, self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::chunk_format::{DecodeExpectation, decode_to_vec};
    use crate::keys::cache_key::KeyScope;
    use crate::layout::Dtype;

    fn key(hash: u8) -> CacheKey {
        let scope = std::sync::Arc::new(KeyScope::new("m", 1, 0, 0, 11).unwrap());
        CacheKey::new(scope, crate::keys::chunk_hash::ChunkHash([hash; 16]))
    }

    fn slot(buf: &mut [u8], key: &CacheKey) -> SaveSlot {
        // SAFETY: the tests keep `buf` alive and untouched while the slot lives.
        let bytes = unsafe {
            LentBytes::new(
                buf.as_mut_ptr(),
                buf.len(),
                Instant::now() + std::time::Duration::from_secs(30),
                Box::new(()),
            )
        };
        SaveSlot::new(bytes, key.clone(), ChunkCodec::default())
    }

    fn expect(key: &CacheKey) -> DecodeExpectation {
        DecodeExpectation {
            max_raw_len: 1 << 20,
            layout_fingerprint: Some(11),
            bytes_per_token: None,
            key: Some(KeyBinding::of(key)),
        }
    }

    const META: ChunkMeta = ChunkMeta {
        layout_fingerprint: 11,
        dtype: Dtype::F32,
        token_count: 2,
    };

    #[test]
    fn a_sealed_slot_decodes_to_the_blocks_it_was_copied_from() {
        let key = key(4);
        let blocks: Vec<u8> = (0..96u8).collect();
        let mut buf = vec![0u8; HEADER_LEN + blocks.len()];
        let mut s = slot(&mut buf, &key);
        assert_eq!(s.payload_len(), 96);
        assert_eq!(s.sealed(), None);
        // The engine side's copy into the slot, then the seal over the blocks, in pieces.
        // SAFETY: the payload lies inside `buf`.
        unsafe { std::ptr::copy_nonoverlapping(blocks.as_ptr(), s.payload_ptr() as *mut u8, 96) };
        s.seal(&META, [&blocks[..32], &blocks[32..]]).unwrap();
        assert_eq!(s.sealed(), Some(META));
        drop(s);
        let (decoded, payload) = decode_to_vec(&buf, &expect(&key)).unwrap();
        assert_eq!(decoded, META);
        assert_eq!(payload, blocks);
    }

    #[test]
    fn a_payload_changed_in_the_slot_between_the_copy_and_the_seal_fails_to_decode() {
        // Another process writes into the place after the engine's copy, before the seal:
        // the seal hashes the blocks, not the place, so readers refuse what is there.
        let key = key(6);
        let blocks: Vec<u8> = (0..96u8).rev().collect();
        let mut buf = vec![0u8; HEADER_LEN + blocks.len()];
        let mut s = slot(&mut buf, &key);
        // SAFETY: the payload lies inside `buf`; the second write plays the other process.
        unsafe {
            std::ptr::copy_nonoverlapping(blocks.as_ptr(), s.payload_ptr() as *mut u8, 96);
            *((s.payload_ptr() + 40) as *mut u8) ^= 1;
        }
        s.seal(&META, [&blocks[..]]).unwrap();
        drop(s);
        assert!(matches!(
            decode_to_vec(&buf, &expect(&key)),
            Err(FormatError::Checksum { .. })
        ));
    }

    #[test]
    fn pieces_that_are_not_the_whole_payload_seal_nothing() {
        let key = key(5);
        let meta = ChunkMeta {
            layout_fingerprint: 1,
            dtype: Dtype::F16,
            token_count: 1,
        };
        let mut buf = vec![0u8; HEADER_LEN + 8];
        let mut s = slot(&mut buf, &key);
        assert!(matches!(
            s.seal(&meta, [&[1u8; 4][..]]),
            Err(FormatError::Destination { .. })
        ));
        assert_eq!(s.sealed(), None);
        drop(s);
        assert!(
            buf[..HEADER_LEN].iter().all(|&b| b == 0),
            "no header written"
        );
    }
}
