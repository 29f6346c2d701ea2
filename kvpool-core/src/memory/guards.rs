//! Guards that end before the memory they refer to is freed: what a device sets up on an arena
//! or a mapping (its page-locking) lives with that memory, not with whoever set it up.

use std::any::Any;

use parking_lot::Mutex;

/// Something that must end before the memory it refers to is freed, such as a device's
/// registration of that memory for DMA: dropping it ends it.
pub type MemoryGuard = Box<dyn Any + Send + Sync>;

/// The guards attached to one piece of memory (an L1 arena, a mapping of the node daemon's
/// arena). Its owner calls [`MemoryGuards::release_all`] in its own `Drop`, before it frees
/// the memory, so no guard outlives what it guards: a page-locking that outlived its memory
/// would leave the next allocation at those addresses read through stale pages.
#[derive(Default)]
pub struct MemoryGuards(Mutex<Vec<MemoryGuard>>);

impl MemoryGuards {
    /// Attaches `guard`: it ends when the memory is freed (or at [`release_all`]).
    ///
    /// [`release_all`]: MemoryGuards::release_all
    pub fn attach(&self, guard: MemoryGuard) {
        self.0.lock().push(guard);
    }

    /// How many guards are attached.
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    /// Whether none is attached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every guard, the last attached first. The memory's owner calls this before it
    /// frees the memory.
    pub fn release_all(&self) {
        let guards = std::mem::take(&mut *self.0.lock());
        for guard in guards.into_iter().rev() {
            drop(guard);
        }
    }
}

impl std::fmt::Debug for MemoryGuards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryGuards({})", self.len())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counted(Arc<AtomicUsize>, usize, Arc<Mutex<Vec<usize>>>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
            self.2.lock().push(self.1);
        }
    }

    #[test]
    fn guards_end_last_attached_first_and_once() {
        let ended = Arc::new(AtomicUsize::new(0));
        let order = Arc::new(Mutex::new(Vec::new()));
        let guards = MemoryGuards::default();
        for i in 0..3 {
            guards.attach(Box::new(Counted(ended.clone(), i, order.clone())));
        }
        assert_eq!(guards.len(), 3);
        guards.release_all();
        guards.release_all();
        assert_eq!(ended.load(Ordering::SeqCst), 3);
        assert_eq!(*order.lock(), vec![2, 1, 0]);
        assert!(guards.is_empty());
    }
}
