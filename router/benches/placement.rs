//! Criterion benches of one placement decision at the scale (50 replicas, 250
//! live sessions): a session's next request (affinity lookup plus split check), a new
//! session (least-loaded scan), and the upkeep tick (recount plus rebalancing plan).

use criterion::{criterion_group, criterion_main, Criterion};
use kiln_router::placer::Placer;
use kiln_router::policy::{KilnParams, PolicyName};
use kiln_router::session::SessionKey;
use std::hint::black_box;

fn warm_placer(policy: PolicyName) -> Placer {
    let mut placer = Placer::new(policy, KilnParams::default(), 1);
    let names: Vec<String> = (0..50).map(|i| format!("http://10.0.0.{i}:8000")).collect();
    placer.set_replicas(&names, 0);
    for s in 0..250u64 {
        let p = placer
            .place(Some(SessionKey(s)), 0, None)
            .expect("replicas");
        placer.finish(Some(SessionKey(s)), p.replica);
    }
    placer
}

fn placement(c: &mut Criterion) {
    for policy in PolicyName::ALL {
        let mut placer = warm_placer(policy);
        c.bench_function(&format!("{policy}: next request of a live session"), |b| {
            let mut s = 0u64;
            b.iter(|| {
                s = (s + 1) % 250;
                let p = placer
                    .place(Some(SessionKey(black_box(s))), 1, None)
                    .expect("replicas");
                placer.finish(Some(SessionKey(s)), p.replica);
            })
        });
    }
    let mut placer = warm_placer(PolicyName::Kiln);
    c.bench_function("kiln: first request of a new session", |b| {
        let mut s = 1_000_000u64;
        b.iter(|| {
            s += 1;
            let p = placer
                .place(Some(SessionKey(black_box(s))), 1, None)
                .expect("replicas");
            placer.finish(Some(SessionKey(s)), p.replica);
        })
    });
    let mut placer = warm_placer(PolicyName::Kiln);
    c.bench_function("kiln: upkeep tick (250 sessions)", |b| {
        b.iter(|| placer.tick(black_box(1000)))
    });
}

criterion_group!(benches, placement);
criterion_main!(benches);
