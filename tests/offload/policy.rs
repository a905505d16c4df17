//! The policy as a function of what the warmup recorded: sites, sizes, margin, budget, and the
//! automatic choice from timings (no device: the decisions are pure).

use graphed::device::DType;
use graphed::offload::{decide, GroupLayout, OffloadConfig, Policy, Summary, TensorLayout, Timings, Windows};

fn tensor(name: &str, numel: usize) -> TensorLayout {
    TensorLayout { name: name.into(), shape: vec![numel], dtype: DType::BF16, copyable: true, offload: false }
}

/// `units` transformer-like units: an attention group (input, q, k, v, probs, att) and an MLP
/// group (input, pre, act), `n` elements each, `pre` and `act` four times that, probs 16 times.
fn layout(units: usize, n: usize) -> Vec<GroupLayout> {
    (0..units)
        .flat_map(|p| {
            let attn = ["input", "q", "k", "v"]
                .iter()
                .map(|t| tensor(t, n))
                .chain([tensor("probs", 16 * n), tensor("att", n)]);
            let mlp = [tensor("input", n), tensor("pre", 4 * n), tensor("act", 4 * n)];
            [
                GroupLayout { site: format!("h{p}.attn"), pass: p, tensors: attn.collect() },
                GroupLayout { site: format!("h{p}.mlp"), pass: p, tensors: mlp.to_vec() },
            ]
        })
        .collect()
}

fn offloaded(groups: &[GroupLayout]) -> Vec<(usize, String)> {
    groups
        .iter()
        .flat_map(|g| g.tensors.iter().filter(|t| t.offload).map(move |t| (g.pass, format!("{}.{}", g.site, t.name))))
        .collect()
}

#[test]
fn listed_policy_takes_the_default_sites_outside_the_margin() {
    let mut g = layout(4, 1 << 16);
    decide(&OffloadConfig::default(), &mut g, None, &[]);
    let got = offloaded(&g);
    assert_eq!(got.len(), 2 * 6, "six tensors per unit, units 0 and 1 (the last two are the margin): {got:?}");
    assert!(got.iter().all(|(p, n)| *p < 2 && !n.ends_with("probs") && !n.ends_with("pre")), "{got:?}");
    let mut g = layout(4, 1 << 16);
    decide(&OffloadConfig::default().margin(0), &mut g, None, &[]);
    assert_eq!(offloaded(&g).len(), 24, "no margin: every unit");
}

/// The expected saving at the peak: with one unit kept, the next-to-last unit's copy saves
/// nothing (it is prefetched while the last unit's activations are there); two kept units save
/// every offloaded byte, as much as one kept unit does; three save one unit's.
#[test]
fn the_expected_saving_counts_the_prefetch_only_where_it_sets_the_peak() {
    let unit = 6 * (1 << 16) * 2;
    for (margin, offloaded_units, saved_units) in [(1, 3, 2), (2, 2, 2), (3, 1, 1), (4, 0, 0)] {
        let config = OffloadConfig::default().margin(margin);
        let mut g = layout(4, 1 << 16);
        decide(&config, &mut g, None, &[]);
        let s = Summary::from_layouts(&[(Default::default(), &g)], None, &config, &[]);
        assert_eq!(s.offloaded_bytes(), offloaded_units * unit, "margin {margin}: {s}");
        assert_eq!(s.expected_peak_saving(), (saved_units * unit) as i64, "margin {margin}: {s}");
    }
}

/// In pages, the expected saving bounds the reserved peak's fall: between the whole pages within
/// it and the pages that cover it. A saving of six 128 KiB tensors (768 KiB) in 2 MiB pages
/// lowers the reserved peak by 0 or 2 MiB, twelve (1.5 MiB) in 512 KiB pages by exactly 1.5 MiB,
/// and nothing is said without pages.
#[test]
fn the_expected_saving_in_pages_bounds_the_reserved_fall() {
    const KIB: i64 = 1024;
    for (margin, page, want) in [(3, 2048 * KIB, 0..=2048 * KIB), (2, 512 * KIB, 1536 * KIB..=1536 * KIB)] {
        let config = OffloadConfig::default().margin(margin);
        let mut g = layout(4, 1 << 16);
        decide(&config, &mut g, None, &[]);
        let s = Summary::from_layouts(&[(Default::default(), &g)], None, &config, &[]);
        assert_eq!(s.expected_reserved_saving(), None, "no pages, no range: {s}");
        let s = s.in_pages(Some(page as usize));
        assert_eq!(s.expected_reserved_saving(), Some(want.clone()), "margin {margin}, pages of {page} B: {s}");
        let said = s.to_string().contains("reserved peak falls by");
        assert_eq!(said, want.start() != want.end(), "the summary names the range only when it is one: {s}");
    }
}

#[test]
fn small_tensors_and_the_budget_stay_on_the_device() {
    let mut g = layout(4, 1000);
    decide(&OffloadConfig::default(), &mut g, None, &[]);
    assert!(offloaded(&g).is_empty(), "below the minimum size");
    let mut g = layout(4, 1 << 16);
    let each = (1 << 16) * 2;
    decide(&OffloadConfig::default().max_bytes(7 * each), &mut g, None, &[]);
    let got = offloaded(&g);
    assert_eq!(got.len(), 7, "seven tensors fit the budget: {got:?}");
    assert!(got[..6].iter().all(|(p, _)| *p == 0), "earlier units first: {got:?}");
}

#[test]
fn auto_policy_fills_the_next_units_time_with_the_largest_tensors() {
    let n = 1 << 20;
    let each = (2 * n) as f64;
    let config = OffloadConfig::default()
        .policy(Policy::Auto)
        .sites(&graphed::offload::AUTO_CANDIDATES)
        .margin(1)
        .max_overhead(0.02);
    // The next unit's forward hides 10 tensors' worth of copy out, its backward 20 of copy back.
    let timings = graphed_windows(vec![10.0; 3], vec![20.0; 3], each);
    let mut g = layout(3, n);
    decide(&config, &mut g, Some(&timings), &[]);
    for p in 0..2 {
        let mine: Vec<_> = offloaded(&g).into_iter().filter(|(q, _)| *q == p).map(|(_, n)| n).collect();
        let bytes: usize = g.iter().filter(|x| x.pass == p).map(|x| x.offloaded_bytes()).sum();
        assert!(bytes as f64 <= 10.0 * each, "unit {p}: {bytes} B exceed the window");
        assert!(
            mine.iter().any(|t| t.ends_with("mlp.pre")) && mine.iter().any(|t| t.ends_with("mlp.act")),
            "largest first: {mine:?}"
        );
        assert_eq!(bytes as f64, 10.0 * each, "unit {p}: the window is filled ({mine:?})");
    }
    // A slow copy: nothing fits.
    let slow = Timings { out_bytes_per_ms: 1.0, ..timings.clone() };
    let mut g = layout(3, n);
    decide(&config, &mut g, Some(&slow), &[]);
    assert!(offloaded(&g).is_empty());
    // The summary reports the expected overlap.
    let mut g = layout(3, n);
    decide(&config, &mut g, Some(&timings), &[]);
    let s = Summary::from_layouts(&[(Default::default(), &g)], Some(&timings), &config, &[]);
    assert!(s.rows[0].expected_overlap() == Some(1.0) && s.rows[2].offloaded == 0, "{s}");
}

#[test]
fn auto_policy_keeps_what_the_graphed_windows_cannot_hide() {
    let n = 1 << 20;
    let each = 2 * n;
    let config = OffloadConfig::default()
        .policy(Policy::Auto)
        .sites(&graphed::offload::AUTO_CANDIDATES)
        .margin(1)
        .max_overhead(0.02);
    // Windows as the probe measures them in graph replays: unit 1's forward hides two tensors'
    // copies, unit 2's none, unit 3's ten.
    let timings = graphed_windows(vec![10.0, 2.0, 0.0, 10.0], vec![20.0; 4], each as f64);
    let mut g = layout(4, n);
    decide(&config, &mut g, Some(&timings), &[]);
    let s = Summary::from_layouts(&[(Default::default(), &g)], Some(&timings), &config, &[]);
    let offloaded: Vec<usize> = s.rows.iter().map(|r| r.offloaded).collect();
    assert_eq!(offloaded, [2 * each, 0, 10 * each, 0], "{s}");
    // The layer whose copy cannot hide keeps every candidate: 14 tensors' worth per unit.
    assert_eq!(s.rows[1].kept, 14 * each, "{s}");
    assert!(s.to_string().contains("graph replays (the median of 5)"), "{s}");
}

/// The automatic policy with a margin of one and a 2% budget over `layout(4, 1 << 20)` (tensors
/// of 2 MiB and its multiples), and graph windows that each hide ten 2 MiB copies, 1 ms each way:
/// a step of 4 · 30 = 120 ms. Returns the 2 MiB, the configuration and the windows.
fn ten_per_window() -> (usize, OffloadConfig, Timings) {
    let each = 2 << 20;
    let config = OffloadConfig::default()
        .policy(Policy::Auto)
        .sites(&graphed::offload::AUTO_CANDIDATES)
        .margin(1)
        .max_overhead(0.02);
    (each, config, graphed_windows(vec![10.0; 4], vec![20.0; 4], each as f64))
}

/// What `config` decides for `ten_per_window`'s layout under `t`, summarized.
fn decided(config: &OffloadConfig, t: &Timings) -> Summary {
    let mut g = layout(4, 1 << 20);
    decide(config, &mut g, Some(t), &[]);
    Summary::from_layouts(&[(Default::default(), &g)], Some(t), config, &[])
}

fn offloaded_per_unit(s: &Summary) -> Vec<usize> {
    s.rows.iter().map(|r| r.offloaded).collect()
}

#[test]
fn auto_policy_charges_copies_what_they_cost_the_kernels_beside_them() {
    let (each, config, free) = ten_per_window();
    assert_eq!(offloaded_per_unit(&decided(&config, &free)), [10 * each, 10 * each, 10 * each, 0]);
    // Copies that slow the passes beside them by a quarter of their time: each tensor costs
    // 0.25 ms out and 0.25 back, and 2% of the step (2.4 ms) pays for four of them, unit 0's
    // first; with no budget, nothing.
    let costly = Timings { forward_interference: vec![0.25; 4], backward_interference: vec![0.25; 4], ..free };
    let s = decided(&config, &costly);
    assert_eq!(offloaded_per_unit(&s), [4 * each, 0, 0, 0]);
    assert_eq!(offloaded_per_unit(&decided(&config.clone().max_overhead(0.0), &costly)), [0, 0, 0, 0]);
    assert_eq!(s.expected_cost_ms(), Some(2.0), "{s}");
    assert!(s.to_string().contains("expected cost 2.000 ms, 1.7% of the 120.000 ms step"), "{s}");
    // A share outside [0, 1] is refused.
    assert!(config.max_overhead(1.5).validate().is_err());
}

#[test]
fn auto_policy_charges_each_unit_once_for_the_graphs_that_carry_its_copies() {
    let (each, config, free) = ten_per_window();
    // Carrying copies costs each graph 0.5 ms whatever they copy: 1 ms per offloading unit (its
    // next unit's forward and backward), so 2% of the 120 ms step pays for two units whole.
    let carrying = Timings { forward_tail_ms: vec![0.5; 4], backward_tail_ms: vec![0.5; 4], ..free };
    let s = decided(&config, &carrying);
    assert_eq!(offloaded_per_unit(&s), [10 * each, 10 * each, 0, 0], "{s}");
    assert_eq!(s.expected_cost_ms(), Some(2.0), "{s}");
}

/// Windows as the probe measures them in graph replays, copies at `rate` bytes per ms each way.
fn graphed_windows(forward_ms: Vec<f64>, backward_ms: Vec<f64>, rate: f64) -> Timings {
    Timings::new(forward_ms, backward_ms, (rate, rate), Windows::Graphs { replays: 5 })
}

/// Under lent gradients (Note [Offloading lent memory]) the automatic policy keeps every unit
/// whose copies would not lower the pool's own peak: with lent memory that holds every unit
/// above the first, nothing; with little lent memory, what it chose without lending but the
/// last offloading unit, whose copies are still held while the peak is reached.
#[test]
fn auto_policy_under_lent_gradients_keeps_what_would_not_lower_the_peak() {
    let (each, config, free) = ten_per_window();
    let unit = 30 * each;
    let lent_decided = |lent: &[usize]| {
        let mut g = layout(4, 1 << 20);
        decide(&config, &mut g, Some(&free), lent);
        Summary::from_layouts(&[(Default::default(), &g)], Some(&free), &config, lent)
    };
    assert_eq!(offloaded_per_unit(&decided(&config, &free)), [10 * each, 10 * each, 10 * each, 0], "without lending");
    let ample = lent_decided(&[4 * unit; 4]);
    assert_eq!(offloaded_per_unit(&ample), [0; 4], "{ample}");
    assert_eq!(ample.expected_peak_saving(), 0, "{ample}");
    assert!(ample.to_string().contains("no copy would lower its own peak"), "{ample}");
    let scarce = lent_decided(&[each; 4]);
    assert_eq!(offloaded_per_unit(&scarce), [10 * each, 10 * each, 0, 0], "{scarce}");
    assert_eq!(scarce.expected_peak_saving(), 20 * each as i64, "{scarce}");
}
