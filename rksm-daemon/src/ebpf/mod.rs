//! The write-fault tracer: the eBPF program that approximates a dirty bit.
//!
//! [`tracefs`] checks the tracepoint's layout before anything is loaded, [`tracer`] loads and
//! attaches the program and owns its maps, and [`recorder`] drains the ring into a log that the
//! daemon and `rksm trace` both read. The same object's other programs serve the borrow:
//! [`guard`] steps rksm's userfaultfd aside for a target that takes up its own, and
//! [`waits`] tells when a thread entered the wait a borrow interrupted. [`marks`] serves the
//! merge domains: it records every process that asks to make memory mergeable.
//! [`sampler`] digests new pages through the kernel's direct map for the first pass;
//! [`copier`] copies whole pages the same way, loaded only by the benchmarks that weigh it
//! against `process_vm_readv`. Both run on demand over maps the daemon has mapped.

pub mod copier;
pub mod guard;
mod mapped;
pub mod marks;
pub mod recorder;
pub mod ring;
pub mod sampler;
pub mod tracefs;
pub mod tracer;
pub mod waits;

use aya::{Ebpf, EbpfError};

use tracer::EBPF_OBJECT;

/// Every sized map of the object, with the smallest size the kernel takes for it and the size
/// the object declares: each part loads the object for its own programs, and the maps it does
/// not use stay that small.
const SIZES: [(&str, u32, u32); 7] = [
    (
        rksm_common::names::RECORDS,
        4096,
        rksm_common::DEFAULT_RING_BYTES,
    ),
    (rksm_common::names::TRACKED, 1, rksm_common::MAX_TRACKED),
    (rksm_common::uffd_guard::HELD, 1, rksm_common::MAX_TRACKED),
    (rksm_common::waits::WAITERS, 1, rksm_common::MAX_TRACKED),
    (
        rksm_common::waits::ENTERED,
        1,
        rksm_common::waits::MAX_WAITING_THREADS,
    ),
    (
        rksm_common::marks::MARKERS,
        1,
        rksm_common::marks::MAX_MARKERS,
    ),
    (rksm_common::copy::PAGES, 1, rksm_common::copy::SLOTS),
];

/// The eBPF object, to load each part of rksm from.
///
/// The loader is made once and every part is loaded from it. It does not parse the kernel's
/// BTF: the object has no CO-RE relocations (vendor/README.md says why aya is patched for
/// that).
#[derive(Default)]
pub struct Object {
    loader: Option<aya::EbpfLoader<'static>>,
}

impl Object {
    /// An object nothing was loaded from yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads the object for a part whose maps are `own`, sized as `sizes` says or as the
    /// object declares them; every other map is made as small as the kernel allows.
    fn load(&mut self, own: &[&str], sizes: &[(&'static str, u32)]) -> Result<Ebpf, EbpfError> {
        let loader = self.loader.get_or_insert_with(aya::EbpfLoader::new);
        // The loader keeps the sizes of earlier loads: every map is sized again.
        for (name, smallest, declared) in SIZES {
            let size = match own.contains(&name) {
                true => sizes
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(declared, |&(_, size)| size),
                false => smallest,
            };
            loader.map_max_entries(name, size);
        }
        loader.load(EBPF_OBJECT)
    }
}

/// Tracefs category of the system-call tracepoints the borrow's and the domains' programs use.
const SYSCALLS: &str = rksm_common::uffd_guard::CATEGORY;

/// Checks that the system-call tracepoint `event` has field `name` at `offset`, where a
/// program reads it.
fn check_syscall_field(
    tracefs: &std::path::Path,
    event: &str,
    name: &str,
    offset: usize,
) -> Result<(), guard::GuardError> {
    let layout = guard::GuardError::Layout;
    let path = tracefs.join(format!("events/{SYSCALLS}/{event}/format"));
    let text = std::fs::read_to_string(&path).map_err(|e| {
        layout(format!(
            "cannot read {}: {e} (a kernel without syscall tracepoints)",
            path.display()
        ))
    })?;
    match tracefs::parse_format(&text).iter().find(|f| f.name == name) {
        Some(f) if f.offset == offset => Ok(()),
        Some(f) => Err(layout(format!(
            "syscalls:{event} has `{name}` at offset {}, the program reads {offset}",
            f.offset
        ))),
        None => Err(layout(format!("syscalls:{event} has no field `{name}`"))),
    }
}

/// Loads each of `programs` (name, system-call tracepoint) of `ebpf` and attaches it.
fn attach_syscall_programs(
    ebpf: &mut aya::Ebpf,
    programs: &[(&'static str, &'static str)],
) -> Result<(), guard::GuardError> {
    use guard::GuardError;
    for &(name, event) in programs {
        let program: &mut aya::programs::TracePoint = ebpf
            .program_mut(name)
            .ok_or(GuardError::Missing(name))?
            .try_into()
            .map_err(|e| GuardError::Attach(e, event))?;
        program.load().map_err(|e| GuardError::Attach(e, event))?;
        program
            .attach(SYSCALLS, event)
            .map_err(|e| GuardError::Attach(e, event))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::tracer::EBPF_OBJECT;

    /// Start-up never parses the kernel's BTF (megabytes, most of a start's CPU) only because
    /// no program of the object relocates against it: a CO-RE read added to a program would
    /// bring the parse back to every start.
    #[test]
    fn no_program_relocates_against_the_kernels_btf() {
        assert!(
            !EBPF_OBJECT.is_empty(),
            "built without the eBPF object: run the tests with `cargo xtask test`"
        );
        let object = aya_obj::Object::parse(EBPF_OBJECT).expect("the object parses");
        assert!(!object.has_btf_relocations());
    }
}
