//! A real `kiln serve` process on a free loopback port, for end-to-end tests; killed when
//! dropped. Its logs go to a file under the system temp dir, named in failures.
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The embedded model with random weights that loads in milliseconds.
pub const TINY: &str = "kiln-tiny-random";

pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub log: PathBuf,
}

impl Server {
    /// Starts `kiln serve --port 0 ARGS...` (the tiny random model unless ARGS give
    /// --model or --synthetic) and waits until it listens.
    pub fn start(args: &[&str]) -> Server {
        let tiny = ["--model", TINY];
        let model: &[&str] = if args.contains(&"--model") || args.contains(&"--synthetic") {
            &[]
        } else {
            &tiny
        };
        let log = std::env::temp_dir().join(format!(
            "kiln-serve-test-{}-{}.log",
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["serve", "--port", "0"])
            .args(model)
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

    /// Sends SIGTERM (what `kill`, systemd and Kubernetes send to stop a server).
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits up to `timeout` for the process to exit: its status, `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = std::time::Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A metric's value from `/metrics` (first sample of that name).
    pub fn metric(&self, name: &str) -> f64 {
        let text = http_get(&format!("{}/metrics", self.url));
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}; log: {}", self.log.display()))
    }
}

/// A plain HTTP/1.1 GET over a loopback socket: the body. Blocking and dependency-free,
/// so synchronous tests can read `/metrics` too.
pub fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut s = std::net::TcpStream::connect(host).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    body.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
