//! The text form of cache keys (what lower tiers store under): never a panic, and a key that
//! parses prints back to text that parses to the same key.
#![no_main]

use kvpool_core::CacheKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(key) = text.parse::<CacheKey>() {
        let again: CacheKey = key.to_string().parse().expect("its own text parses");
        assert_eq!(again, key);
    }
});
