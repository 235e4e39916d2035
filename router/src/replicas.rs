//! Where the replica list comes from: `--replica URL` flags and a `--replicas-file`.
//!
//! The file holds one base URL a line; blank lines and `#` comments are skipped. The
//! list is re-read on SIGHUP and whenever the file's modification time changes, so
//! replicas join and leave without a restart. URLs must be `http://` (the router speaks
//! plain HTTP to replicas on a private network); a trailing `/` is dropped and
//! duplicates are kept once, in first-seen order.

use crate::error::RouterError;
use std::path::PathBuf;
use std::time::SystemTime;

/// The configured sources of the replica list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaSource {
    /// URLs given on the command line.
    pub urls: Vec<String>,
    /// The replica file, if any.
    pub file: Option<PathBuf>,
}

impl ReplicaSource {
    /// The current list: command-line URLs, then the file's.
    pub fn load(&self) -> Result<Vec<String>, RouterError> {
        let mut list = Vec::new();
        for url in &self.urls {
            push_url(&mut list, url, "the command line", 1)?;
        }
        if let Some(path) = &self.file {
            let text =
                std::fs::read_to_string(path).map_err(|source| RouterError::ReplicaFile {
                    path: path.clone(),
                    source,
                })?;
            let origin = path.display().to_string();
            for (i, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if !line.is_empty() {
                    push_url(&mut list, line, &origin, i + 1)?;
                }
            }
        }
        Ok(list)
    }

    /// The replica file's modification time (`None` without a file or if unreadable).
    pub fn file_stamp(&self) -> Option<SystemTime> {
        std::fs::metadata(self.file.as_ref()?)
            .and_then(|m| m.modified())
            .ok()
    }
}

fn push_url(
    list: &mut Vec<String>,
    url: &str,
    origin: &str,
    line: usize,
) -> Result<(), RouterError> {
    let url = url.trim().trim_end_matches('/');
    let host = url.strip_prefix("http://").unwrap_or("");
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(RouterError::BadReplica {
            address: url.to_string(),
            origin: origin.to_string(),
            line,
        });
    }
    if !list.iter().any(|u| u == url) {
        list.push(url.to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_adds_to_the_command_line_without_duplicates() {
        let path =
            std::env::temp_dir().join(format!("kiln-router-replicas-{}.txt", std::process::id()));
        std::fs::write(
            &path,
            "# pool\nhttp://b:1/\n\nhttp://a:1  # again\nhttp://c:1\n",
        )
        .unwrap();
        let source = ReplicaSource {
            urls: vec!["http://a:1".into()],
            file: Some(path.clone()),
        };
        assert_eq!(
            source.load().unwrap(),
            vec!["http://a:1", "http://b:1", "http://c:1"]
        );
        assert!(source.file_stamp().is_some());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_non_http_address_is_refused_with_its_line() {
        let source = ReplicaSource {
            urls: vec!["https://a".into()],
            file: None,
        };
        let err = source.load().unwrap_err().to_string();
        assert!(err.contains("https://a") && err.contains("line 1"), "{err}");
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let source = ReplicaSource {
            urls: vec![],
            file: Some("/nonexistent/replicas".into()),
        };
        assert!(source
            .load()
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/replicas"));
    }
}
