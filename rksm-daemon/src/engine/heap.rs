//! The daemon's heap: one arena, and freed memory handed back once it has piled up.
//!
//! rksm's tables grow with the memory it watches, and a large pass builds and drops tens of
//! megabytes of batches, caches and lists. glibc keeps freed memory for reuse, and gives
//! every thread that allocates an arena of its own, where freed megabytes stay resident in a
//! process that otherwise lives on its tables alone. So the daemon asks for one arena (the
//! scan runs on one thread; the status server and the userfaultfd guard allocate little),
//! and after a pass hands freed memory back whenever its resident memory has grown since it
//! last did. Which pass leaves freed memory resident is not
//! for the daemon to guess (the first, the one that marks, the one that sees ksmd's merges),
//! nor can the allocator say: memory it holds free and was handed back becomes resident again
//! when reused and freed, while the free total stays the same.

use rksm_common::PAGE_SIZE;

/// Growth of the resident memory worth a hand-back.
const GROWTH_WORTH_GIVING_BACK: u64 = 4 << 20;

/// Makes every thread allocate from one arena. Called before the daemon starts threads.
pub fn one_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's tuning; M_ARENA_MAX takes any positive
    // count, and threads that start later use the arenas it allows.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Returns the heap memory freed since to the system (glibc keeps it otherwise).
fn give_back_freed() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// rksm's resident memory (/proc/self/statm's second field, in pages), in bytes.
pub fn resident_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/self/statm")
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|pages| pages * PAGE_SIZE)
}

/// Follows rksm's resident memory, to hand freed memory back once it has grown.
#[derive(Debug, Default)]
pub struct FreedMemory {
    /// Resident bytes after the last hand-back, or the least since (0 before the first).
    baseline: u64,
}

impl FreedMemory {
    /// Hands freed memory back if the resident memory grew by
    /// [`GROWTH_WORTH_GIVING_BACK`] since the last hand-back; true if it did. A growth that
    /// is live memory (more targets, more pages) costs one hand-back that gives little.
    pub fn give_back_if_grown(&mut self) -> bool {
        let Some(now) = resident_bytes() else {
            return false;
        };
        self.baseline = self.baseline.min(now);
        if now < self.baseline + GROWTH_WORTH_GIVING_BACK {
            return false;
        }
        give_back_freed();
        self.baseline = resident_bytes().unwrap_or(now);
        true
    }
}

#[cfg(all(test, target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn memory_freed_in_the_heap_is_handed_back_once_resident_memory_grew() {
        let mut freed = FreedMemory::default();
        assert!(
            freed.give_back_if_grown(),
            "the first look hands back what there is"
        );
        // 256 MiB of small blocks, fifteen of every sixteen freed: glibc keeps them in its
        // heap (not in mappings of their own, which go back at once), between blocks still
        // in use (not at the heap's top, which it gives back by itself). Other tests run
        // alongside, so only a large difference is looked for.
        let blocks: Vec<Vec<u8>> = (0..65536).map(|_| vec![1u8; 4096]).collect();
        let kept: Vec<Vec<u8>> = blocks
            .into_iter()
            .enumerate()
            .filter_map(|(i, b)| (i % 16 == 0).then_some(b))
            .collect();
        let before = resident_bytes().unwrap();
        assert!(
            freed.give_back_if_grown(),
            "resident memory grew: handed back"
        );
        let after = resident_bytes().unwrap();
        assert!(
            after + (128 << 20) < before,
            "{} MiB resident after, {} before",
            after >> 20,
            before >> 20
        );
        assert_eq!(kept.len(), 4096);
    }
}
