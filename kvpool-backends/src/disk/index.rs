//! The disk tier's capacity index: every key's size, whether its value is in a file of its
//! own, and the eviction order; stored in RocksDB's `meta` column family and rebuilt from it.

use std::collections::{HashMap, HashSet, VecDeque};

use rocksdb::{DB, IteratorMode};
use tracing::warn;

use kvpool_core::memory::eviction::OrderedPolicy;
use kvpool_core::{BackendError, EvictionPolicy};

use super::config::DiskConfig;
use super::database::{META_CF, db_error};

/// The index entry of a key in the `meta` column family: its size (8 bytes, little-endian),
/// then, for a value in a file of its own, one byte [`IN_VALUE_FILE`]. Entries written before
/// value files existed are the bare size: values in RocksDB.
const IN_VALUE_FILE: u8 = 1;

pub(super) fn meta_entry(size: u64, in_file: bool) -> Vec<u8> {
    let mut entry = size.to_le_bytes().to_vec();
    if in_file {
        entry.push(IN_VALUE_FILE);
    }
    entry
}

/// `(size, in a value file)` from a `meta` entry; `None` when malformed.
pub(super) fn parse_meta_entry(entry: &[u8]) -> Option<(u64, bool)> {
    let size = u64::from_le_bytes(entry.get(..8)?.try_into().ok()?);
    match entry.get(8..)? {
        [] => Some((size, false)),
        [IN_VALUE_FILE] => Some((size, true)),
        _ => None,
    }
}

/// Every stored key's size and its eviction order: what capacity is judged on.
pub(super) struct Index {
    pub(super) sizes: HashMap<String, u64>,
    /// The keys of `sizes` whose value is in a file of its own ([`ValueFiles`]).
    pub(super) in_files: HashSet<String>,
    pub(super) order: OrderedPolicy<String>,
    pub(super) bytes: u64,
    /// Keys put once while the admission filter is on, oldest first.
    pub(super) seen: VecDeque<String>,
    pub(super) seen_set: HashSet<String>,
}

/// The capacity index, rebuilt from the `meta` column family without reading any value.
pub(super) fn load_index(db: &DB, config: &DiskConfig) -> Result<Index, BackendError> {
    let mut index = Index {
        sizes: HashMap::new(),
        in_files: HashSet::new(),
        order: OrderedPolicy::lru(),
        bytes: 0,
        seen: VecDeque::new(),
        seen_set: HashSet::new(),
    };
    {
        let meta = db.cf_handle(META_CF).expect("meta column family exists");
        for item in db.iterator_cf(meta, IteratorMode::Start) {
            let (k, v) = item.map_err(db_error)?;
            let (Ok(key), Some((size, in_file))) =
                (String::from_utf8(k.to_vec()), parse_meta_entry(&v))
            else {
                warn!(path = %config.path.display(), "skipping malformed index entry");
                continue;
            };
            if in_file {
                index.in_files.insert(key.clone());
            }
            index.bytes += size;
            index.order.on_insert(key.clone(), size as usize);
            index.sizes.insert(key, size);
        }
    }
    Ok(index)
}
