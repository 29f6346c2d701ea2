//! Raw host ranges an engine hands in from Python: SGLang's page buffers (`page_spans`,
//! `pages_fit`), vLLM's primary region and its jobs' rows (`PrimaryRegion`), and the host KV
//! planes a worker reads (`HostPlanes`). None panics on any numbers, and each accepts exactly
//! what its specification here allows: no accepted range reaches past the end of the address
//! space, whatever the arithmetic on it.
#![no_main]

use kvpool_connector::HostPlanes;
use kvpool_connector::vllm_tier::PrimaryRegion;
use kvpool_connector::host_spans::{page_spans, pages_fit};
use libfuzzer_sys::fuzz_target;

/// The end of `count` items of `len` bytes, `stride` apart from a non-null `base`, if it fits
/// the address space and a slice (`isize::MAX` bytes).
fn end_of(base: usize, count: usize, stride: usize, len: usize) -> Option<usize> {
    if base == 0 {
        return None;
    }
    let span = match count.checked_sub(1) {
        None => 0,
        Some(last) => last.checked_mul(stride)?.checked_add(len)?,
    };
    if span > isize::MAX as usize {
        return None;
    }
    base.checked_add(span)
}

type Input = (
    (u8, Vec<usize>, Vec<usize>, usize),
    (usize, usize, usize, Vec<usize>),
    (Vec<(usize, usize)>, usize, usize),
);

fuzz_target!(|input: Input| {
    let ((pages, addrs, sizes, page_bytes), (base, rows, row_bytes, job), (planes, pbb, blocks)) =
        input;

    // SGLang's flat segment lists.
    let pages = usize::from(pages % 16);
    match page_spans(pages, &addrs, &sizes) {
        Ok(spans) => {
            assert_eq!(spans.len(), pages);
            for span in spans.iter().flatten() {
                assert!(end_of(span.addr, 1, 0, span.len).is_some(), "{span:?}");
            }
            if pages_fit(page_bytes, pages, &spans).is_ok() {
                for page in &spans {
                    let sum = page.iter().try_fold(0usize, |s, x| s.checked_add(x.len));
                    assert_eq!(sum, Some(page_bytes));
                }
            }
        }
        Err(_) => assert!(
            addrs.len() != sizes.len()
                || (pages > 0
                    && (addrs.is_empty()
                        || addrs.len() % pages != 0
                        || addrs
                            .iter()
                            .zip(&sizes)
                            .any(|(&a, &l)| end_of(a, 1, 0, l).is_none())))
        ),
    }

    // vLLM's primary region and a job's rows.
    // SAFETY: nothing is read or written through the region; only its arithmetic is tested.
    let region = unsafe { PrimaryRegion::new(base, rows, row_bytes) };
    assert_eq!(
        region.is_ok(),
        end_of(base, rows, row_bytes, row_bytes).is_some()
    );
    if let Ok(region) = region
        && region.job_refusal(job.len(), &job).is_none()
    {
        for &row in &job {
            let start = region.row_address(row);
            assert!(start.checked_add(row_bytes).is_some());
        }
    }

    // The host KV planes of a worker.
    let planes: Vec<(usize, usize)> = planes.into_iter().take(8).collect();
    let fits = planes
        .iter()
        .all(|&(b, stride)| stride >= pbb && end_of(b, blocks, stride, pbb).is_some());
    // SAFETY: as above: no byte of the planes is touched.
    let made = unsafe { HostPlanes::new(planes, pbb, blocks) };
    assert_eq!(made.is_ok(), fits);
});
