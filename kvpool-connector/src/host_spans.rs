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
