//! The pool daemon's request frames (bytes from any engine that can attach): the precheck and
//! the decoder never panic, and a frame the precheck passes decodes to no more items than the
//! precheck allowed, and to a client name no longer than the limit (the daemon budgets memory
//! for what the precheck saw, before it reads the body).
#![no_main]

use kvpool_backends::daemon::{MAX_CLIENT_NAME, PRECHECK_BYTES, Request};
use libfuzzer_sys::fuzz_target;

/// A small cap, so that the fuzzer reaches it (the daemon's is 65,536).
const MAX_ITEMS: usize = 4;

fuzz_target!(|data: &[u8]| {
    let head = &data[..data.len().min(PRECHECK_BYTES)];
    if Request::precheck(head, MAX_ITEMS).is_err() {
        return;
    }
    let Ok(request) = kvpool_core::frame::decode_body::<Request>(data) else {
        return;
    };
    if let Request::Attach { client, .. } = &request {
        assert!(client.len() <= MAX_CLIENT_NAME, "a client name past the precheck");
    }
    let items = request.item_count();
    assert!(items <= MAX_ITEMS, "{items} items past a precheck of {MAX_ITEMS}");
});
