//! Records the git commit the binary was built from, so benchmark results name it, and lists the
//! CUDA sources of `src/ops` for the unit test that keeps `ops::all_kernels` complete (embedded at
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

/// Writes `ops_sources.rs` into `OUT_DIR`: a `&[(path, contents)]` expression of every CUDA
/// source (`.cu`) under `src/ops`, each through `include_str!`, sorted by path.
fn ops_sources() {
    let dir = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("src/ops");
    let mut files = Vec::new();
    cuda_sources(&dir, &mut files);
    files.sort();
    let entries: Vec<String> = files
        .iter()
        .map(|p| {
            let name = p.strip_prefix(&dir).expect("under src/ops").to_string_lossy();
            format!("({name:?}, include_str!({:?}))", p.display().to_string())
        })
        .collect();
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("cargo sets it")).join("ops_sources.rs");
    std::fs::write(out, format!("&[{}]", entries.join(", "))).expect("OUT_DIR is writable");
}

/// Adds the `.cu` files of `dir` and its folders to `files`, and asks cargo to rerun on changes.
fn cuda_sources(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in std::fs::read_dir(dir).expect("src/ops is readable") {
        let path = entry.expect("src/ops is readable").path();
        if path.is_dir() {
            cuda_sources(&path, files);
        } else if path.extension().is_some_and(|e| e == "cu") {
            files.push(path);
        }
    }
}
