//! The scheduler-worker lookup protocol's frames (bytes on a Unix socket between two processes
//! of one engine) and the daemon's replies (what an engine reads from the node's daemon):
//! decoding never panics, and what decodes re-encodes to the same value.
#![no_main]

use kvpool_backends::daemon::Reply;
use kvpool_connector::vllm::lookup_service::{LookupRequest, LookupResponse};
use libfuzzer_sys::fuzz_target;
use serde::{Serialize, de::DeserializeOwned};

fn round_trips<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(data: &[u8]) {
    if let Ok(value) = kvpool_core::frame::decode_body::<T>(data) {
        let mut frame = Vec::new();
        kvpool_core::frame::write_frame(&mut frame, &value).expect("own value encodes");
        let again: T = kvpool_core::frame::decode_body(&frame[4..]).expect("own encoding decodes");
        assert_eq!(again, value);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trips::<LookupRequest>(data);
    round_trips::<LookupResponse>(data);
    round_trips::<Reply>(data);
});
