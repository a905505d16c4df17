//! Records the git commit the binary was built from, so benchmark results name it, and lists the
//! sources of `src/ops` for the unit test that keeps `ops::all_kernels` complete (embedded at
//! compile time, so that the test binary runs wherever it is moved).

fn main() {
    let commit = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GRAPHED_COMMIT={commit}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/index");
    ops_sources();
}

/// Writes `ops_sources.rs` into `OUT_DIR`: a `&[(file name, contents)]` expression of every `.rs`
/// file of `src/ops`, each through `include_str!`, sorted by name.
fn ops_sources() {
    let dir = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("src/ops");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("src/ops is readable")
        .map(|e| e.expect("src/ops is readable").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    let entries: Vec<String> = files
        .iter()
        .map(|p| {
            let name = p.file_name().expect("a file").to_string_lossy();
            format!("({name:?}, include_str!({:?}))", p.display().to_string())
        })
        .collect();
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets it")).join("ops_sources.rs");
    std::fs::write(out, format!("&[{}]", entries.join(", "))).expect("OUT_DIR is writable");
}
