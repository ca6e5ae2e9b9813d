//! A dependency-free SVG plot of a transfer sweep: throughput against chunk size, one
//! line per number of transfers in flight, with the measured TCP, memcpy and staged-pipeline limits.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::p2p::Point;

/// A round tick step (1, 2 or 5 × a power of ten) giving at most about `ticks` ticks up
/// to `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    if !(max.is_finite() && max > 0.0) {
        return 1.0;
    }
    let raw = max / ticks;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Tick values `0, step, 2·step, …` up to the first at or above `max`, and their labels
/// (as few decimals as the step needs).
fn ticks(max: f64, n: f64) -> (Vec<f64>, Vec<String>) {
    let step = nice_step(max, n);
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    let count = (max / step - 1e-9).ceil().max(1.0) as usize;
    let vals: Vec<f64> = (0..=count).map(|i| i as f64 * step).collect();
    let labels = vals.iter().map(|v| format!("{v:.decimals$}")).collect();
    (vals, labels)
}

/// Vertical positions for labels wanted at `ys` (any order), moved apart so that no
/// two are closer than `gap`, and kept within `[lo, hi]` where they fit.
fn spread(ys: &[f64], gap: f64, lo: f64, hi: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..ys.len()).collect();
    order.sort_by(|&a, &b| ys[a].total_cmp(&ys[b]));
    let mut out = ys.to_vec();
    let mut prev = f64::NEG_INFINITY;
    for &i in &order {
        out[i] = ys[i].max(lo).max(prev + gap);
        prev = out[i];
    }
    // Pushed past the bottom: shift the stack back up as far as the top allows.
    if let Some(&last) = order.last() {
        let over = out[last] - hi;
        if over > 0.0 {
            for &i in &order {
                out[i] -= over;
            }
        }
    }
    out
}

pub fn svg(points: &[Point]) -> String {
    let (w, h, ml, mr, mt, mb) = (800.0, 470.0, 70.0, 230.0, 40.0, 90.0);
    let pw = w - ml - mr;
    let ph = h - mt - mb;
    // Limits are measured at every point; draw their medians.
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let tcp = median(points.iter().map(|p| p.tcp_limit_gbps).collect());
    let memcpy = median(points.iter().map(|p| p.memcpy_gbps).collect());
    let pipeline = median(points.iter().map(|p| p.pipeline_limit_gbps).collect());
    // Axes end on a round tick just above the data (and the limits drawn).
    let (yticks, ylabels) = ticks(
        points
            .iter()
            .map(|p| p.gbps)
            .fold(tcp.max(memcpy).max(pipeline), f64::max)
            * 1.05,
        5.0,
    );
    let ymax = *yticks.last().unwrap_or(&1.0);
    let xs: Vec<f64> = points.iter().map(|p| p.chunk_bytes as f64 / (1 << 20) as f64).collect();
    let (xticks, xlabels) = ticks(xs.iter().cloned().fold(0.0, f64::max) * 1.05, 4.0);
    let xmax = *xticks.last().unwrap_or(&1.0);
    let x = |v: f64| ml + v / xmax.max(1e-9) * pw;
    let y = |v: f64| mt + ph - v / ymax.max(1e-9) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">kvferry transfer throughput (loopback, every byte verified; median limits)</text>"#,
        ml + pw / 2.0
    );
    // Axes and grid.
    for (v, label) in yticks.iter().zip(&ylabels) {
        let _ = write!(
            s,
            r##"<line x1="{ml}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{label}</text>"##,
            ml + pw,
            ml - 6.0,
            y(*v) + 4.0,
            y0 = y(*v)
        );
    }
    for (v, label) in xticks.iter().zip(&xlabels) {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{label}</text>"#,
            x(*v),
            mt + ph + 18.0
        );
    }
    let _ = write!(
        s,
        r#"<line x1="{ml}" x2="{ml}" y1="{mt}" y2="{}" stroke="black"/><line x1="{ml}" x2="{}" y1="{}" y2="{}" stroke="black"/>"#,
        mt + ph,
        ml + pw,
        mt + ph,
        mt + ph
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">chunk size (MiB)</text>"#,
        ml + pw / 2.0,
        mt + ph + 40.0
    );
    let _ = write!(
        s,
        r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">GB/s</text>"#,
        mt + ph / 2.0
    );
    // Limits: dashed lines across the plot, labelled in the right margin (labels moved
    // apart when limits are close; the legend is below the plot, clear of them).
    let limits: Vec<(&str, f64, &str)> = [
        ("raw TCP limit", tcp, "#c0392b"),
        ("memcpy limit", memcpy, "#7f8c8d"),
        ("staged-pipeline limit", pipeline, "#e67e22"),
    ]
    .into_iter()
    .filter(|l| l.1 > 0.0)
    .collect();
    let label_ys = spread(
        &limits.iter().map(|l| y(l.1) + 4.0).collect::<Vec<_>>(),
        15.0,
        mt + 4.0,
        mt + ph + 4.0,
    );
    for ((name, v, color), ly) in limits.iter().zip(label_ys) {
        let _ = write!(
            s,
            r#"<line x1="{ml}" x2="{}" y1="{yy}" y2="{yy}" stroke="{color}" stroke-dasharray="6,4"/><text x="{}" y="{ly:.1}" fill="{color}">{name} {v:.2}</text>"#,
            ml + pw,
            ml + pw + 8.0,
            yy = y(*v)
        );
    }
    // One line per in-flight count.
    let mut series: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for p in points {
        series
            .entry(p.in_flight)
            .or_default()
            .push((p.chunk_bytes as f64 / (1 << 20) as f64, p.gbps));
    }
    let colors = ["#2980b9", "#27ae60", "#8e44ad", "#d35400", "#16a085"];
    for (i, (inflight, mut pts)) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = colors[i % colors.len()];
        let path: Vec<String> = pts.iter().map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b))).collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for (a, b) in &pts {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                x(*a),
                y(*b)
            );
        }
        // Legend: one row under the axis title, outside the plot and the limits' labels.
        let ly = h - 16.0;
        let lx = ml + 120.0 * i as f64;
        let _ = write!(
            s,
            r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{inflight} in flight</text>"#,
            lx + 20.0,
            lx + 26.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(ticks(9.3, 5.0).1, ["0", "2", "4", "6", "8", "10"]);
        assert_eq!(ticks(4.2, 4.0).1, ["0", "2", "4", "6"]);
        assert_eq!(ticks(0.7, 5.0).1, ["0.0", "0.2", "0.4", "0.6", "0.8"]);
        // Chunk sizes of the default sweep: 0.625–3.75 MiB.
        assert_eq!(ticks(3.75 * 1.05, 4.0).1, ["0", "1", "2", "3", "4"]);
        for max in [0.013, 0.9, 1.0, 3.3, 7.77, 12.5, 64.0, 1234.0] {
            let (v, l) = ticks(max, 5.0);
            assert!(*v.last().unwrap() >= max, "{max}: {l:?}");
            assert!(v.len() <= 7, "{max}: {l:?}");
            let step = v[1];
            let lead = step / 10f64.powf(step.log10().floor());
            assert!([1.0, 2.0, 5.0].iter().any(|m| (lead - m).abs() < 1e-9), "{max}: {l:?}");
            assert_eq!(l[1].parse::<f64>().unwrap(), step, "{max}: {l:?}");
        }
    }

    #[test]
    fn close_labels_are_moved_apart_within_bounds() {
        let ys = spread(&[100.0, 104.0, 300.0], 15.0, 40.0, 380.0);
        assert_eq!(ys, [100.0, 115.0, 300.0]);
        let ys = spread(&[379.0, 380.0, 381.0], 15.0, 40.0, 380.0);
        assert!(ys.iter().all(|y| *y <= 380.0), "{ys:?}");
        assert!((ys[1] - ys[0]).abs() >= 15.0 - 1e-9 && (ys[2] - ys[1]).abs() >= 15.0 - 1e-9);
    }
}
