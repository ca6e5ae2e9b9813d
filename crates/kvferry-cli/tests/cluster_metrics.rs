//! Per-rank step outcome counters of the cluster [`Leader`], with real worker processes
//! (`kvferry worker`): successes, failures, a timeout (a hung rank) and a death (a
//! SIGKILL), and their rendering as `kvferry_step_outcomes_total`.

use std::sync::Arc;
use std::time::Duration;

use kvferry::cluster::{ClusterError, Leader, LeaderConfig, StepOp, StepOutcomeCounts, WorkerFault};
use kvferry::metrics::{render, MetricsSource, Registry, Samples};

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_outcomes_are_counted_per_rank_and_rendered() {
    let config = LeaderConfig::new(env!("CARGO_BIN_EXE_kvferry"), 2)
        .step_timeout(Duration::from_millis(400))
        .fault(1, WorkerFault::Hang, 3);
    let leader = Arc::new(Leader::start(config).await.unwrap());
    let echo = || StepOp::Echo { payload: vec![1] };

    leader.run_step(echo()).await.unwrap();
    let err = leader
        .run_step(StepOp::Fail { message: "boom".into() })
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::RankFailed { .. }), "{err}");
    // The second rank's failure may arrive after the step resolved: counted all the same.
    eventually("both failures counted", || {
        leader.step_outcomes().iter().all(|c| c.failure == 1)
    })
    .await;
    let err = leader.run_step(echo()).await.unwrap_err();
    assert!(matches!(err, ClusterError::Timeout { rank: 1, .. }), "{err}");
    leader.kill_rank(1).unwrap();
    let err = leader.run_step(echo()).await.unwrap_err();
    assert!(matches!(err, ClusterError::WorkerDied { rank: 1, .. }), "{err}");
    eventually("rank 0 answered step 4", || leader.step_outcomes()[0].success == 3).await;

    assert_eq!(
        leader.step_outcomes(),
        vec![
            StepOutcomeCounts {
                success: 3,
                failure: 1,
                timeout: 0,
                died: 0
            },
            StepOutcomeCounts {
                success: 1,
                failure: 1,
                timeout: 1,
                died: 1
            },
        ]
    );

    let mut samples = Samples::new();
    leader.collect(&mut samples);
    let direct = render(samples);
    let registry = Registry::new();
    let l = leader.clone();
    registry.register(move |out: &mut Samples| l.collect(out));
    let out = registry.render();
    // The registry adds `kvferry_build_info` before its sources.
    let (build, rest) = out.split_at(out.find("# HELP kvferry_step_outcomes ").expect("the family"));
    assert!(build.starts_with("# HELP kvferry_build "), "{out}");
    assert_eq!(rest, direct.as_str());
    assert!(out.contains("# TYPE kvferry_step_outcomes counter\n"), "{out}");
    let scrape = prometheus_parse::Scrape::parse(out.lines().map(|l| Ok(l.to_string()))).unwrap();
    let parsed = |rank: &str, outcome: &str| {
        scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "kvferry_step_outcomes_total"
                    && s.labels.get("rank") == Some(rank)
                    && s.labels.get("outcome") == Some(outcome)
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Untyped(v) | prometheus_parse::Value::Counter(v) => v,
                ref other => panic!("{other:?}"),
            })
            .unwrap_or_else(|| panic!("no rank {rank} {outcome} in\n{out}"))
    };
    assert_eq!(parsed("1", "died"), 1.0);
    assert_eq!(parsed("0", "success"), 3.0);
    for line in [
        r#"kvferry_step_outcomes_total{rank="0",outcome="success"} 3"#,
        r#"kvferry_step_outcomes_total{rank="0",outcome="timeout"} 0"#,
        r#"kvferry_step_outcomes_total{rank="1",outcome="success"} 1"#,
        r#"kvferry_step_outcomes_total{rank="1",outcome="failure"} 1"#,
        r#"kvferry_step_outcomes_total{rank="1",outcome="timeout"} 1"#,
        r#"kvferry_step_outcomes_total{rank="1",outcome="died"} 1"#,
    ] {
        assert!(out.lines().any(|l| l == line), "missing {line} in\n{out}");
    }
}
