//! rksm: a userspace KSM that rehashes only the pages an eBPF tracer saw written.
//!
//! The library is a stack of layers, each a folder, read bottom-up; each layer uses only the
//! ones below it, and the `rksm` binary is a thin command line over the top.
//!
//! - [`kernel`]: the kernel's interfaces, each wrapped once: procfs and pagemap, process
//!   memory, remote system calls by ptrace, userfaultfd arming, ksmd's sysfs, capabilities.
//! - [`ebpf`]: the write-fault tracer: the tracepoint's layout, the loaded program, and the
//!   recorder that drains its ring.
//! - [`engine`]: what one pass is made of: target selection and the [`engine::target::Target`]
//!   record, dirty sources, checksums, the index, the scan, and marking.
//! - [`daemon`]: passes over live targets: domains, back-off, ksmd pacing, accounting.
//! - [`service`]: what operators touch: the configuration file, status and metrics.
//! - [`tools`]: measuring rksm: `rksm trace`, the synthetic workload, and `rksm bench`.

pub mod daemon;
pub mod ebpf;
pub mod engine;
pub mod kernel;
pub mod service;
pub mod tools;

/// `Display` and `FromStr` for a [`clap::ValueEnum`], spelled as the command line and the
/// configuration file spell it, so that each such enum is defined once, by its derive. An
/// unknown name is refused with the enum's `noun` and every known name.
#[macro_export]
macro_rules! value_enum_text {
    ($($ty:ty => $noun:literal),+ $(,)?) => {$(
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let value = clap::ValueEnum::to_possible_value(self)
                    .expect("no variant is skipped");
                f.write_str(value.get_name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                <$ty as clap::ValueEnum>::from_str(s, false).map_err(|_| {
                    let names: Vec<String> = <$ty as clap::ValueEnum>::value_variants()
                        .iter()
                        .filter_map(clap::ValueEnum::to_possible_value)
                        .map(|v| v.get_name().to_string())
                        .collect();
                    format!("unknown {} `{s}` (expected {})", $noun, names.join(", "))
                })
            }
        }
    )+};
}

#[cfg(test)]
mod tests {
    use std::{fs, path::Path};

    /// Each layer and the layers below it that it may use.
    const LAYERS: [(&str, &[&str]); 6] = [
        ("kernel", &[]),
        ("ebpf", &["kernel"]),
        ("engine", &["kernel", "ebpf"]),
        ("daemon", &["kernel", "ebpf", "engine"]),
        ("service", &["kernel", "ebpf", "engine", "daemon"]),
        ("tools", &["kernel", "ebpf", "engine", "daemon", "service"]),
    ];

    /// The layers a source file names in `crate::` paths, top-level or inside `use crate::{..}`.
    fn layers_used(source: &str) -> Vec<&'static str> {
        let mut used = Vec::new();
        for (layer, _) in LAYERS {
            let named = source.match_indices(&format!("{layer}::")).any(|(at, _)| {
                let before = source[..at].trim_end_matches([' ', '\n']);
                before.ends_with("crate::") || before.ends_with("crate::{") || {
                    // An item of a `use crate::{...}` list.
                    let open = before.rfind("use crate::{");
                    let closed = before.rfind("};");
                    open.is_some_and(|o| closed.is_none_or(|c| c < o))
                        && (before.ends_with(',') || before.ends_with('{'))
                }
            });
            if named {
                used.push(layer);
            }
        }
        used
    }

    /// The source files under `dir`, in its folders too.
    fn sources(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files.extend(sources(&path));
            } else {
                files.push(path);
            }
        }
        files
    }

    #[test]
    fn each_layer_uses_only_the_layers_below_it() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        for (layer, below) in LAYERS {
            let files = sources(&src.join(layer));
            assert!(files.len() > 2, "{layer}: {files:?}");
            for path in files {
                let source = fs::read_to_string(&path).unwrap();
                for used in layers_used(&source) {
                    assert!(
                        used == layer || below.contains(&used),
                        "{} ({layer}) uses {used}, a layer above it",
                        path.display()
                    );
                }
            }
        }
    }

    #[test]
    fn the_layer_check_sees_both_spellings() {
        assert_eq!(
            layers_used("use crate::{\n    daemon::X,\n    kernel::procfs,\n};"),
            ["kernel", "daemon"]
        );
        assert_eq!(
            layers_used("let x = crate::tools::bench::run();"),
            ["tools"]
        );
        assert_eq!(
            layers_used("use crate::{kernel::{ranges::{Range}}};"),
            ["kernel"]
        );
        assert!(layers_used("// the daemon:: layer, in prose").is_empty());
    }
}
