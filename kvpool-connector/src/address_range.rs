//! Checked arithmetic on raw host addresses an engine hands in (from Python): a range is
//! refused before any `unsafe` use when it is null or runs past the end of the address space.

/// A raw host range kvpool refuses: null, or its end does not fit the address space (a slice
/// over it could not exist; arithmetic on it would wrap in a release build).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {reason}")]
pub struct AddressRangeError {
    /// What the range is (for example "vLLM's primary region").
    pub what: &'static str,
    /// Why it was refused.
    pub reason: String,
}

/// The end of `count` items of `item_bytes` each, `stride` bytes apart from `base`, checked:
/// `base` is not null, no sum or product wraps, and the whole range is no longer than
/// `isize::MAX` (what a Rust slice may span). `count == 0` is an empty range at `base`.
pub fn strided_range_end(
    what: &'static str,
    base: usize,
    count: usize,
    stride: usize,
    item_bytes: usize,
) -> Result<usize, AddressRangeError> {
    let refuse = |reason: String| AddressRangeError { what, reason };
    if base == 0 {
        return Err(refuse("a null address".into()));
    }
    let span = match count.checked_sub(1) {
        None => 0,
        Some(last) => last
            .checked_mul(stride)
            .and_then(|offset| offset.checked_add(item_bytes))
            .ok_or_else(|| {
                refuse(format!(
                    "{count} items of {item_bytes} bytes, {stride} apart, overflow the address space"
                ))
            })?,
    };
    if span > isize::MAX as usize {
        return Err(refuse(format!("{span} bytes is longer than any mapping")));
    }
    base.checked_add(span).ok_or_else(|| {
        refuse(format!(
            "{span} bytes from {base:#x} run past the end of the address space"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_that_wrap_or_start_at_null_are_refused_and_others_end_where_expected() {
        assert_eq!(
            strided_range_end("r", 0x1000, 4, 64, 16),
            Ok(0x1000 + 3 * 64 + 16)
        );
        assert_eq!(strided_range_end("r", 0x1000, 0, 64, 16), Ok(0x1000));
        assert!(strided_range_end("r", 0, 1, 1, 1).is_err());
        assert!(strided_range_end("r", usize::MAX - 8, 1, 0, 16).is_err());
        assert!(strided_range_end("r", 0x1000, usize::MAX, 2, 1).is_err());
        assert!(strided_range_end("r", 0x1000, 2, usize::MAX / 2 + 1, 1).is_err());
        let err = strided_range_end("vLLM's primary region", 0x1000, 1, 0, usize::MAX / 2 + 2);
        assert!(
            err.unwrap_err()
                .to_string()
                .starts_with("vLLM's primary region: ")
        );
    }
}
