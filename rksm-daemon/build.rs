//! Embeds the eBPF object built by `cargo xtask build` into the daemon, so the `rksm` binary
//! is self-contained. Without the object (a plain `cargo build` or `cargo clippy` on a machine
//! without the eBPF toolchain) the daemon still builds, and the tracer says at run time how to
//! get a binary that has it.

use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=RKSM_EBPF_OBJECT");
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let object = env::var_os("RKSM_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            manifest_dir.join("../rksm-ebpf/target/bpfel-unknown-none/release/rksm")
        });
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").expect("set by cargo")).join("rksm.bpf.o");
    let bytes = fs::read(&object).unwrap_or_default();
    if bytes.is_empty() {
        println!(
            "cargo:warning=no eBPF object at {}: this rksm will not be able to trace; build with `cargo xtask build`",
            object.display()
        );
    }
    fs::write(&out, bytes).expect("OUT_DIR is writable");
}
