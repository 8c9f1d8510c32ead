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

    /// The crate paths a source file uses, each as its first two segments (`layer::module`),
    /// from `use crate::...;` trees (groups expanded) and from inline `crate::` paths. Its
    /// unit tests (a trailing `#[cfg(test)] mod tests`) are left out: they may use anything.
    fn modules_used(source: &str) -> Vec<String> {
        let source = source
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or(source);
        let mut used = Vec::new();
        let mut rest = source;
        while let Some(at) = rest.find("crate::") {
            let tail = &rest[at + "crate::".len()..];
            let end = tail
                .find(|c: char| !(c.is_alphanumeric() || "_:{}, \n*".contains(c)))
                .unwrap_or(tail.len());
            expand_tree("", &tail[..end], &mut used);
            rest = &tail[end..];
        }
        used.retain(|p| p.matches("::").count() >= 1);
        used.iter_mut().for_each(|p| {
            *p = p.split("::").take(2).collect::<Vec<_>>().join("::");
        });
        used.sort();
        used.dedup();
        used
    }

    /// Expands a use tree (`a::{b::{c, d}, e}`) into its paths, each prefixed by `prefix`.
    fn expand_tree(prefix: &str, tree: &str, out: &mut Vec<String>) {
        let tree = tree.trim();
        let Some(open) = tree.find('{') else {
            let path: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
            let path = path.trim_end_matches("::").trim_end_matches(",");
            if !path.is_empty() {
                out.push(format!("{prefix}{path}"));
            }
            return;
        };
        let head: String = tree[..open]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let prefix = format!("{prefix}{head}");
        let (mut depth, mut start) = (0, open + 1);
        for (i, c) in tree.char_indices().skip(open) {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        expand_tree(&prefix, &tree[start..i], out);
                        return;
                    }
                }
                ',' if depth == 1 => {
                    expand_tree(&prefix, &tree[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
    }

    #[test]
    fn no_two_modules_use_each_other() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut uses: Vec<(String, String)> = Vec::new();
        for (layer, _) in LAYERS {
            for path in sources(&src.join(layer)) {
                let relative = path.strip_prefix(&src).unwrap().with_extension("");
                let parts: Vec<&str> = relative.iter().map(|p| p.to_str().unwrap()).collect();
                // layer/module.rs or layer/module/...: the module is the second part.
                let module = format!("{}::{}", parts[0], parts.get(1).copied().unwrap_or("mod"));
                let source = fs::read_to_string(&path).unwrap();
                for used in modules_used(&source) {
                    if used != module && !used.ends_with("::mod") {
                        uses.push((module.clone(), used));
                    }
                }
            }
        }
        assert!(uses.len() > 50, "{uses:?}");
        let cycles: Vec<String> = uses
            .iter()
            .filter(|(a, b)| a < b && uses.contains(&(b.clone(), a.clone())))
            .map(|(a, b)| format!("{a} <-> {b}"))
            .collect();
        assert!(cycles.is_empty(), "modules that use each other: {cycles:?}");
    }

    #[test]
    fn the_module_check_expands_use_trees() {
        assert_eq!(
            modules_used(
                "use crate::{\n    engine::{dirty::{X, Y}, keys::KeySet},\n    kernel::procfs,\n};\nfn f() { crate::ebpf::tracer::load(); }\n#[cfg(test)]\nmod tests { use crate::daemon::Daemon; }"
            ),
            ["ebpf::tracer", "engine::dirty", "engine::keys", "kernel::procfs"]
        );
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
