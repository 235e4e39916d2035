//! The proxy over real loopback HTTP against in-process stand-in replicas (axum servers
//! that answer at once and say which replica they are): streams pass through byte for
//! byte, headerless conversations keep their replica, a dead replica is retried once and
//! drained, and the replica file is reloaded without a restart.

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use kiln_router::placer::Placer;
use kiln_router::policy::{KilnParams, PolicyName};
use kiln_router::proxy::{app, AppState};
use kiln_router::replicas::ReplicaSource;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

const SSE: [&str; 3] = [
    "data: {\"delta\":\"o\"}\n\n",
    "data: {\"delta\":\"k\"}\n\n",
    "data: [DONE]\n\n",
];

/// A stand-in replica named `name`: chat answers carry `x-replica: name`.
async fn stand_in(name: &'static str) -> String {
    let chat = move |body: String| async move {
        if body.contains("\"stream\":true") {
            let chunks =
                futures_util::stream::iter(SSE.map(|c| Ok::<_, std::io::Error>(c.to_string())));
            return ([("x-replica", name)], Body::from_stream(chunks)).into_response();
        }
        (
            [("x-replica", name), ("content-type", "application/json")],
            "{\"ok\":true}",
        )
            .into_response()
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(
            "/metrics",
            get(|| async { "kiln_num_running_reqs 0\nkiln_kv_usage 0\n" }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// A URL where nothing listens (a port bound, then released).
fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

async fn router(source: ReplicaSource) -> (String, Arc<AppState>) {
    let state = Arc::new(
        AppState::new(
            Placer::new(PolicyName::Kiln, KilnParams::default(), 1),
            source,
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = state.clone();
    tokio::spawn(async move { axum::serve(listener, app(served)).await.unwrap() });
    (url, state)
}

fn chat(first_user: &str, turns: usize, stream: bool) -> serde_json::Value {
    let mut messages = vec![
        json!({"role": "system", "content": "agent"}),
        json!({"role": "user", "content": first_user}),
    ];
    for t in 1..turns {
        messages.push(json!({"role": "assistant", "content": format!("reply {t}")}));
        messages.push(json!({"role": "user", "content": format!("more {t}")}));
    }
    json!({"model": "m", "stream": stream, "messages": messages})
}

#[tokio::test]
async fn streamed_responses_pass_through_byte_for_byte() {
    let (url, _) = router(ReplicaSource {
        urls: vec![stand_in("a").await],
        file: None,
    })
    .await;
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("x", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.bytes().await.unwrap(), SSE.concat().as_bytes());
}

#[tokio::test]
async fn headerless_conversations_keep_their_replica_turn_after_turn() {
    let urls = vec![
        stand_in("a").await,
        stand_in("b").await,
        stand_in("c").await,
    ];
    let (url, _) = router(ReplicaSource { urls, file: None }).await;
    let client = reqwest::Client::new();
    for task in ["task one", "task two", "task three", "task four"] {
        let mut seen = Vec::new();
        for turns in 1..=4 {
            let response = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&chat(task, turns, false))
                .send()
                .await
                .unwrap();
            seen.push(
                response.headers()["x-replica"]
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
        }
        assert!(seen.iter().all(|r| r == &seen[0]), "{task}: {seen:?}");
    }
}

#[tokio::test]
async fn a_dead_replica_is_retried_once_elsewhere_and_drained() {
    let dead = dead_url();
    let (url, state) = router(ReplicaSource {
        urls: vec![dead.clone(), stand_in("a").await],
        file: None,
    })
    .await;
    let client = reqwest::Client::new();
    for s in 0..8 {
        let response = client
            .post(format!("{url}/v1/chat/completions"))
            .header("x-session-id", format!("s{s}"))
            .json(&chat("x", 1, false))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "session {s}");
    }
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kiln_router_retries_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("kiln_router_replica_up{{replica=\"{dead}\"}} 0")),
        "{metrics}"
    );
    assert_eq!(
        state
            .placer()
            .replicas()
            .iter()
            .map(|r| r.in_flight)
            .sum::<u32>(),
        0
    );
}

#[tokio::test]
async fn with_no_healthy_replica_left_a_request_gets_a_503_with_the_reason() {
    let (url, state) = router(ReplicaSource {
        urls: vec![dead_url()],
        file: None,
    })
    .await;
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("x", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert!(response
        .text()
        .await
        .unwrap()
        .contains("no healthy replica"));
    assert_eq!(state.placer().counters.retries, 1);
}

#[tokio::test]
async fn the_replica_file_is_reloaded_when_it_changes() {
    let path = std::env::temp_dir().join(format!("kiln-router-reload-{}.txt", std::process::id()));
    let (a, b) = (stand_in("a").await, stand_in("b").await);
    std::fs::write(&path, format!("{a}\n")).unwrap();
    let (_, state) = router(ReplicaSource {
        urls: vec![],
        file: Some(path.clone()),
    })
    .await;
    tokio::spawn(kiln_router::health::upkeep(
        state.clone(),
        Duration::from_millis(20),
    ));
    assert_eq!(state.placer().replicas().len(), 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    std::fs::write(&path, format!("{a}\n{b}\n")).unwrap();
    let mut names = Vec::new();
    for _ in 0..250 {
        names = state
            .placer()
            .replicas()
            .iter()
            .map(|r| r.name.clone())
            .collect::<Vec<_>>();
        if names.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::remove_file(&path).unwrap();
    assert_eq!(names, vec![a, b]);
}
