//! Values gathered from, and scattered to, spans of an engine's host memory (SGLang's host
//! pool pages, vLLM's recurrent-state blocks): the spans, and the checks made on them before
//! any `unsafe` use.

/// One span of an engine's host memory: `len` bytes at address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSpan {
    /// Start address.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

/// Where one value lives in an engine's host memory: its segments, in order (SGLang: a page's
/// segments in `get_page_buffer_meta` order; vLLM: a recurrent state's layers).
pub type PageSpans = Vec<HostSpan>;

/// Groups flat address and size lists, as SGLang's `get_page_buffer_meta` returns them for
/// `pages` pages, into each page's spans. Refused: lists of different lengths, segments that
/// do not split evenly over the pages, and a segment that is null or whose end wraps the
/// address space.
pub fn page_spans(
    pages: usize,
    addrs: &[usize],
    sizes: &[usize],
) -> Result<Vec<PageSpans>, String> {
    if addrs.len() != sizes.len() {
        return Err(format!(
            "{} addresses but {} sizes",
            addrs.len(),
            sizes.len()
        ));
    }
    if pages == 0 {
        return Ok(Vec::new());
    }
    if addrs.is_empty() || !addrs.len().is_multiple_of(pages) {
        return Err(format!(
            "{} buffer segments do not split evenly over {pages} pages",
            addrs.len()
        ));
    }
    for (&addr, &len) in addrs.iter().zip(sizes) {
        crate::address_range::strided_range_end("an SGLang host buffer", addr, 1, 0, len)
            .map_err(|e| e.to_string())?;
    }
    let per_page = addrs.len() / pages;
    Ok(addrs
        .chunks(per_page)
        .zip(sizes.chunks(per_page))
        .map(|(a, s)| {
            a.iter()
                .zip(s)
                .map(|(&addr, &len)| HostSpan { addr, len })
                .collect()
        })
        .collect())
}

/// Whether `pages` (one per key of `keys`) each add up to exactly `page_bytes`, the lengths
/// summed with overflow checks (lengths from the caller must not wrap to a page).
pub fn pages_fit(page_bytes: usize, keys: usize, pages: &[PageSpans]) -> Result<(), String> {
    if keys != pages.len() {
        return Err(format!("{keys} keys but {} pages", pages.len()));
    }
    for (i, spans) in pages.iter().enumerate() {
        let len = spans
            .iter()
            .try_fold(0usize, |sum, span| sum.checked_add(span.len));
        if len != Some(page_bytes) {
            return Err(format!(
                "page {i}'s host spans hold {len:?} bytes, not a page of {page_bytes}"
            ));
        }
    }
    Ok(())
}

/// Copies the bytes of `spans`, in order, into `to` (a value being stored).
///
/// # Safety
///
/// Every span must be valid for reads of its length and not written until this returns; the
/// spans' lengths must add up to `to.len()` (checked by [`pages_fit`]; a shortfall panics).
pub unsafe fn gather(spans: &[HostSpan], mut to: &mut [u8]) {
    for span in spans {
        let (head, rest) = to.split_at_mut(span.len);
        // SAFETY: the caller guarantees the span is valid for reads of its length and
        // unchanged during the call.
        head.copy_from_slice(unsafe {
            std::slice::from_raw_parts(span.addr as *const u8, span.len)
        });
        to = rest;
    }
}

/// Copies `from` (a value read) into `spans`, in order.
///
/// # Safety
///
/// Every span must be valid for writes of its length and read or written by nobody else until
/// this returns; the spans' lengths must add up to `from.len()` (checked by [`pages_fit`]; a
/// shortfall panics).
pub unsafe fn scatter(mut from: &[u8], spans: &[HostSpan]) {
    for span in spans {
        let (head, rest) = from.split_at(span.len);
        // SAFETY: the caller guarantees the span is valid for writes of its length and ours
        // alone during the call.
        unsafe { std::slice::from_raw_parts_mut(span.addr as *mut u8, span.len) }
            .copy_from_slice(head);
        from = rest;
    }
}
