//! `graphed bench parity` on the simulator: the file PyTorch's side loads holds every parameter
//! of the benchmark model under its module's name, its gradient, the input, the output and their
//! gradients, with the shapes those names imply, and metadata that says how to read them
//! (`bench/torch_reference.py parity` does the comparison; CI has no PyTorch).

use std::collections::BTreeMap;
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, SafeTensors};

fn graphed(args: &[&str]) -> Output {
    // Under a nextest archive (the GPU machine) the binary is elsewhere; nextest says where.
    let exe = std::env::var("NEXTEST_BIN_EXE_graphed").unwrap_or_else(|_| env!("CARGO_BIN_EXE_graphed").to_string());
    Command::new(exe).args(args).output().expect("the binary runs")
}

/// Every parameter of configuration S's 8 layers (d = 256) and its shape, as PyTorch's
/// `torch.nn.Linear` (`[out, in]`) and `LayerNorm` shape them.
fn parameters(d: usize, layers: usize) -> BTreeMap<String, Vec<usize>> {
    let per_layer = [
        ("ln1.weight", vec![d]),
        ("ln1.bias", vec![d]),
        ("attn.qkv.weight", vec![3 * d, d]),
        ("attn.qkv.bias", vec![3 * d]),
        ("attn.proj.weight", vec![d, d]),
        ("attn.proj.bias", vec![d]),
        ("ln2.weight", vec![d]),
        ("ln2.bias", vec![d]),
        ("mlp.fc1.weight", vec![4 * d, d]),
        ("mlp.fc1.bias", vec![4 * d]),
        ("mlp.fc2.weight", vec![d, 4 * d]),
        ("mlp.fc2.bias", vec![d]),
    ];
    (0..layers).flat_map(|l| per_layer.iter().map(move |(n, s)| (format!("layer{l}.{n}"), s.clone()))).collect()
}

#[test]
fn the_file_holds_every_parameter_its_gradient_and_the_step_under_module_names() {
    let path = std::env::temp_dir().join(format!("graphed-parity-{}.safetensors", std::process::id()));
    let out = graphed(&[
        "bench",
        "parity",
        "--device",
        "sim",
        "--config",
        "S",
        "--dtype",
        "bf16",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let file = SafeTensors::deserialize(&bytes).unwrap();

    let (d, activation) = (256, vec![2, 64, 256]);
    let mut expected = parameters(d, 8);
    let grads: Vec<_> = expected.iter().map(|(n, s)| (format!("grad.{n}"), s.clone())).collect();
    expected.extend(grads);
    for name in ["input", "output", "grad.input", "grad.output"] {
        expected.insert(name.to_string(), activation.clone());
    }
    let found: BTreeMap<String, Vec<usize>> =
        file.tensors().into_iter().map(|(n, t)| (n, t.shape().to_vec())).collect();
    assert_eq!(found, expected);

    for (name, t) in file.tensors() {
        assert_eq!(t.dtype(), Dtype::BF16, "{name}");
        let values: Vec<f32> =
            t.data().chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert!(values.iter().all(|v| v.is_finite()), "{name} is not finite");
        // The step ran: every gradient (each a sum over the step's 128 rows) and the output
        // hold values, not the zeros the store starts with.
        if name.starts_with("grad.") || name == "output" {
            assert!(values.iter().any(|v| *v != 0.0), "{name} is all zeros");
        }
    }
    assert_ne!(file.tensor("output").unwrap().data(), file.tensor("input").unwrap().data());

    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta: BTreeMap<String, String> = serde_json::from_str(&header.metadata().as_ref().unwrap()["graphed"]).unwrap();
    let expect = [("config", "S"), ("dim", "256"), ("layers", "8"), ("heads", "4"), ("batch", "2"), ("seq", "64")];
    for (key, value) in expect.into_iter().chain([("dtype", "bf16"), ("linear_weight", "[out, in]"), ("gelu", "tanh")])
    {
        assert_eq!(meta.get(key).map(String::as_str), Some(value), "metadata {key}");
    }
}

#[test]
fn configurations_too_large_for_the_simulator_are_refused() {
    let path = std::env::temp_dir().join(format!("graphed-parity-m-{}.safetensors", std::process::id()));
    let out = graphed(&["bench", "parity", "--device", "sim", "--config", "M", "--out", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("pass `--config S`"), "{stderr}");
    assert!(!path.exists());
}
