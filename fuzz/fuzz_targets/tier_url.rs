//! Tier URLs: scheme dispatch and redaction never panic, and redaction removes the whole user
//! info (user and password) of any URL that has one.
#![no_main]

use kvpool_core::{TierConfig, redact_url};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(url) = std::str::from_utf8(data) else {
        return;
    };
    let _ = kvpool_backends::registry::scheme_of(url);
    let redacted = redact_url(url);
    // Everything between the scheme and the last '@' (the user info, password included)
    // is gone: only the scheme, `***` and what follows the '@' remain.
    if let (Some(s), Some(at)) = (url.find("://"), url.rfind('@'))
        && at > s
    {
        assert_eq!(redacted, format!("{}***{}", &url[..s + 3], &url[at..]));
        // So a real password (letters and digits) is never printed, unless the same text
        // is also the scheme, host or path.
        if let Some((_, password)) = url[s + 3..at].split_once(':')
            && password.len() >= 4
            && password.bytes().all(|b| b.is_ascii_alphanumeric())
            && !url[..s + 3].contains(password)
            && !url[at..].contains(password)
        {
            assert!(!redacted.contains(password), "{url} -> {redacted}");
        }
    }
    let tier = TierConfig::new(url).with_option("endpoint", url);
    let _ = format!("{tier:?}");
});
