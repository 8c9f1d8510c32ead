//! Tracefs: where the kernel describes its tracepoints.
//!
//! The eBPF program reads `exceptions:page_fault_user` at fixed offsets. Those offsets are
//! part of the kernel's ABI only by convention, so before loading the program the daemon reads
//! the tracepoint's format file and refuses to run if a field moved or changed size. Tracefs is
//! usually mounted by systemd; on hosts where it is not, the daemon mounts it at the standard
//! place, because attaching a tracepoint program needs it.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use rksm_common::tracepoint::{
    ADDRESS_OFFSET, CATEGORY, ERROR_CODE_OFFSET, FIELD_SIZE, IP_OFFSET, KERNEL_NAME, NAME,
};

/// Where tracefs is looked for, in order (the second is the pre-4.1 location).
const MOUNT_POINTS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Errors finding tracefs or validating the tracepoint's layout.
#[derive(Debug, thiserror::Error)]
pub enum TracefsError {
    /// Tracefs is not mounted and mounting it failed.
    #[error("tracefs is not mounted and mounting it at /sys/kernel/tracing failed: {0}")]
    Mount(#[source] io::Error),
    /// The tracepoint's format file could not be read (old kernel, or not x86).
    #[error(
        "cannot read {path}: {source} (does this kernel have the {CATEGORY}:{NAME} tracepoint?)"
    )]
    ReadFormat {
        /// The format file.
        path: PathBuf,
        /// Why reading it failed.
        source: io::Error,
    },
    /// A field the program reads is missing from the format file.
    #[error("the {CATEGORY}:{NAME} tracepoint has no field `{0}`; rksm's eBPF program cannot run on this kernel")]
    MissingField(&'static str),
    /// A field the program reads is not where the program reads it.
    #[error("the {CATEGORY}:{NAME} field `{field}` is at offset {offset} size {size}, but rksm's eBPF program reads offset {expected_offset} size {expected_size}; refusing to run")]
    Layout {
        /// The field's name.
        field: &'static str,
        /// Its offset according to the kernel.
        offset: usize,
        /// Its size according to the kernel.
        size: usize,
        /// Where the program reads it.
        expected_offset: usize,
        /// The size the program reads.
        expected_size: usize,
    },
}

/// One `field:` line of a tracepoint format file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatField {
    /// The field's name, without its C type.
    pub name: String,
    /// Byte offset in the raw tracepoint record.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

/// Returns the tracefs mount point, mounting tracefs at `/sys/kernel/tracing` if none is.
pub fn ensure_mounted() -> Result<&'static Path, TracefsError> {
    if let Some(found) = find() {
        return Ok(found);
    }
    let target = c"/sys/kernel/tracing";
    // SAFETY: all pointers are NUL-terminated string literals that outlive the call; a null
    // data pointer is allowed for tracefs.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(TracefsError::Mount(io::Error::last_os_error()));
    }
    log::info!("mounted tracefs at /sys/kernel/tracing");
    find().ok_or_else(|| TracefsError::Mount(io::Error::other("still empty after mounting")))
}

/// A mount point counts only when it is populated: the kernel creates the empty directory
/// `/sys/kernel/tracing` even when tracefs is not mounted there.
fn find() -> Option<&'static Path> {
    MOUNT_POINTS.into_iter().map(Path::new).find(|dir| {
        fs::read_dir(dir)
            .map(|mut entries| entries.next().is_some())
            .unwrap_or(false)
    })
}

/// Reads the format files of `exceptions:page_fault_user` and `exceptions:page_fault_kernel`
/// (one event class) and checks that every field the program reads is where it reads it.
pub fn check_page_fault_layouts(tracefs: &Path) -> Result<(), TracefsError> {
    for name in [NAME, KERNEL_NAME] {
        let path = tracefs
            .join("events")
            .join(CATEGORY)
            .join(name)
            .join("format");
        let text = fs::read_to_string(&path).map_err(|source| TracefsError::ReadFormat {
            path: path.clone(),
            source,
        })?;
        check_layout(&parse_format(&text))?;
    }
    Ok(())
}

/// Checks parsed fields against the offsets compiled into the program.
pub fn check_layout(fields: &[FormatField]) -> Result<(), TracefsError> {
    for (name, expected_offset) in [
        ("address", ADDRESS_OFFSET),
        ("ip", IP_OFFSET),
        ("error_code", ERROR_CODE_OFFSET),
    ] {
        let field = fields
            .iter()
            .find(|f| f.name == name)
            .ok_or(TracefsError::MissingField(name))?;
        if field.offset != expected_offset || field.size != FIELD_SIZE {
            return Err(TracefsError::Layout {
                field: name,
                offset: field.offset,
                size: field.size,
                expected_offset,
                expected_size: FIELD_SIZE,
            });
        }
    }
    Ok(())
}

/// Parses the `field:` lines of a tracepoint format file; other lines are ignored.
///
/// ```
/// let fields = rksm::ebpf::tracefs::parse_format(
///     "\tfield:unsigned long address;\toffset:8;\tsize:8;\tsigned:0;\n",
/// );
/// assert_eq!(fields[0].name, "address");
/// assert_eq!((fields[0].offset, fields[0].size), (8, 8));
/// ```
pub fn parse_format(text: &str) -> Vec<FormatField> {
    text.lines().filter_map(parse_field_line).collect()
}

fn parse_field_line(line: &str) -> Option<FormatField> {
    let mut declaration = None;
    let mut offset = None;
    let mut size = None;
    for part in line.trim().split(';') {
        let Some((key, value)) = part.trim().split_once(':') else {
            continue;
        };
        match key {
            "field" => declaration = Some(value.trim()),
            "offset" => offset = value.trim().parse().ok(),
            "size" => size = value.trim().parse().ok(),
            _ => {}
        }
        if offset.is_some() && size.is_some() {
            break;
        }
    }
    // `unsigned long address` or `char comm[16]`: the name is the last word, minus any array.
    let name = declaration?.rsplit(' ').next()?;
    let name = name.split('[').next()?;
    Some(FormatField {
        name: name.to_string(),
        offset: offset?,
        size: size?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMAT_6_18: &str = "name: page_fault_user
ID: 190
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long address;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned long ip;\toffset:16;\tsize:8;\tsigned:0;
\tfield:unsigned long error_code;\toffset:24;\tsize:8;\tsigned:0;

print fmt: \"address=%ps ip=%ps error_code=0x%lx\", (void *)REC->address, (void *)REC->ip, REC->error_code
";

    #[test]
    fn parses_every_field_of_a_real_format_file() {
        let fields = parse_format(FORMAT_6_18);
        let names: Vec<_> = fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "common_type",
                "common_flags",
                "common_preempt_count",
                "common_pid",
                "address",
                "ip",
                "error_code"
            ]
        );
        assert_eq!(
            fields[6],
            FormatField {
                name: "error_code".into(),
                offset: 24,
                size: 8
            }
        );
    }

    #[test]
    fn accepts_the_layout_the_program_was_built_for() {
        check_layout(&parse_format(FORMAT_6_18)).unwrap();
    }

    #[test]
    fn refuses_a_moved_field() {
        let moved = FORMAT_6_18.replace("error_code;\toffset:24", "error_code;\toffset:32");
        let err = check_layout(&parse_format(&moved)).unwrap_err();
        assert!(
            matches!(
                err,
                TracefsError::Layout {
                    field: "error_code",
                    offset: 32,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_resized_field() {
        let resized =
            FORMAT_6_18.replace("address;\toffset:8;\tsize:8", "address;\toffset:8;\tsize:4");
        let err = check_layout(&parse_format(&resized)).unwrap_err();
        assert!(
            matches!(
                err,
                TracefsError::Layout {
                    field: "address",
                    size: 4,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_missing_field() {
        let missing: String = FORMAT_6_18
            .lines()
            .filter(|l| !l.contains(" ip;"))
            .collect::<Vec<_>>()
            .join("\n");
        let err = check_layout(&parse_format(&missing)).unwrap_err();
        assert!(matches!(err, TracefsError::MissingField("ip")), "{err}");
    }

    proptest::proptest! {
        /// Any text parses without panicking, and checking it never panics either.
        #[test]
        fn format_parsing_never_panics(text in "\\PC*") {
            let fields = parse_format(&text);
            let _ = check_layout(&fields);
        }

        /// Shuffled, duplicated or mangled field lines of the real file never panic.
        #[test]
        fn mangled_real_formats_never_panic(cut in 0usize..800, junk in "[a-z:;0-9 \\t]{0,30}") {
            let mut text = FORMAT_6_18.to_string();
            let at = cut.min(text.len());
            let at = (0..=at).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            text.insert_str(at, &junk);
            let _ = check_layout(&parse_format(&text));
        }
    }

    #[test]
    fn the_corpus_formats_parse_and_only_page_fault_user_fits() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        check_layout(&parse_format(&read("format-page_fault_user.txt"))).unwrap();
        let other = parse_format(&read("format-sched_switch.txt"));
        assert!(other.len() >= 8);
        assert!(check_layout(&other).is_err());
    }

    #[test]
    fn array_fields_lose_their_brackets() {
        let fields = parse_format("\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;");
        assert_eq!(fields[0].name, "comm");
    }
}
