//! The engine: what a pass is made of, independent of how often it runs.
//!
//! [`targets`] selects processes, [`target`] holds everything kept about one of them,
//! [`dirty`] says which of its pages changed, [`scan`] reads and checksums those, records
//! them in the target's [`pages`] and places them in the [`index`] (both kept from pass to
//! pass), and [`merge`] turns verified duplicates into marked ranges.
//! Address ranges come from [`crate::kernel::ranges`]; maps keyed by checksums and page
//! addresses hash with [`keys`]; the tables with an entry for most pages are [`table`]s, and the digests of
//! pages only sampled are in a [`digests`] set.

pub mod checksum;
pub mod digests;
pub mod dirty;
pub mod heap;
pub mod index;
pub mod keys;
pub mod merge;
pub mod pages;
pub mod samples;
pub mod scan;
pub mod table;
pub mod target;
pub mod targets;
