//! The connector metadata decoder (bytes from another process): never a panic, and whatever
//! it accepts re-encodes to the same value.
#![no_main]

use kvpool_connector::ConnectorMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = ConnectorMetadata::decode(data) {
        let again = ConnectorMetadata::decode(&meta.encode()).expect("own encoding decodes");
        assert_eq!(again, meta);
    }
});
