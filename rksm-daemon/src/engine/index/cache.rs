//! The representatives' contents the index keeps in memory while a pass compares: the copies
//! of one content meet the same representative again and again, and reading it from its
//! process each time would cost a copy per comparison.

use std::collections::{HashMap, VecDeque};

use rksm_common::PAGE;

use super::PageRef;
use crate::engine::keys::BuildKeyHasher;

/// Representative contents kept in memory, first in first out.
#[derive(Debug, Default)]
pub(super) struct RepCache {
    pages: HashMap<PageRef, Box<[u8; PAGE]>, BuildKeyHasher>,
    order: VecDeque<PageRef>,
    capacity: usize,
}

impl RepCache {
    /// An empty cache that keeps at most `capacity` contents.
    pub(super) fn new(capacity: usize) -> Self {
        RepCache {
            capacity,
            ..RepCache::default()
        }
    }

    /// The content kept for `page`, if one is.
    pub(super) fn get(&self, page: &PageRef) -> Option<&[u8; PAGE]> {
        self.pages.get(page).map(|content| &**content)
    }

    /// Whether a content is kept for `page`.
    pub(super) fn contains(&self, page: &PageRef) -> bool {
        self.pages.contains_key(page)
    }

    pub(super) fn insert(&mut self, page: PageRef, content: &[u8; PAGE]) {
        if self.capacity == 0 || self.pages.contains_key(&page) {
            return;
        }
        // The oldest content's memory holds the new one: no allocation once the cache is full.
        let mut spare = None;
        while self.order.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => spare = self.pages.remove(&old).or(spare),
                None => break,
            }
        }
        let mut slot = spare.unwrap_or_else(|| Box::new([0; PAGE]));
        slot.copy_from_slice(content);
        self.pages.insert(page, slot);
        self.order.push_back(page);
    }

    pub(super) fn forget(&mut self, page: PageRef) {
        if self.pages.remove(&page).is_some() {
            self.order.retain(|&p| p != page);
        }
    }

    /// Drops every content kept, and the memory that held them.
    pub(super) fn clear(&mut self) {
        self.pages = HashMap::default();
        self.order = VecDeque::new();
    }
}
