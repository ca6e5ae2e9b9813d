//! A dependency-free SVG plot of a transfer sweep: throughput against chunk size, one
//! line per number of transfers in flight, with the measured TCP, memcpy and staged-pipeline limits.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::p2p::Point;

pub fn svg(points: &[Point]) -> String {
    let (w, h, ml, mr, mt, mb) = (800.0, 440.0, 70.0, 230.0, 40.0, 60.0);
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
    let ymax = points.iter().map(|p| p.gbps).fold(tcp.max(memcpy), f64::max) * 1.1;
    let xs: Vec<f64> = points.iter().map(|p| p.chunk_bytes as f64 / (1 << 20) as f64).collect();
    let xmax = xs.iter().cloned().fold(0.0, f64::max) * 1.1;
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
    for i in 0..=5 {
        let v = ymax / 5.0 * i as f64;
        let _ = write!(
            s,
            r##"<line x1="{ml}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{v:.1}</text>"##,
            ml + pw,
            ml - 6.0,
            y(v) + 4.0,
            y0 = y(v)
        );
    }
    for i in 0..=4 {
        let v = xmax / 4.0 * i as f64;
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{v:.1}</text>"#,
            x(v),
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
        h - 18.0
    );
    let _ = write!(
        s,
        r#"<text transform="translate(18,{}) rotate(-90)" text-anchor="middle">GB/s</text>"#,
        mt + ph / 2.0
    );
    // Limits.
    for (name, v, color) in [
        ("raw TCP limit", tcp, "#c0392b"),
        ("memcpy limit", memcpy, "#7f8c8d"),
        ("staged-pipeline limit", pipeline, "#e67e22"),
    ] {
        if v > 0.0 {
            let _ = write!(
                s,
                r#"<line x1="{ml}" x2="{}" y1="{yy}" y2="{yy}" stroke="{color}" stroke-dasharray="6,4"/><text x="{}" y="{}" fill="{color}">{name} {v:.2}</text>"#,
                ml + pw,
                ml + pw + 8.0,
                y(v) + 4.0,
                yy = y(v)
            );
        }
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
        let ly = mt + ph * 0.6 + 18.0 * i as f64;
        let _ = write!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{inflight} in flight</text>"#,
            ml + pw + 8.0,
            ml + pw + 28.0,
            ml + pw + 34.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}
