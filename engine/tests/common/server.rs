//! A real `kiln serve` process on a free loopback port, for end-to-end tests; killed when
//! dropped. Its logs go to a file under the system temp dir, named in failures.
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub log: PathBuf,
}

impl Server {
    /// Starts `kiln serve --port 0 ARGS...` (the embedded model unless ARGS give --model)
    /// and waits until it listens.
    pub fn start(args: &[&str]) -> Server {
        let log = std::env::temp_dir().join(format!(
            "kiln-serve-test-{}-{}.log",
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["serve", "--port", "0"])
            .args(args)
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .env(
                "RUST_LOG",
                "info,kiln=debug,cubecl_wgpu=warn,wgpu_core=warn,wgpu_hal=warn",
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("kiln serve starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!(
                    "kiln serve did not start; log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        let url = line
            .strip_prefix("kiln serve listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Server { child, url, log }
    }

    /// A metric's value from `/metrics` (first sample of that name).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .expect("metrics answer")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
